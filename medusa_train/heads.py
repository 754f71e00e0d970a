"""Medusa heads: residual SiLU blocks followed by a hidden -> vocab projection.

A head may also read the next token (``next_token_input``): the base model's own choice after
the position, which in tree decoding is the root every candidate hangs from. Its embedding
enters the first block, ``x + SiLU(W x + b + U e)``. The next token is a function of the hidden
state (its argmax) that a small head cannot compute, and knowing it is most of what predicting
the token after it needs (EAGLE feeds its draft head the same shifted token).
"""

from __future__ import annotations

import torch
from torch import nn


class ResBlock(nn.Module):
    """``x + SiLU(W1 x + b [+ U e])``, with W1, b (and U) zero so the block starts as the identity.

    ``token_input`` adds ``U`` (no bias): a projection of the next token's embedding ``e``.
    """

    def __init__(self, hidden_size: int, token_input: bool = False):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.token: nn.Linear | None = None
        if token_input:
            self.token = nn.Linear(hidden_size, hidden_size, bias=False)
            nn.init.zeros_(self.token.weight)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor, token_embedding: torch.Tensor | None = None) -> torch.Tensor:
        pre = self.linear(x)
        if self.token is not None:
            pre = pre + self.token(token_embedding)
        return x + self.act(pre)


class MedusaHead(nn.Module):
    """``num_layers`` independent ResBlocks, then an output layer (hidden -> vocab, no bias).

    When ``lm_head`` is given the head has no output layer of its own and projects through it
    (the backbone's frozen LM head, shared by every head); otherwise ``self.lm_head`` is a
    trainable clone of ``init_weight``.

    With ``next_token_input`` the head's input is ``cat([hidden, next token embedding], -1)``
    (``MedusaModel.head_inputs`` builds it) and the first block reads both halves.
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_layers: int,
                 init_weight: torch.Tensor | None = None, share_lm_head: bool = False,
                 next_token_input: bool = False):
        super().__init__()
        if next_token_input and num_layers < 1:
            raise ValueError("heads.next_token_input=true needs heads.num_layers >= 1: the next token enters "
                             "the first ResBlock")
        self.next_token_input = next_token_input
        self.blocks = nn.Sequential(*[ResBlock(hidden_size, token_input=next_token_input and i == 0)
                                      for i in range(num_layers)])
        self.lm_head: nn.Linear | None = None
        if not share_lm_head:
            self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
            if init_weight is not None:
                with torch.no_grad():
                    self.lm_head.weight.copy_(init_weight.to(self.lm_head.weight.dtype))

    def features(self, inputs: torch.Tensor) -> torch.Tensor:
        """The blocks' output (what the output layer projects) for the head's ``inputs``."""
        if not self.next_token_input:
            return self.blocks(inputs)
        hidden, token_embedding = inputs.chunk(2, dim=-1)
        hidden = self.blocks[0](hidden, token_embedding)
        for block in self.blocks[1:]:
            hidden = block(hidden)
        return hidden

    def forward(self, inputs: torch.Tensor, shared_lm_head: nn.Module | None = None) -> torch.Tensor:
        hidden = self.features(inputs)
        if self.lm_head is not None:
            return self.lm_head(hidden)
        if shared_lm_head is None:
            raise ValueError("this head shares the backbone's LM head: pass shared_lm_head")
        return shared_lm_head(hidden.to(shared_lm_head.weight.dtype))
