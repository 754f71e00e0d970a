"""MedusaConfig: what a set of heads needs to be rebuilt, and the ONLY place head features are listed and checked.

A head feature changes what the heads read. Callers never branch on one: they ask ``MedusaModel``
(``head_features``, ``new_decode_state``), and export code asks ``layout_problem``. The config provides the draft
contract's half (``model/contract.py``: ``DraftConfig``).
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
            raise ValueError(f"heads.draft_vocab_size={self.draft_vocab_size}: a draft vocabulary must be between 1 and "
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
    vllm_options = {}  #: nothing else in their ``--speculative-config``
    draft_name = "the heads"  #: what proposes the tree's tokens, in reports

    @property
    def depth(self) -> int:
        """Tokens drafted a step by default: one per head (vLLM's K is at most this)."""
        return self.num_heads

    max_depth = depth  #: the deepest tree the decoder may ask for: one level per head

    @staticmethod
    def depth_in(config: dict) -> int | None:
        """The head count a ``config.json`` of any Medusa layout states."""
        return config.get("num_heads", config.get("medusa_num_heads"))

    @property
    def vllm_export_differs(self) -> bool:
        """Whether the ``vllm`` export serves other heads than these: a draft vocabulary sharing the LM head is
        written with the whole LM head (``layout_problem``), so vLLM guesses from the whole vocabulary."""
        return bool(self.draft_vocab_size)

    def native_only_features(self) -> dict[str, str]:
        """``{config key: what the heads do}`` for each feature only medusa-train's own decoder (the native
        layout) holds; empty for plain heads, which vLLM, TGI, TensorRT-LLM and the original Medusa load."""
        features = {"next_token_input": "also read the next token's embedding",
                    "prefix_attention": "read through a prefix attention layer"}
        return {key: what for key, what in features.items() if getattr(self, key)}

    def layout_problem(self, layout: str) -> str | None:
        """Why ``layout`` cannot hold these heads, and what to change, or ``None`` when it can.

        Only ``native`` holds a feature of our decoder's (``native_only_features``). ``medusa_v1`` (the original
        Medusa, TensorRT-LLM, TGI) has no ``token_map``, so no draft vocabulary. vLLM (0.32) registers a
        ``token_map`` as a parameter but never reports it loaded, so no export with one starts: heads sharing the LM
        head are written with the whole LM head instead (they then guess from the whole vocabulary); heads with their
        own draft-sized output layers have no such form (vLLM's LM heads have no bias to keep the other tokens out).
        """
        if layout == "native":
            return None
        for key, what in self.native_only_features().items():
            return (f"{what} ({key}), which the {layout} layout has no place for; export format=native, or train "
                    f"with heads.{key}=false for heads the original Medusa, TensorRT-LLM or vLLM can load")
        if layout == "medusa_v1" and self.draft_vocab_size:
            return (f"score a draft vocabulary of {self.draft_vocab_size} tokens through a token_map "
                    "(heads.draft_vocab_size), which the original Medusa layout has no place for (native holds it; "
                    "vllm takes heads sharing the LM head, with the whole of it); export format=vllm or native, or "
                    "train with heads.draft_vocab_size=null for heads TensorRT-LLM and TGI can load")
        if layout == "vllm" and self.draft_vocab_size and not self.share_lm_head:
            return (f"score a draft vocabulary of {self.draft_vocab_size} tokens with their own output layers "
                    "(heads.draft_vocab_size, heads.share_lm_head=false): vLLM 0.32 refuses any token_map at load and "
                    "its LM heads have no bias to mask the other tokens, so it has no faithful form of them; export "
                    "format=native, or train with heads.share_lm_head=true (or heads.draft_vocab_size=null) for heads "
                    "vLLM can load")
        return None

    def to_dict(self) -> dict:
        return {"format": "medusa_train", **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> MedusaConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def check_fits(backbone, config: MedusaConfig) -> None:
    """Raise ``ValueError`` unless heads of ``config`` fit ``backbone`` (its hidden size and vocabulary)."""
    vocab, hidden = backbone.get_output_embeddings().weight.shape
    problems = []
    if hidden != config.hidden_size:
        problems.append(f"hidden size: heads {config.hidden_size}, backbone {hidden}")
    if vocab != config.vocab_size:
        problems.append(f"vocab size: heads {config.vocab_size}, backbone {vocab}")
    if problems:
        raise ValueError(f"these heads do not fit this backbone ({'; '.join(problems)}); "
                         f"they were trained on {config.base_model_name_or_path!r}")
