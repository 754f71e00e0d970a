"""Grouped-query attention for a decoding step's few masked tokens on a CPU, without copying the cache.

transformers' ``sdpa`` attention copies every cached key and value once per query head of a group (``repeat_kv``)
whenever a step of more than one token carries a mask: a verify over tree nodes, HF prompt lookup's check of its
guesses. It does so because CUDA's fused kernels take no mask with grouped queries; on a CPU torch's SDPA takes
both (``enable_gqa=True``) and gives bitwise the same output. The packaged model (9 query heads over 3 key/value
heads) copied 1.3 MB a layer for each 2-16 token step at context 256, 1.7-4.2 ms of a 30-52 ms backbone pass on the
BF16 CPU in float32 (``docs/results.md``, "Step cost").

``use_grouped_attention()`` registers the ``sdpa`` attention under transformers' own name (``AttentionInterface``),
for every model of the process at once, so HF ``generate``, HF prompt lookup and our decoder run the same attention
(a speedup still divides by the best plain decoding). It takes only the case above: a CPU, no autograd, a 4D mask,
more than one query token, grouped heads, none of sdpa's extras (a position bias, a paged cache, a soft cap); every
other call (a 1-token step, training, prefill without a mask, CUDA) is transformers' own function, unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

#: the sdpa keywords the grouped path does not handle (any of them set: transformers' own function runs)
EXTRAS = ("position_bias", "cache", "softcap")


def grouped_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa_attention_forward``, with a CPU step of several masked tokens over grouped heads sent to
    SDPA's grouped-query path instead of through copies of the keys and values: (batch, query, heads, dim)."""
    if (getattr(module, "num_key_value_groups", 1) > 1 and query.shape[2] > 1 and query.device.type == "cpu"
            and attention_mask is not None and attention_mask.dim() == 4 and not torch.is_grad_enabled()
            and not any(kwargs.get(name) is not None for name in EXTRAS)):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def use_grouped_attention() -> None:
    """Make ``grouped_sdpa_forward`` what every model of this process runs as ``sdpa`` (once is enough; again: the same)."""
    AttentionInterface.register("sdpa", grouped_sdpa_forward)


def transformers_sdpa() -> None:
    """Put transformers' own ``sdpa`` back (a benchmark's "before", a test's reference)."""
    AttentionInterface.register("sdpa", sdpa_attention_forward)
