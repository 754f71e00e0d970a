"""Attention for a decoding step on a CPU: the step attention kernel, or SDPA over grouped heads without copies.

A step's 1-64 query tokens (a plain step's one, a verify's tree nodes, HF prompt lookup's guesses) go to the step
attention (``backbone/step_attention.py``): each query row alone in float32, keys in order, so a tree node attends
bitwise as the same token does in a plain step (greedy tree decoding on a CPU is plain greedy decoding, token for
token, in bf16 too), at a fifth to two thirds of SDPA's cost. Where it does not apply (no compiler, a head dimension
it was not built for, batch > 1) the paths below run.

transformers' ``sdpa`` attention copies every cached key and value once per query head of a group (``repeat_kv``)
whenever a step of more than one token carries a mask. It does so because CUDA's fused kernels take no mask with
grouped queries; on a CPU torch's SDPA takes both (``enable_gqa=True``) and gives bitwise the same output (the
packaged model's 9 query heads over 3 key/value heads copied 1.3 MB a layer for each 2-16 token step at context
256). torch's CPU SDPA in bf16 takes ~0.55 us a cached position for a single query token (float32: ~0.1), so a
1-token step in bf16 or fp16 attends in float32 there (its query, keys and values widened, the output rounded back).

Batched greedy replies (``backbone/batched.py``) step many prompts at once over one left-padded cache: given
``row_starts`` (where each row's own keys begin), each row attends over its own keys alone through the 1-token paths
above, so its output is bitwise that of the same step taken alone (padded keys, even masked, change how a row's
sums round).

``use_grouped_attention()`` registers ``step_sdpa_forward`` under transformers' own name (``AttentionInterface``;
``grouped_sdpa_forward``, the SDPA paths alone, with ``step_kernel=False``), for every model of the process at
once, so HF ``generate``, HF prompt lookup and our decoder run the same attention (a speedup still divides by the
best plain decoding). It takes only the cases above: a CPU, no autograd, none of
sdpa's extras (a position bias, a paged cache, a soft cap); every other call (training, a prefill without a mask,
CUDA) is transformers' own function, unchanged. ``attention_for`` names what a step runs (a cached greedy reply says
which it was made on)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from medusa_train.backbone.step_attention import DTYPES as STEP_DTYPES
from medusa_train.backbone.step_attention import step_attention, steps_taken

#: the sdpa keywords the grouped path does not handle (any of them set: transformers' own function runs)
EXTRAS = ("position_bias", "cache", "softcap")
WIDENED = (torch.bfloat16, torch.float16)  #: the dtypes whose 1-token CPU steps attend in float32


def step_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """``grouped_sdpa_forward`` with a CPU decoding step taken by the step attention first (1-64 query tokens with a
    4D mask, or one without: not a prefill, whose causal mask is implied). (batch, query, heads, dim)."""
    return _cpu_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, True, kwargs)


def grouped_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa_attention_forward``, with a CPU decoding step taken by SDPA directly: several masked
    tokens over grouped heads through its grouped-query path instead of through copies of the keys and values, a
    bf16 or fp16 1-token step in float32; with ``row_starts`` (a batch of 1-token steps over caches of different
    lengths, left-padded), each row over its own keys from its start, alone. (batch, query, heads, dim)."""
    return _cpu_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, False, kwargs)


def _cpu_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, kernel: bool,
                   kwargs: dict) -> tuple[torch.Tensor, None]:
    """Both functions' work (``kernel``: the step attention first)."""
    row_starts = kwargs.pop("row_starts", None)
    if row_starts is not None:
        if query.shape[2] != 1 or len(row_starts) != query.shape[0]:
            raise ValueError(f"row_starts: one start per row of a batch of 1-token steps, not {len(row_starts)} for "
                             f"a query of shape {tuple(query.shape)}")
        rows = [_cpu_attention(module, query[r:r + 1], key[r:r + 1, :, start:], value[r:r + 1, :, start:], None,
                               dropout, scaling, is_causal, kernel, dict(kwargs))[0]
                for r, start in enumerate(row_starts)]
        return torch.cat(rows), None
    if (query.device.type == "cpu" and not torch.is_grad_enabled()
            and not any(kwargs.get(name) is not None for name in EXTRAS)):
        grouped = getattr(module, "num_key_value_groups", 1) > 1
        four_d = attention_mask is not None and attention_mask.dim() == 4
        if kernel and (four_d or query.shape[2] == 1) and not dropout:
            out = step_attention(query, key, value, attention_mask if four_d else None,
                                 query.shape[-1] ** -0.5 if scaling is None else scaling)
            if out is not None:
                return out, None
        if query.shape[2] == 1 and query.dtype in WIDENED and (attention_mask is None or four_d):
            out = F.scaled_dot_product_attention(query.float(), key.float(), value.float(),
                                                 attn_mask=attention_mask.float() if four_d else None,
                                                 dropout_p=dropout, scale=scaling, enable_gqa=grouped)
            return out.to(query.dtype).transpose(1, 2).contiguous(), None
        if grouped and query.shape[2] > 1 and four_d:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                                 scale=scaling, enable_gqa=True)
            return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def use_grouped_attention(step_kernel: bool = True) -> None:
    """Make ``step_sdpa_forward`` (``step_kernel=False``: ``grouped_sdpa_forward``, a benchmark's "before") what
    every model of this process runs as ``sdpa`` (once is enough; again: the same)."""
    AttentionInterface.register("sdpa", step_sdpa_forward if step_kernel else grouped_sdpa_forward)


def transformers_sdpa() -> None:
    """Put transformers' own ``sdpa`` back (a benchmark's "before", a test's reference)."""
    AttentionInterface.register("sdpa", sdpa_attention_forward)


def head_dim_of(backbone) -> int | None:
    """The width of ``backbone``'s attention heads (its config's ``head_dim``, else hidden size over heads)."""
    text = backbone.config.get_text_config(decoder=True)
    heads = getattr(text, "num_attention_heads", None)
    return getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)


def attention_for(device: torch.device | str, dtype: torch.dtype, head_dim: int | None = None) -> str:
    """What a decoding step's attention runs for a model on ``device`` in ``dtype`` (heads of ``head_dim``) in this
    process: ``sdpa`` (as transformers has it), or with ``use_grouped_attention``'s CPU paths (``sdpa, CPU steps:
    ...``). The float32 1-token step of a bf16 model rounds otherwise than torch's bf16 one, and the step attention's
    AVX-512 build sums a score in one lane since the twenty-second session (before, across a vector's lanes), so a
    cached greedy reply names which it was made on."""
    registered = AttentionInterface._global_mapping.get("sdpa")
    if registered not in (step_sdpa_forward, grouped_sdpa_forward) or torch.device(device).type != "cpu":
        return "sdpa"
    taken = steps_taken(head_dim) if registered is step_sdpa_forward and dtype in STEP_DTYPES else None
    if taken == "all":
        return "sdpa, CPU steps: step attention, rows alone in float32, a key to a lane"
    if taken == "1 query":
        return "sdpa, CPU steps: step attention for 1 token, grouped for more"
    return "sdpa, CPU steps: grouped" + (", 1 token in float32" if dtype in WIDENED else "")
