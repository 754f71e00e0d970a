"""P-EAGLE's config and weights: an EAGLE-3 draft (``families/eagle3``) plus what its masked slots read.

A parallel draft proposes K tokens in one pass: after the verified positions and the root (the bonus token, read with
the backbone's features at the last verified position, as EAGLE-3's first step), K - 1 *masked* slots follow at the
next positions, each reading the embedding of ``mask_token_id`` and ``fc`` of one learned vector ``mask_hidden`` (in
the 3H space of the backbone's three states), attending causally to the verified positions, the root and the masked
slots before it. Slot i guesses the token i + 1 past the root. This is vLLM 0.32's parallel drafting for
``method: eagle3`` (``v1/spec_decode/llm_base_proposer.py``: the masked slots' token and shared hidden state;
``model_executor/models/llama_eagle3.py``: the ``mask_hidden`` weight, ``(1, 3H)``, loaded by name), served with
``"parallel_drafting": true`` in ``--speculative-config``; the folder is an EAGLE-3 folder with a top-level
``mask_token_id`` in its ``config.json`` and ``mask_hidden`` among its weights (a server without parallel drafting
serves it as a plain EAGLE-3 chain).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from medusa_train.families.eagle3.config import ARCHITECTURE, Eagle3Config, Eagle3Draft

FORMAT = "peagle"
MASK_KEY = "mask_hidden"


@dataclass
class PEagleConfig(Eagle3Config):
    """An EAGLE-3 draft's config and the token its masked slots read (``mask_token_id``, a backbone token id whose
    embedding the slots share; its meaning is learned through ``mask_hidden``)."""

    mask_token_id: int = 0

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id}: must be a token id of the backbone's "
                             f"{self.vocab_size}-token vocabulary")

    draft_name = "the P-EAGLE draft"  #: what proposes the tree's tokens, in reports
    #: what ``--speculative-config`` adds to ``method: eagle3`` to serve it: one draft pass for K tokens
    vllm_options = {"parallel_drafting": True}

    def draft_module(self, token_map: torch.Tensor | None = None) -> nn.Module:
        return PEagleDraft(self, token_map)

    @classmethod
    def for_backbone(cls, backbone, *args, **kwargs) -> PEagleConfig:
        """EAGLE-3's config for ``backbone`` and its mask token: its pad token, else its first end token, else 0."""
        config = super().for_backbone(backbone, *args, **kwargs)
        text = backbone.config.get_text_config(decoder=True)
        eos = getattr(text, "eos_token_id", None)
        for candidate in (getattr(text, "pad_token_id", None), eos[0] if isinstance(eos, list) and eos else eos, 0):
            if isinstance(candidate, int) and 0 <= candidate < config.vocab_size:
                config.mask_token_id = candidate
                break
        return config

    def to_dict(self) -> dict:
        """EAGLE-3's ``config.json`` (``LlamaForCausalLMEagle3``: vLLM renames any other architecture) and the mask
        token at the top level, where vLLM's parallel drafting looks for it."""
        data = super().to_dict()
        data["mask_token_id"] = self.mask_token_id
        data["medusa_train"]["format"] = FORMAT
        return data


def peagle_layout(config: dict) -> str | None:
    """``vllm`` for a P-EAGLE draft's ``config.json`` (an EAGLE-3 one with a mask token), else None."""
    ours = (config.get("medusa_train") or {}).get("format")
    if ours == FORMAT or (ours is None and "mask_token_id" in config and ARCHITECTURE in (config.get("architectures") or [])):
        return "vllm"
    return None


class PEagleDraft(Eagle3Draft):
    """EAGLE-3's weights and layer, and ``mask_hidden``: the masked slots' input in the backbone's 3H space."""

    def __init__(self, config: PEagleConfig, token_map: torch.Tensor | None = None):
        super().__init__(config, token_map)
        self.mask_hidden = nn.Parameter(torch.zeros(1, 3 * config.hidden_size))

    def mask_feature(self) -> torch.Tensor:
        """(1, H): ``fc`` of ``mask_hidden``, the feature every masked slot reads (vLLM projects it once at load)."""
        return self.features(self.mask_hidden)
