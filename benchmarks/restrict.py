"""Trained full-vocabulary heads restricted to a draft vocabulary after training
(``medusa_train/model/draft_vocab.py``): what ``python -m benchmarks vocab`` compares heads trained on K tokens with.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from medusa_train.families.medusa.layouts import TOKEN_MAP_KEY
from medusa_train.families.medusa.model import MedusaModel, load_heads_strict


def restrict_heads(model, token_map: torch.Tensor):
    """A copy of trained full-vocabulary heads (``MedusaModel``, same backbone) scoring only ``token_map``'s
    tokens: each own output layer keeps those rows, a shared LM head is read through them. Its logits
    are the original's at those tokens, which is where training with ``heads.draft_vocab_size=K`` starts."""
    if model.token_map is not None:
        raise ValueError("these heads already score a draft vocabulary")
    token_map = torch.as_tensor(token_map, dtype=torch.long)
    restricted = MedusaModel(model.backbone, replace(model.config, draft_vocab_size=len(token_map)), token_map)
    tensors = {k: (v[token_map.to(v.device)] if k.endswith("lm_head.weight") else v)
               for k, v in model.heads_state_dict().items()}
    load_heads_strict(restricted, {**tensors, TOKEN_MAP_KEY: token_map}, source="restrict_heads")
    return restricted.eval()
