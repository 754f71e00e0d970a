"""Medusa heads: residual SiLU blocks followed by a hidden -> vocab projection.

A head may also read the next token (``next_token_input``): the base model's own choice after
the position, which in tree decoding is the root every candidate hangs from. Its embedding
enters the first block, ``x + SiLU(W x + b + U e)``. The next token is a function of the hidden
state (its argmax) that a small head cannot compute, and knowing it is most of what predicting
the token after it needs (EAGLE feeds its draft head the same shifted token).

With ``path_input`` head k reads every token between the position and its target: the root and
the k guesses before it on its tree path, ``x + SiLU(W x + b + U [e_1; ...; e_{k+1}])`` (Hydra's
sequentially dependent heads). Head k's guess then depends on its parent's, so the decoder asks
the heads depth by depth.
"""

from __future__ import annotations

import torch
from torch import nn


class ResBlock(nn.Module):
    """``x + SiLU(W1 x + b [+ U e])``, with W1, b (and U) zero so the block starts as the identity.

    ``token_inputs`` > 0 adds ``U`` (no bias): a projection of ``e``, the concatenated embeddings
    of that many tokens (hidden_size each).
    """

    def __init__(self, hidden_size: int, token_inputs: int = 0):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.token: nn.Linear | None = None
        if token_inputs:
            self.token = nn.Linear(token_inputs * hidden_size, hidden_size, bias=False)
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

    With ``token_inputs`` = n > 0 the head's input is ``cat([hidden, e_1, ..., e_m], -1)`` with
    m >= n token embeddings (``MedusaModel.head_inputs`` builds it); the first block reads the
    hidden state and the first n embeddings (1 with ``next_token_input``, k + 1 for head k with
    ``path_input``).
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_layers: int,
                 init_weight: torch.Tensor | None = None, share_lm_head: bool = False,
                 token_inputs: int = 0):
        super().__init__()
        if token_inputs and num_layers < 1:
            raise ValueError("heads.next_token_input=true needs heads.num_layers >= 1: the next token enters "
                             "the first ResBlock")
        self.hidden_size = hidden_size
        self.token_inputs = token_inputs
        self.blocks = nn.Sequential(*[ResBlock(hidden_size, token_inputs=token_inputs if i == 0 else 0)
                                      for i in range(num_layers)])
        self.lm_head: nn.Linear | None = None
        if not share_lm_head:
            self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
            if init_weight is not None:
                with torch.no_grad():
                    self.lm_head.weight.copy_(init_weight.to(self.lm_head.weight.dtype))

    def features(self, inputs: torch.Tensor) -> torch.Tensor:
        """The blocks' output (what the output layer projects) for the head's ``inputs``."""
        if not self.token_inputs:
            return self.blocks(inputs)
        h = self.hidden_size
        if inputs.shape[-1] < h * (1 + self.token_inputs):
            raise ValueError(f"this head reads {self.token_inputs} token embedding(s) but its inputs hold "
                             f"{inputs.shape[-1] // h - 1}: build them with MedusaModel.head_inputs")
        hidden = self.blocks[0](inputs[..., :h], inputs[..., h:h * (1 + self.token_inputs)])
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


def path_tokens(tokens: torch.Tensor, width: int) -> torch.Tensor:
    """``out[..., t, j] = tokens[..., t + j]`` for ``j < width``, 0 past the end: (..., seq) -> (..., seq, width)."""
    out = torch.zeros(*tokens.shape, width, dtype=tokens.dtype, device=tokens.device)
    for j in range(width):
        if j < tokens.shape[-1]:
            out[..., : tokens.shape[-1] - j, j] = tokens[..., j:]
    return out
