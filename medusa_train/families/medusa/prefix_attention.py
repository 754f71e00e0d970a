"""Prefix attention: one causal self-attention layer over the backbone's hidden states that the heads read.

A Medusa head reads the hidden state of one position. The backbone made that state to predict the
next token, not the ones after it, and a small head cannot look back at the context for what it
lacks. With ``heads.prefix_attention`` (Hydra++'s prefix attention) a decoder layer of our own,
``x + Attn(norm x)`` then ``+ MLP(norm ·)``, mixes the hidden states of the whole prefix first; the
heads read its output. It is causal and sees only hidden states of tokens already accepted, so at
decode time it keeps its own key/value cache (an ``AppendingLayer``, written in place: a step copies only its own
positions) and runs once per step over the tokens just accepted.

The layer has no positional encoding: its queries see a causal prefix of hidden states that already
carry their positions. Its output projections start at zero, so fresh heads still reproduce the LM
head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from medusa_train.backbone.appending_cache import AppendingLayer
from medusa_train.backbone.step_attention import step_attention


class PrefixAttention(nn.Module):
    """A pre-norm decoder layer (RMSNorm, multi-head causal attention, SiLU-gated MLP), identity at init.

    Args:
        hidden_size: The backbone's hidden size.
        num_attention_heads: Attention heads (must divide ``hidden_size``).
        intermediate_size: Width of the gated MLP.
    """

    def __init__(self, hidden_size: int, num_attention_heads: int, intermediate_size: int):
        super().__init__()
        if num_attention_heads < 1 or hidden_size % num_attention_heads:
            raise ValueError(f"heads.prefix_attention: {num_attention_heads} attention heads do not divide hidden "
                             f"size {hidden_size}")
        self.num_attention_heads = num_attention_heads
        self.attn_norm = nn.RMSNorm(hidden_size, eps=1e-6)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.out = nn.Linear(hidden_size, hidden_size, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden_size, eps=1e-6)
        self.gate_up = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.down.weight)

    def forward(self, hidden: torch.Tensor, cache: AppendingLayer | None = None) -> torch.Tensor:
        """``hidden`` (batch, seq, hidden) -> the same shape; position t sees positions <= t only.

        With ``cache`` the sequence continues the positions it holds (their keys and values are
        read, and the new ones appended). Padding must come after the real tokens (right padding):
        real positions then never see it.
        """
        batch, seq, size = hidden.shape
        dtype = self.qkv.weight.dtype
        x = hidden.to(dtype)
        q, k, v = self.qkv(self.attn_norm(x)).view(batch, seq, 3, self.num_attention_heads, -1).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head dim)
        past = 0 if cache is None else cache.get_seq_length()
        if cache is not None:
            keys, values = cache.update(k, v)  # written after the positions it holds, in place
            if past:
                k, v = keys, values
        if past:
            allowed = torch.ones(1, 1, seq, past + seq, dtype=torch.bool, device=x.device).tril(past)
            # a decoding step on a CPU: the step attention (None where it does not apply, as in training)
            stepped = None if torch.is_grad_enabled() else step_attention(q, k, v, allowed, q.shape[-1] ** -0.5)
            attended = (stepped if stepped is not None
                        else F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2))
        else:
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        x = x + self.out(attended.reshape(batch, seq, size))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)
