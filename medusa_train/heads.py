"""Medusa heads: residual SiLU blocks followed by a hidden -> vocab projection."""

from __future__ import annotations

import torch
from torch import nn


class ResBlock(nn.Module):
    """``x + SiLU(W1 x + b)``, with W1 and b zero so the block starts as the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHead(nn.Module):
    """``num_layers`` independent ResBlocks, then an output layer (hidden -> vocab, no bias).

    When ``lm_head`` is given the head has no output layer of its own and projects through it
    (the backbone's frozen LM head, shared by every head); otherwise ``self.lm_head`` is a
    trainable clone of ``init_weight``.
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_layers: int,
                 init_weight: torch.Tensor | None = None, share_lm_head: bool = False):
        super().__init__()
        self.blocks = nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)])
        self.lm_head: nn.Linear | None = None
        if not share_lm_head:
            self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
            if init_weight is not None:
                with torch.no_grad():
                    self.lm_head.weight.copy_(init_weight.to(self.lm_head.weight.dtype))

    def forward(self, hidden: torch.Tensor, shared_lm_head: nn.Module | None = None) -> torch.Tensor:
        hidden = self.blocks(hidden)
        if self.lm_head is not None:
            return self.lm_head(hidden)
        if shared_lm_head is None:
            raise ValueError("this head shares the backbone's LM head: pass shared_lm_head")
        return shared_lm_head(hidden.to(shared_lm_head.weight.dtype))
