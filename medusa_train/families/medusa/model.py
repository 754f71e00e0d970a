"""MedusaModel: an unmodified HF causal LM plus Medusa heads on its final hidden states."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from medusa_train.backbone.appending_cache import AppendingLayer
from medusa_train.backbone.load import backbone_reference
from medusa_train.families.medusa.config import check_fits
from medusa_train.families.medusa.decode_state import DecodeState, StaticHeadsState
from medusa_train.families.medusa.heads import MedusaHead, path_tokens
from medusa_train.families.medusa.layouts import (
    SHARED_LM_HEAD_KEY,
    TOKEN_MAP_KEY,
    MedusaConfig,
    check_shared_lm_head,
    read_heads,
)
from medusa_train.families.medusa.prefix_attention import PrefixAttention
from medusa_train.families.medusa.propose import heads_calibration_scores
from medusa_train.model.draft_vocab import DraftVocab
from medusa_train.model.files import WEIGHTS_NAME, check_tensors, resolve_base_model
from medusa_train.model.folder import write_heads_folder

TokenSource = torch.Tensor | Callable[[], torch.Tensor] | None


@dataclass
class MedusaOutput:
    """Result of ``MedusaModel.forward``.

    Attributes:
        hidden_states: Final-norm hidden states, shape (batch, seq, hidden).
        base_logits: The backbone's LM-head logits, only when asked for.
        past_key_values: The updated KV cache when ``use_cache`` (or a cache) was passed.
    """

    hidden_states: torch.Tensor
    base_logits: torch.Tensor | None = None
    past_key_values: object | None = None

    @property
    def draft_inputs(self) -> torch.Tensor:
        """What the heads read at each position: the final hidden states."""
        return self.hidden_states


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class MedusaModel(nn.Module):
    """A causal LM backbone plus ``num_heads`` Medusa heads.

    The backbone is used as loaded (no vendored modeling code): the heads read the final-norm
    hidden states of ``backbone.get_decoder()``.
    """

    def __init__(self, backbone: PreTrainedModel, config: MedusaConfig, token_map: torch.Tensor | None = None):
        """Heads for ``config`` on ``backbone``; with a draft vocabulary, ``token_map`` lists its tokens (left
        out: a placeholder that loading the heads' tensors overwrites)."""
        super().__init__()
        check_fits(backbone, config)
        self.backbone = backbone
        self.config = config
        dtype = getattr(torch, config.dtype)
        device = self.lm_head.weight.device
        self.draft: DraftVocab | None = DraftVocab.for_config(config, token_map, device)
        init_weight = None
        if not config.share_lm_head:
            init_weight = self.lm_head.weight.detach()
            if self.draft is not None:
                init_weight = init_weight[self.draft.token_map]
        self.heads = nn.ModuleList(
            MedusaHead(config.hidden_size, config.head_vocab_size, config.num_layers, init_weight,
                       config.share_lm_head, config.token_inputs(k))
            for k in range(config.num_heads)
        ).to(device=device, dtype=dtype)
        self.prefix: PrefixAttention | None = None
        if config.prefix_attention:
            self.prefix = PrefixAttention(config.hidden_size, config.prefix_attention_heads,
                                          config.prefix_intermediate_size).to(device=device, dtype=dtype)

    # ----------------------------------------------------------------------------- building
    @classmethod
    def from_backbone(cls, backbone: PreTrainedModel, num_heads: int, num_layers: int = 1,
                      share_lm_head: bool = False, dtype: str | torch.dtype | None = None,
                      next_token_input: bool = False, path_input: bool = False,
                      prefix_attention: bool = False, token_map: torch.Tensor | None = None) -> MedusaModel:
        """Attach fresh heads to ``backbone``; each starts out reproducing the LM head exactly.

        Args:
            backbone: A loaded HF causal LM (see ``load_backbone``).
            num_heads: Number of heads (>= 1).
            num_layers: ResBlocks per head (>= 0).
            share_lm_head: Project through the backbone's frozen LM head instead of a trainable clone.
            dtype: Head weight dtype; defaults to the LM head's (use float32 for training).
            next_token_input: Heads also read the embedding of the base model's next token (see
                ``heads.py``); their inputs come from ``head_features``.
            path_input: With ``next_token_input``: head k reads the k + 1 tokens of its path.
            prefix_attention: The heads read through one causal self-attention layer over the
                prefix's hidden states (``prefix_attention.py``), as many attention heads and as wide
                an MLP as the backbone's own layers.
            token_map: The heads' draft vocabulary (``draft_vocab.most_frequent_tokens``): head output i is token
                ``token_map[i]``; ``None``: the whole vocabulary.
        """
        if num_heads < 1:
            raise ValueError(f"heads.num_heads={num_heads}: must be >= 1")
        if num_layers < 0:
            raise ValueError(f"heads.num_layers={num_layers}: must be >= 0")
        lm_head = backbone.get_output_embeddings()
        if dtype is None:
            dtype = lm_head.weight.dtype
        dtype = _dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype)
        hidden_size = backbone.get_output_embeddings().weight.shape[1]
        attention_heads = intermediate_size = 0
        if prefix_attention:  # the backbone's own layer sizes, or the usual ones where its config has none
            text = backbone.config.get_text_config(decoder=True)
            attention_heads = getattr(text, "num_attention_heads", 0) or max(hidden_size // 64, 1)
            intermediate_size = getattr(text, "intermediate_size", 0) or 4 * hidden_size
        config = MedusaConfig(
            num_heads=num_heads, num_layers=num_layers, hidden_size=hidden_size,
            vocab_size=lm_head.weight.shape[0], share_lm_head=share_lm_head, next_token_input=next_token_input,
            path_input=path_input, prefix_attention=prefix_attention, prefix_attention_heads=attention_heads,
            prefix_intermediate_size=intermediate_size, base_model_name_or_path=backbone_reference(backbone), dtype=dtype,
            draft_vocab_size=None if token_map is None else len(token_map),
        )
        return cls(backbone, config, token_map)

    @property
    def lm_head(self) -> nn.Module:
        return self.backbone.get_output_embeddings()

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    max_depth = num_heads  #: the deepest tree the decoder may ask for

    # ----------------------------------------------------------------------------- compute
    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values=None, use_cache: bool = False,
                return_base_logits: bool = False, **kwargs) -> MedusaOutput:
        """The backbone's decoder; base logits only when asked for, a KV cache only with ``use_cache=True``."""
        out = self.backbone.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state
        logits = self.lm_head(hidden) if return_base_logits else None
        return MedusaOutput(hidden, logits, getattr(out, "past_key_values", None))

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The backbone's own next-token logits for ``hidden``."""
        return self.lm_head(hidden)

    @torch.no_grad()
    def next_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The base model's greedy next token at each position of ``hidden`` (..., hidden) -> (...); the
        logits of 512 positions exist at a time."""
        rows = hidden.reshape(-1, hidden.shape[-1]).split(512)
        return torch.cat([self.base_logits(row).argmax(-1) for row in rows]).reshape(hidden.shape[:-1])

    def draft_modules(self) -> list[nn.Module]:
        """What medusa-train adds to the backbone: the heads, and the prefix attention layer if any."""
        return [self.heads] + ([self.prefix] if self.prefix is not None else [])

    @property
    def guesses_follow_path(self) -> bool:
        """Whether a head's guess depends on the guesses before it on its tree path (not only on the
        root): then a decoder must ask the heads depth by depth; otherwise it may ask every head at
        once, which with a shared LM head reads its weight once instead of once per head."""
        return any(self.config.token_inputs(k) > 1 for k in range(self.num_heads))

    def new_decode_state(self, room: int | None = None, graphs: bool = False) -> DecodeState | StaticHeadsState:
        """Fresh decode-time state for one sequence (pass it to every ``head_features`` call of that decode).

        ``room``: the most positions it will read (a static cache's length): then its buffers are fixed, sized once
        (``StaticHeadsState``), and with ``graphs`` (CUDA) each step's passes are replayed from CUDA graphs."""
        if room is None:
            if graphs:
                raise ValueError("graphed heads replay over fixed buffers: give the room they read into")
            return DecodeState()
        return StaticHeadsState(self, room, graphs=graphs)

    def head_features(self, hidden: torch.Tensor | None, tokens: TokenSource = None,
                      state: DecodeState | None = None) -> torch.Tensor:
        """What the heads read, whatever they are configured to read (``MedusaConfig`` lists the features).

        Training and calibration (``state`` is None): ``hidden`` (..., seq, hidden) holds the final hidden
        states of consecutive positions; ``tokens`` (..., seq) is the token after each position (the
        text's in training, the greedy one by default), or a callable returning it, called only when
        the heads read tokens. Returns (..., seq, features).

        Decoding (``state`` from ``new_decode_state``): ``hidden`` (n, hidden) holds the positions accepted
        since the last call (``None``: none, e.g. asking again at the next tree depth); ``tokens`` (P, L)
        holds tree paths from the root (L >= 1). Returns the features at the last accepted position for
        each path: (P, features), or (1, features) when no guess follows the path past the root
        (``guesses_follow_path`` is false: every path starts there, so one row serves them all).
        """
        if state is None:
            context = self._context(hidden)
            if not self.config.next_token_input:
                return context
            tokens = tokens() if callable(tokens) else tokens
            return self._with_tokens(context, self.next_tokens(hidden) if tokens is None else tokens)
        if hidden is not None:
            state.read(self, hidden)
        if state.last is None:
            raise ValueError("the decode state has seen no position yet: pass the prompt's hidden states first")
        if not self.config.next_token_input:
            return state.last
        if not self.guesses_follow_path:  # every path starts at the root: one row serves them all
            return self._with_tokens(state.last, tokens[:1, :1])
        return self._with_tokens(state.last.expand(tokens.shape[0], -1), tokens)

    def propose(self, tree, accepted_inputs: torch.Tensor, accepted_tokens: torch.Tensor, root_token: int,
                state: DecodeState | StaticHeadsState) -> torch.Tensor:
        """(num_nodes,) the tree's tokens for one verify step: the heads read the accepted positions, then guess
        (``propose.heads_candidates``, through ``state``: eager, or over fixed buffers; tokens unused)."""
        state.read(self, accepted_inputs)
        return state.guesses(self, tree, root_token)

    def calibration_scores(self, ids: torch.Tensor, start: int, states: torch.Tensor | None = None):
        """Each head's scores along a text and its targets (``medusa_propose.heads_calibration_scores``)."""
        return heads_calibration_scores(self, ids, start, states)

    def _context(self, hidden: torch.Tensor, cache: AppendingLayer | None = None) -> torch.Tensor:
        """``hidden`` itself, or through the prefix attention layer (consecutive positions; ``cache`` holds
        the positions before them, decoding only); ``hidden`` is (seq, hidden) or (batch, seq, hidden)."""
        if self.prefix is None:
            return hidden
        if hidden.dim() == 2:
            return self.prefix(hidden[None], cache)[0]
        return self.prefix(hidden, cache)

    def _with_tokens(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """``cat([hidden, embeddings of the tokens after each position], -1)``.

        ``next_tokens`` is (...) one token per position, or (..., P) explicit paths per position (the
        decoder's; head k needs P >= k + 1). For heads that read their path, one token per position
        means consecutive positions along the last axis: the path after t is ``next_tokens[..., t : t +
        num_heads]`` (token 0 past the end).
        """
        if next_tokens.dim() == hidden.dim() - 1:
            next_tokens = path_tokens(next_tokens, self.num_heads) if self.config.path_input else next_tokens[..., None]
        if next_tokens.shape[:-1] != hidden.shape[:-1] or (next_tokens.shape[-1] != 1 and not self.config.path_input):
            raise ValueError(f"next_tokens {tuple(next_tokens.shape)} do not fit hidden {tuple(hidden.shape)}: give one "
                             "token per position (or, for path_input heads, a path of tokens per position)")
        table = self.backbone.get_input_embeddings()  # may sit on another device than the last layer
        embedding = table(next_tokens.to(table.weight.device)).flatten(-2)  # (..., P * hidden)
        return torch.cat([hidden, embedding.to(device=hidden.device, dtype=hidden.dtype)], dim=-1)

    def head_logits(self, inputs: torch.Tensor, k: int) -> torch.Tensor:
        """Logits of head ``k`` (0-based; predicts the token k+2 positions after the inputs' position) over
        the heads' vocabulary: the backbone's, or the draft vocabulary (``guessed_tokens`` maps an index
        back to its token).

        ``inputs`` is what ``head_features`` returns."""
        head = self.heads[k]
        inputs = inputs.to(next(head.parameters(), self.lm_head.weight).dtype)
        if not self.config.share_lm_head:
            return head(inputs)
        return self._shared_projection(head.features(inputs))

    def all_head_logits(self, inputs: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Logits of the first ``num_heads`` heads stacked: (num_heads, *inputs.shape[:-1], vocab).

        With ``share_lm_head`` the heads' ResBlock outputs go through the LM head in one matmul,
        so its (vocab x hidden) weight is read once rather than once per head: at decode time,
        where a step handles a handful of rows, that read is what the heads cost.
        """
        n = self.num_heads if num_heads is None else num_heads
        if not self.config.share_lm_head:
            return torch.stack([self.head_logits(inputs, k) for k in range(n)])
        dtype = next(self.heads[0].parameters(), self.lm_head.weight).dtype
        return self._shared_projection(torch.stack([self.heads[k].features(inputs.to(dtype)) for k in range(n)]))

    def _shared_projection(self, features: torch.Tensor) -> torch.Tensor:
        """The backbone's LM head over ``features``, restricted to the draft vocabulary's rows if any."""
        if self.draft is None:
            return self.lm_head(features.to(self.lm_head.weight.dtype))
        return self.draft.project(features, self.lm_head)

    # ----------------------------------------------------------------------------- draft vocabulary
    @property
    def token_map(self) -> torch.Tensor | None:
        """The draft vocabulary's token ids (head output i is token ``token_map[i]``), or ``None``."""
        return getattr(self.draft, "token_map", None)

    def guessed_tokens(self, indices: torch.Tensor) -> torch.Tensor:
        """Token ids of head outputs ``indices`` (e.g. a top-k's): themselves, or ``token_map[indices]``."""
        return indices if self.draft is None else self.draft.tokens(indices)

    def head_indices(self, tokens: torch.Tensor) -> torch.Tensor:
        """Each token's index among the heads' outputs, -1 for a token they never guess (outside the
        draft vocabulary, or negative such as an ignore index)."""
        return tokens.clamp(min=-1) if self.draft is None else self.draft.indices(tokens)

    def draft_base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The backbone's next-token logits for ``hidden`` over the heads' vocabulary (its softmax is the
        backbone's distribution given that the token is one the heads can guess)."""
        return self.base_logits(hidden) if self.draft is None else self.draft.project(hidden, self.lm_head)

    # ----------------------------------------------------------------------------- persistence
    def heads_state_dict(self) -> dict[str, torch.Tensor]:
        """The heads' tensors only (never the backbone's), keyed ``heads.{k}.…`` (and ``prefix.…``)."""
        return {name: t.detach().contiguous() for name, t in _medusa_state_dict(self).items()}

    def save_pretrained(self, directory: str | os.PathLike, chat_template: str | None = None) -> Path:
        """Write the heads as ``model.safetensors`` + ``config.json`` (+ ``chat_template.jinja``: the template the
        heads were trained with) atomically; a folder holding files we did not write is refused (``folder.py``)."""
        return write_heads_folder(directory, *self.native_files(), chat_template=chat_template)

    def save_as(self, directory: str | os.PathLike, layout: str, chat_template: str | None = None,
                option: str | None = None, **options) -> Path:
        """The heads in ``layout`` (native, medusa_v1 or vllm; ``model.medusa_export.export_heads``'s options)."""
        from medusa_train.families.medusa.export import export_heads

        return export_heads(self, directory, layout, chat_template=chat_template, option=option, **options)

    def native_files(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
        """What ``save_pretrained`` writes: ``({file name: tensors}, config.json's content)``."""
        tensors = self.heads_state_dict()
        config = self.config.to_dict()
        floats = [t for t in tensors.values() if t.is_floating_point()]
        if floats:
            config["dtype"] = _dtype_name(floats[0].dtype)
        return {WEIGHTS_NAME: tensors}, config

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, backbone: PreTrainedModel | None = None,
                        stored_config: dict | None = None, **backbone_kwargs) -> MedusaModel:
        """Load heads saved by ``save_pretrained`` or ``export_heads`` (native, medusa_v1 or vllm).

        Args:
            directory: A heads folder; its layout is read from ``config.json`` (see ``families/medusa/layouts.py``).
            backbone: The backbone to attach to; when ``None`` the one named in ``config.json`` is
                loaded with ``load_backbone(**backbone_kwargs)``.
            stored_config: ``config.json`` as already read (``model.load.read_exported_draft``), not read again.

        Raises:
            ValueError: the backbone's hidden size or vocabulary differs from the heads', a
                tensor is missing, unexpected, or of the wrong shape (named in the message), or
                vLLM heads stored with ``original_lm_head`` carry an LM head other than the backbone's.
        """
        config, tensors = read_heads(directory, stored_config)
        stored_lm_head = tensors.pop(SHARED_LM_HEAD_KEY, None)  # vLLM original_lm_head heads only
        if backbone is None:
            if not config.base_model_name_or_path:
                raise ValueError(f"{directory}/config.json names no base model; pass backbone=")
            from medusa_train.backbone.load import load_backbone

            backbone, _ = load_backbone(resolve_base_model(directory, config.base_model_name_or_path),
                                        **backbone_kwargs)
        model = cls(backbone, config, tensors.get(TOKEN_MAP_KEY))  # checks the map before anything is copied
        if stored_lm_head is not None:
            check_shared_lm_head(stored_lm_head, model.lm_head.weight if model.draft is None
                                 else model.draft.rows(model.lm_head)[0], source=str(directory))
        load_heads_strict(model, tensors, source=str(directory))
        return model


def _medusa_state_dict(model: MedusaModel) -> dict[str, torch.Tensor]:
    state = {f"heads.{k}": v for k, v in model.heads.state_dict().items()}
    if model.prefix is not None:
        state.update({f"prefix.{k}": v for k, v in model.prefix.state_dict().items()})
    if model.token_map is not None:
        state[TOKEN_MAP_KEY] = model.token_map
    return state


def load_heads_strict(model: MedusaModel, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Copy ``heads.*`` (``prefix.*``, ``token_map``) tensors into ``model``; any missing/extra key or wrong
    shape is an error."""
    expected = _medusa_state_dict(model)
    check_tensors(tensors, {k: tuple(v.shape) for k, v in expected.items()}, source)
    with torch.no_grad():
        for key, param in expected.items():
            param.copy_(tensors[key])
