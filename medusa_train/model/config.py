"""MedusaConfig: what a set of heads needs to be rebuilt, and the ONLY place head features are listed and checked.

A head feature changes what the heads read. Callers never branch on one: they ask ``MedusaModel``
(``head_features``, ``new_decode_state``), and export code asks ``native_only_features``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

FORMAT_VERSION = 1


@dataclass
class MedusaConfig:
    """What a set of heads needs to be rebuilt and attached to its backbone.

    Attributes:
        num_heads: Number of Medusa heads; head k (0-based) predicts the token k+2 ahead.
        num_layers: ResBlocks per head.
        hidden_size: Backbone hidden size the heads read.
        vocab_size: Output vocabulary of every head.
        share_lm_head: Heads project through the backbone's frozen LM head instead of their own.
        next_token_input: Each head also reads the embedding of the base model's next token (the
            tree's root), added inside its first ResBlock: ``x + SiLU(W x + b + U e)``. Only the
            native layout can hold such heads.
        path_input: With ``next_token_input``: head k reads the k + 1 tokens between its position
            and its target (the tree root and its path's earlier guesses), not the next one alone.
        prefix_attention: The heads read the output of one causal self-attention layer over the
            prefix's hidden states (``prefix_attention.py``), of ``prefix_attention_heads``
            attention heads and an MLP ``prefix_intermediate_size`` wide. Native layout only.
        draft_vocab_size: When set (K), the heads score only K tokens, the K most frequent targets of
            their training data, listed in the ``token_map`` tensor stored with them: head output i is
            token ``token_map[i]`` (vLLM's ``truncated_vocab_size`` + ``token_map``). The verify pass
            keeps the whole vocabulary, so greedy output is unchanged; a token outside the K is never
            guessed. ``None``: the whole vocabulary.
        base_model_name_or_path: The backbone these heads were trained on.
        dtype: Dtype the head weights were saved in.
        format_version: Version of this layout.
    """

    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    share_lm_head: bool = False
    next_token_input: bool = False
    path_input: bool = False
    prefix_attention: bool = False
    prefix_attention_heads: int = 0
    prefix_intermediate_size: int = 0
    draft_vocab_size: int | None = None
    base_model_name_or_path: str | None = None
    dtype: str = "float32"
    format_version: int = FORMAT_VERSION

    def __post_init__(self):
        if self.path_input and not self.next_token_input:
            raise ValueError("path_input=true needs next_token_input=true: the path starts with the next token "
                             "(set heads.next_token_input=true)")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size < self.vocab_size:
            raise ValueError(f"heads.vocab_size={self.draft_vocab_size}: a draft vocabulary must be between 1 and "
                             f"the backbone's {self.vocab_size - 1} tokens (null: the whole vocabulary)")

    @property
    def head_vocab_size(self) -> int:
        """How many tokens each head scores: the draft vocabulary's size, or the backbone's vocabulary."""
        return self.draft_vocab_size or self.vocab_size

    def token_inputs(self, k: int) -> int:
        """How many token embeddings head ``k`` reads: 0, 1 (the next token) or k + 1 (its path)."""
        if not self.next_token_input:
            return 0
        return k + 1 if self.path_input else 1

    vllm_method = "medusa"  #: vLLM's ``--speculative-config`` method that serves them
    guesser = "the heads"  #: what a tree's guesses come from, in reports

    @property
    def vllm_export_differs(self) -> bool:
        """Whether the ``vllm`` export serves other heads than these: a draft vocabulary sharing the LM head is
        written with the whole LM head (``vllm_problem``), so vLLM guesses from the whole vocabulary."""
        return bool(self.draft_vocab_size)

    def native_only_features(self) -> dict[str, str]:
        """``{config key: what the heads do}`` for each feature only medusa-train's own decoder (the native
        layout) holds; empty for plain heads, which vLLM, TGI, TensorRT-LLM and the original Medusa load."""
        features = {"next_token_input": "also read the next token's embedding",
                    "prefix_attention": "read through a prefix attention layer"}
        return {key: what for key, what in features.items() if getattr(self, key)}

    def token_map_problem(self) -> str | None:
        """Why layouts without a ``token_map`` (medusa_v1: the original Medusa, TensorRT-LLM, TGI) cannot hold
        these heads (they score a draft vocabulary), or ``None`` when they can."""
        if self.draft_vocab_size:
            return (f"score a draft vocabulary of {self.draft_vocab_size} tokens through a token_map "
                    "(heads.vocab_size), which the original Medusa layout has no place for (native holds it; "
                    "vllm takes heads sharing the LM head, with the whole of it)")
        return None

    def vllm_problem(self) -> str | None:
        """Why vLLM (0.32) cannot serve these heads faithfully, or ``None`` when it can.

        vLLM registers a ``token_map`` as a parameter but never reports it loaded, so no export with one
        starts. Heads sharing the LM head are written with the whole LM head instead (they then guess
        from the whole vocabulary); heads with their own draft-sized output layers have no such form:
        vLLM's LM heads have no bias to keep the other tokens out."""
        if self.draft_vocab_size and not self.share_lm_head:
            return (f"score a draft vocabulary of {self.draft_vocab_size} tokens with their own output layers "
                    "(heads.vocab_size, heads.share_lm_head=false): vLLM 0.32 refuses any token_map at load and "
                    "its LM heads have no bias to mask the other tokens, so it has no faithful form of them")
        return None

    def to_dict(self) -> dict:
        return {"format": "medusa_train", **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> MedusaConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
