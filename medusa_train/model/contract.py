"""What every draft family provides: the contract the decoder, the tree, training, loading, export and evaluation rely
on, so that none of them asks which family a draft belongs to.

A draft family (Medusa heads, an EAGLE-3 draft; later MTP, P-EAGLE, DFlash) is a config class (``DraftConfig``), a
model class on an unmodified backbone (``DraftModel``), the states a capture stores for it (``CapturedStates``) and a
row of ``model/family.py``'s table. These are Protocols, checked by shape (runtime checkable: every registered
family's model and config pass ``isinstance`` in ``tests/model/test_families.py``), not base classes: families share functions, never implementation by inheritance (as torchtune's
recipe interfaces do).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class DraftConfig(Protocol):
    """What a draft needs to be rebuilt, and what the rest of the toolkit asks of it."""

    hidden_size: int  #: the backbone's hidden size
    vocab_size: int  #: the backbone's vocabulary
    draft_vocab_size: int | None  #: tokens the draft scores when fewer than the vocabulary (a token map back)
    base_model_name_or_path: str | None  #: the backbone it was trained on
    dtype: str  #: the dtype its weights were saved in
    vllm_method: str  #: vLLM's ``--speculative-config`` method that serves it
    vllm_options: dict  #: what else its ``--speculative-config`` says (P-EAGLE: ``parallel_drafting``)
    draft_name: str  #: what proposes the tree's tokens, in reports ("the heads", "the EAGLE-3 draft")
    vllm_export_differs: bool  #: whether what vLLM serves differs from what our decoder runs

    @property
    def depth(self) -> int:
        """Tokens it drafts a step by default: a chain's length, vLLM's K (Medusa: its heads)."""

    @property
    def max_depth(self) -> int:
        """The deepest tree the decoder may ask it for."""

    @property
    def head_vocab_size(self) -> int:
        """Tokens one draft position scores (the decoder's top-k asks for no more)."""

    def native_only_features(self) -> dict[str, str]:
        """``{config key: what it does}`` for each feature only our decoder holds (empty: every engine's layout can)."""

    def layout_problem(self, layout: str) -> str | None:
        """Why ``layout`` (one its family writes) cannot hold this draft, or ``None`` when it can."""

    def to_dict(self) -> dict:
        """Its ``config.json`` in its family's native layout."""


@runtime_checkable
class DraftModel(Protocol):
    """A backbone plus a draft: what the tree decoder, calibration, training's loop and the exports call."""

    config: DraftConfig
    backbone: Any  #: the unmodified Hugging Face causal LM

    @property
    def lm_head(self) -> nn.Module:
        """The backbone's LM head (what verifies)."""

    @property
    def max_depth(self) -> int:
        """The deepest tree the decoder may ask for."""

    def draft_modules(self) -> list[nn.Module]:
        """What the family adds to the backbone (what trains, is cast and moved, is saved)."""

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The backbone's next-token logits for its final hidden states."""

    def draft_base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The backbone's logits over the draft vocabulary."""

    def new_decode_state(self, room: int | None = None, graphs: bool = False) -> Any:
        """Fresh per-sequence state for ``propose`` (it can ``rewind(length)`` to an accepted length and ``reset()``
        for the next sequence); ``room``: a static cache's length, for a family whose draft keeps fixed buffers (with
        ``graphs``, on CUDA, its passes replayed from CUDA graphs); a family without them ignores both."""

    def propose(self, tree, accepted_inputs: torch.Tensor, accepted_tokens: torch.Tensor, root_token: int,
                state: Any) -> torch.Tensor:
        """(num_nodes,) the tree's tokens for one verify step."""

    def guessed_tokens(self, indices: torch.Tensor) -> torch.Tensor:
        """Token ids of draft outputs ``indices`` (the draft vocabulary mapped back)."""

    def calibration_scores(self, ids: torch.Tensor, start: int, states: torch.Tensor | None = None):
        """Yields ``(depth, scores, targets)`` along a text, on the path the decoder would walk (``states``: what
        the family's capture stores for ``ids``, (1, len, width), instead of running the backbone)."""

    def native_files(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
        """``({file name: tensors}, config.json)`` of its native layout."""

    def save_pretrained(self, directory: str | os.PathLike, chat_template: str | None = None) -> Path:
        """Its native layout, written atomically."""

    def save_as(self, directory: str | os.PathLike, layout: str, chat_template: str | None = None,
                option: str | None = None) -> Path:
        """One of the layouts its family writes (``Family.layouts``), written atomically."""


@dataclass(frozen=True)
class CapturedStates:
    """What a capture stores per token for a family's draft (``medusa-train capture``, ``data.cache_hidden_states``)."""

    #: ``backbone -> fn(input_ids, attention_mask, start=None) -> (batch, seq, width)``: the states stored per token
    #: (with a ``SharedStart``: of the positions after those it holds, which the call adds: ``capture/store.py``)
    states: Callable[[Any], Callable[..., torch.Tensor]]
    keep_tokens: bool = False  #: whether the token ids are stored beside them
    #: what tells this capture apart in the capture's settings key (empty: the final hidden states alone)
    key: dict = field(default_factory=dict)


@dataclass
class SharedStart:
    """What a states function has run of a batch's shared start: the backbone's KV cache, of the type the backbone
    makes for itself (sliding windows, hybrid layers), None until a first call fills it."""

    past_key_values: Any = None

    def run(self, decoder, input_ids: torch.Tensor, attention_mask: torch.Tensor, **options):
        """``decoder``'s output for ``input_ids`` after the positions held, which it then holds too."""
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, past_key_values=self.past_key_values,
                      use_cache=True, **options)
        self.past_key_values = out.past_key_values
        return out

    def repeat(self, batch: int) -> bool:
        """Repeat the start held (one row) for ``batch`` rows where every layer of its cache holds keys and values
        alone (transformers' ``DynamicLayer`` or ``DynamicSlidingWindowLayer``, by exact type); whether it did.

        A layer with other state is never repeated: linear-attention and Mamba layers (Qwen3-Next, LFM2, Bamba)
        cannot repeat theirs, and a hybrid layer (Falcon-H1's) repeats its keys and values but not its convolution
        and recurrent states; an unknown type may do either. The caller then runs the batch whole."""
        if not keys_and_values_only(self.past_key_values):
            return False
        self.past_key_values.batch_repeat_interleave(batch)
        return True


def keys_and_values_only(cache) -> bool:
    """Whether every layer of ``cache`` (a transformers cache) holds keys and values alone: a ``DynamicLayer`` or
    ``DynamicSlidingWindowLayer``, by exact type. Linear-attention, convolution and Mamba layers (Qwen3-Next, LFM2,
    Bamba, Jamba) and hybrid ones (Falcon-H1's: attention and Mamba in one) carry a running state besides; a type
    not known here may."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in layers)


def check_tree_decodable(backbone) -> None:
    """Refuse, before any work, a backbone whose cache is not keys and values alone (``keys_and_values_only`` of the
    cache transformers makes from its config): a verify pass runs every tree node at once under the tree mask and
    keeps only the accepted nodes' keys and values, which a running state (linear attention, convolutions, Mamba)
    can neither follow nor give back."""
    from transformers import DynamicCache

    from medusa_train.config.check import ConfigError

    cache = DynamicCache(config=backbone.config)
    if keys_and_values_only(cache):
        return
    config = backbone.config.get_text_config(decoder=True)
    kinds = sorted({type(layer).__name__ for layer in cache.layers})
    types = getattr(config, "layer_types", None) or []
    counted = ", ".join(f"{t} x{types.count(t)}" for t in dict.fromkeys(types))
    raise ConfigError([
        f"model.name_or_path={getattr(backbone, 'name_or_path', '') or config.model_type}: a {config.model_type} "
        f"backbone's cache holds {', '.join(kinds)} layers" + (f" (layer_types: {counted})" if counted else "")
        + ": our decoder verifies a token tree in one pass under a tree mask and keeps the accepted nodes' keys and "
        "values, which a linear-attention, convolution or Mamba layer's running state cannot follow or give back. "
        "Training and export do not need this; evaluate, build-tree and the demo decode with it: use a backbone "
        "of attention layers only (full or sliding-window)"])


def final_hidden_states(backbone) -> Callable[..., torch.Tensor]:
    """``fn(input_ids, attention_mask, start=None) -> (batch, seq, H)``: the backbone's final hidden states (after its
    norm), of the positions after those a ``SharedStart`` holds (the call adds them)."""
    decoder = backbone.get_decoder()
    first = backbone.get_input_embeddings().weight.device  # device_map=auto: where the inputs go

    def hidden_fn(input_ids: torch.Tensor, attention_mask: torch.Tensor, start: SharedStart | None = None):
        ids, mask = input_ids.to(first), attention_mask.to(first)
        out = decoder(input_ids=ids, attention_mask=mask) if start is None else start.run(decoder, ids, mask)
        return out.last_hidden_state

    return hidden_fn


def vllm_speculation(config) -> dict:
    """The ``--speculative-config`` of a draft of ``config`` (a config or its class) but its path and K: its method and
    options."""
    return {"method": config.vllm_method, **config.vllm_options}
