"""The step attention: a decoding step's few query tokens over a CPU cache, each query row alone, in float32.

A decoding step attends 1-64 query tokens (a plain step's one, a verify's tree nodes, a prompt lookup's guesses) to a
cache of grouped key/value heads. torch's SDPA pays ~20x what such a step reads: ~44 us a layer for one bf16 query
over 142 cached keys (widened to float32 first: bf16 costs ~0.55 us a key there), 55-70 us for 12 queries. The kernel
(``step_attention.cpp``) takes 6-9 us and 35-50 us on the BF16 CPU (docs/results.md, "Step cost").

What it also guarantees: each query row is computed alone, by one thread, keys in order, each score by one fixed
sequence of operations, keys of weight exactly zero (masked out) skipped. So a row's output is bitwise the same
whichever rows share the call and whichever masked-out keys lie between its own. A verify step's tree node then
attends exactly as the same token does in a plain step over the same text, in bfloat16 as in float32: with the row
kernel's linears (each row's output bitwise the same beside any others, ``rows.py``) and per-row norms and
activations, a tree decoder's greedy output is a plain decoder's, token for token, on a CPU in any dtype.

Sums in float32 whatever the element type (float32 or bfloat16, a bf16 output rounded once to nearest even); a bf16
query's scores on AVX512-BF16 by its dot-product instruction (pairs of bf16 products, float32 sums). On AVX-512 the
scores take 16 keys at a time, a key to a lane (each 16-key block of the cache transposed once for up to 16 query rows),
a score its lane's sum over the head's elements in order: ~1.2x faster than one score a vector (summed across its
lanes) at 1-12 queries, 1.4-1.7x at 16-64 (docs/results.md, "Step cost"). Masks: none, a
float additive one (taken in float32) or a boolean one (True: attend), one row per query, the same for every head.

``step_attention`` returns None where it does not apply (not a CPU, batch > 1, a head dimension it was not built
for, more than ``MAX_QUERIES`` queries, more than one query on an AVX2 build, keys not laid out as a cache's), and
the caller runs SDPA.
``MEDUSA_TRAIN_STEP_ATTENTION=0`` turns it off (a benchmark's "before").
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from medusa_train.backbone import native

ENV_SWITCH = "MEDUSA_TRAIN_STEP_ATTENTION"  #: ``0`` / ``off``: SDPA for every step
SOURCE = Path(__file__).with_suffix(".cpp")  #: step_attention.cpp beside this file
#: the most query tokens a step it takes has (a verify over the largest tree); a prefill's many go to SDPA
MAX_QUERIES = 64
DTYPES = (torch.float32, torch.bfloat16)
#: the AVX-512 build's vector lanes. The AVX2 build (16 registers) holds one query row's sums at a time and reads each
#: key and value once per row: on one thread of the AVX2 code paths a 6-16 node verify cost 6-7% more than on SDPA's
#: path (the one-core demo's cost curve, 2026-11-30), so there the kernel takes one-query steps only, and a tree node
#: rounds as SDPA's grouped path rounds (float32 there: greedy parity held on that path before the kernel)
AVX512_LANES = 16


@functools.cache
def step_kernel():
    """The compiled kernel module for this CPU, or a string saying why there is none (built once a process)."""
    return native.build_for_cpu("step_attention", SOURCE, ENV_SWITCH)


def available() -> bool:
    """Whether the kernel is built (or could be imported) here."""
    return not isinstance(step_kernel(), str)


def steps_taken(head_dim: int | None = None) -> str | None:
    """Which decoding steps the kernel takes here for heads of ``head_dim`` (None: any it was built for): ``"all"``,
    ``"1 query"`` (an AVX2 build), or None (not built, or not for that head dimension)."""
    kernel = step_kernel()
    if isinstance(kernel, str) or (head_dim is not None and head_dim not in kernel.head_dims):
        return None
    return "all" if _takes_several(kernel) else "1 query"


def _takes_several(kernel) -> bool:
    """Whether steps of several queries go to this build (the AVX-512 one), not to SDPA's grouped path (AVX2)."""
    return kernel.lanes >= AVX512_LANES


def step_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                   scale: float) -> torch.Tensor | None:
    """Attention of a decoding step's queries over a cache, or None where the kernel does not apply.

    Args:
        query: (1, heads, queries, dim), any strides with a contiguous last dim (transformers' transposed view).
        key, value: (1, key heads, keys, dim), each head's keys a contiguous block (a cache's layers, or a view of
            their first keys); ``heads`` a multiple of ``key heads``.
        mask: None, or (1, 1, queries, >= keys) boolean (True: attend) or additive; the first ``keys`` columns read.
        scale: The scores' factor (``1 / sqrt(dim)`` usually).

    Returns:
        (1, queries, heads, dim) contiguous, the query's dtype (what transformers' attention functions return).
    """
    kernel = step_kernel()
    if isinstance(kernel, str) or (query.dim() == 4 and query.shape[2] > 1 and not _takes_several(kernel)):
        return None  # not built; or an AVX2 build: SDPA's grouped path for several queries (AVX512_LANES)
    return attend(kernel, query, key, value, mask, scale)


def attend(kernel, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> torch.Tensor | None:
    """``step_attention`` through the build ``kernel`` (``step_kernel()``'s, or another ISA's), for any 1 to
    ``MAX_QUERIES`` queries whatever the build, or None where it does not take these tensors."""
    if not _fits(query, key, value, mask, kernel.head_dims):
        return None
    _, heads, queries, dim = query.shape
    key_heads, keys = key.shape[1], key.shape[2]
    kind, row, pointer = 0, 0, 0
    if mask is not None:
        mask = _mask_rows(mask, keys)
        kind, row, pointer = (2 if mask.dtype == torch.bool else 1), mask.stride(0), mask.data_ptr()
    out = torch.empty(1, queries, heads, dim, dtype=query.dtype)
    run = kernel.attend if query.dtype == torch.float32 else kernel.attend_bf16
    run(query.data_ptr(), key.data_ptr(), value.data_ptr(), pointer, out.data_ptr(), queries, heads, key_heads, keys,
        dim, query.stride(2), query.stride(1), key.stride(1), value.stride(1), kind, row, float(scale))
    return out


#: the last mask ``_mask_rows`` read: (the 4D mask given, its version, keys read, its rows as the kernel reads them).
#: Every layer of a step gets the same mask tensor: its rows are taken (a bf16 mask widened) once a step, not once a
#: layer (30 of ~8 us each at 8 nodes on the BF16 CPU). Holding the mask keeps its address from being reused
_LAST_MASK: tuple = ()


def _mask_rows(mask: torch.Tensor, keys: int) -> torch.Tensor:
    """``mask``'s (queries, keys) rows, boolean or float32, each row contiguous: the step's one copy, made by its first
    layer and read by the others (the same tensor, unwritten since: its version; else made anew)."""
    global _LAST_MASK
    held = _LAST_MASK
    if held and held[0] is mask and held[1] == mask._version and held[2] == keys:
        return held[3]
    rows = mask[0, 0, :, :keys]
    if rows.dtype != torch.bool:
        rows = rows.float()  # a copy only when it is not float32 already: (queries, keys)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    _LAST_MASK = (mask, mask._version, keys, rows)
    return rows


def _fits(query, key, value, mask, head_dims) -> bool:
    """Whether the kernel takes these tensors as they are (no copies of the cache)."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.shape[0] != 1 or key.shape[0] != 1:
        return False
    if not (query.dtype == key.dtype == value.dtype and query.dtype in DTYPES):
        return False
    if any(t.device.type != "cpu" for t in (query, key, value)) or (mask is not None and mask.device.type != "cpu"):
        return False
    _, heads, queries, dim = query.shape
    key_heads, keys = key.shape[1], key.shape[2]
    if not (0 < queries <= MAX_QUERIES and keys > 0 and dim in head_dims and value.shape == key.shape
            and key.shape[3] == dim and heads % key_heads == 0 and query.stride(3) == 1):
        return False
    if any(t.stride(3) != 1 or t.stride(2) != dim for t in (key, value)):
        return False
    if mask is not None and (mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[1] != 1
                             or mask.shape[2] != queries or mask.shape[3] < keys):
        return False
    return True
