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
        x, q, k, v = self._project(hidden)
        seq = x.shape[1]
        past = 0 if cache is None else cache.get_seq_length()
        if cache is not None:
            keys, values = cache.update(k, v)  # written after the positions it holds, in place
            if past:
                k, v = keys, values
        if past:
            allowed = torch.ones(1, 1, seq, past + seq, dtype=torch.bool, device=x.device).tril(past)
            attended = self._attend(q, k, v, allowed)
        else:
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return self._finish(x, attended)

    def step_in_room(self, hidden: torch.Tensor, key_room: torch.Tensor, value_room: torch.Tensor,
                     length: torch.Tensor, empty: bool = False) -> torch.Tensor:
        """``forward`` with a cache of fixed rooms (batch, attention heads, room, head dim) holding ``length`` (a
        0-d long tensor, read on the device) positions: the new keys and values are written after them and every
        room position past a query's own is masked, so each step reads and writes the same buffers (what a CUDA
        graph replays). ``length`` is left as it was. ``empty``: the rooms hold nothing yet (the prompt), attended
        as ``forward`` attends it. On a CPU the step attention skips the masked positions: each row bitwise
        ``forward``'s."""
        x, q, k, v = self._project(hidden)
        positions = length + torch.arange(x.shape[1], device=x.device)
        key_room.index_copy_(2, positions, k)
        value_room.index_copy_(2, positions, v)
        if empty:
            return self._finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2))
        allowed = torch.arange(key_room.shape[2], device=x.device) <= positions[:, None]
        return self._finish(x, self._attend(q, key_room, value_room, allowed[None, None]))

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``hidden`` in the layer's dtype and its queries, keys and values (batch, attention heads, seq, head dim)."""
        batch, seq, _ = hidden.shape
        x = hidden.to(self.qkv.weight.dtype)
        q, k, v = self.qkv(self.attn_norm(x)).view(batch, seq, 3, self.num_attention_heads, -1).unbind(2)
        return (x, *(t.transpose(1, 2) for t in (q, k, v)))

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """(batch, seq, attention heads, head dim): queries over keys where ``allowed`` (1, 1, seq, keys)."""
        # a decoding step on a CPU: the step attention (None where it does not apply, as in training)
        stepped = None if torch.is_grad_enabled() else step_attention(q, k, v, allowed, q.shape[-1] ** -0.5)
        return stepped if stepped is not None else F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2)

    def _finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's output: the attention's projection added to ``x``, then the gated MLP's."""
        batch, seq, size = x.shape
        x = x + self.out(attended.reshape(batch, seq, size))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)
