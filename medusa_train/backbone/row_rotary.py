"""The rotary embedding of a decoding step's rows on the row kernel: a backbone's Llama-style ``apply_rotary_pos_emb``
in one call, bitwise torch's.

transformers' Llama-style rotary embedding (Llama, Qwen2, Mistral and the many copied from it) is ~20 small torch ops a
layer for the query and key rows (``q * cos + rotate_half(q) * sin``, ``rotate_half`` two slices, a negation and a
``cat``): 22 us a layer warm on the AMX CPU for one token, 32 for 16, ~50-65 inside a decoding loop (its code and data
gone from the caches by the next layer): 1.5-1.9 ms of a ~20 ms bf16 step of SmolLM2-135M's 30 layers. ``rows.cpp``'s
``rotary`` computes the same in one call per tensor: every product and the sum rounded to the element type as torch
rounds each of its ops (no multiply fused into the add), so the output is bitwise transformers' (the tests hold it to
that), nothing that reads a step's output changes, and a cached greedy reply stays valid.

``switch_rotary(model)`` (called by ``row_layers.use_row_kernel``) replaces the ``apply_rotary_pos_emb`` of the modeling
module of each of the model's layers, for every model of that family in the process (transformers' attention reads it
from its module when it runs, as it reads the attention function ``use_grouped_attention`` registers), where that
function takes Llama's arguments and gives bitwise the kernel's output on probes of both dtypes; the replacement takes
the kernel where it applies (no autograd, CPU tensors of one dtype ``row_dtypes`` has, cos and sin of (batch or 1,
tokens, head dim) broadcast over the heads) and the module's own function everywhere else (training among them).
``MEDUSA_TRAIN_STEP_ROTARY=0`` leaves it alone; ``switch_back`` restores it.
"""

from __future__ import annotations

import inspect
import sys

import torch

from medusa_train.backbone.native import switched_off
from medusa_train.backbone.rows import row_dtypes, row_kernel

ENV_SWITCH = "MEDUSA_TRAIN_STEP_ROTARY"  #: ``0`` / ``off``: transformers' own rotary embedding
NAME = "apply_rotary_pos_emb"  #: the function's name in a transformers modeling module
PARAMETERS = ["q", "k", "cos", "sin", "unsqueeze_dim"]  #: Llama's, which the kernel computes


def step_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(q * cos + rotate_half(q) * sin, the same for k)`` through the kernel, q and k (batch, heads, tokens, head dim)
    and cos, sin (batch or 1, tokens, head dim); None where it does not apply (autograd, another device or layout, mixed
    dtypes, a dtype the kernel does not take, ``unsqueeze_dim`` other than 1). Each output has its input's strides."""
    if (unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or q.device.type != "cpu"
            or not (q.dtype == k.dtype == cos.dtype == sin.dtype) or q.dtype not in row_dtypes()):
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or cos.requires_grad or sin.requires_grad):
        return None
    batch, _, tokens, dim = q.shape
    if (k.shape[0] != batch or k.shape[2:] != (tokens, dim) or dim % 2 or cos.shape != sin.shape
            or cos.shape[1:] != (tokens, dim) or cos.shape[0] not in (1, batch) or cos.stride() != sin.stride()
            or q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or q.numel() == 0 or k.numel() == 0
            or not (k.device.type == cos.device.type == sin.device.type == "cpu")):
        return None
    kernel = row_kernel()
    if isinstance(kernel, str):
        return None
    run = kernel.rotary if q.dtype == torch.float32 else kernel.rotary_bf16
    cos_batch = cos.stride(0) if cos.shape[0] == batch and batch > 1 else 0
    rotated = []
    for x in (q, k):
        y = torch.empty_like(x)  # x's strides where it is dense (a head-transposed view: its layout kept)
        if y.stride(-1) != 1:
            y = torch.empty(x.shape, dtype=x.dtype)
        run(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), batch, x.shape[1], tokens, dim,
            x.stride(0), x.stride(1), x.stride(2), cos_batch, cos.stride(1), y.stride(0), y.stride(1), y.stride(2))
        rotated.append(y)
    return rotated[0], rotated[1]


def _step_version(original):
    """``original`` with the kernel taking the calls it applies to."""
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        rotated = step_rotary(q, k, cos, sin, unsqueeze_dim)
        return original(q, k, cos, sin, unsqueeze_dim) if rotated is None else rotated

    apply_rotary_pos_emb.step_rotary_of = original
    apply_rotary_pos_emb.__doc__ = original.__doc__
    return apply_rotary_pos_emb


def _computes_as_the_kernel(function) -> bool:
    """Whether ``function`` takes Llama's arguments and gives bitwise the kernel's output on probes (two batch rows,
    grouped heads, each dtype the kernel takes, cos and sin as a rotary module makes them)."""
    try:
        if list(inspect.signature(function).parameters) != PARAMETERS:
            return False
    except (TypeError, ValueError):
        return False
    generator = torch.Generator().manual_seed(0)
    for dtype in sorted(row_dtypes(), key=str):
        q = (3 * torch.randn(2, 6, 4, 32, generator=generator)).to(dtype).transpose(1, 2)  # (2, 4, 6, 32), as HF's
        k = (3 * torch.randn(2, 6, 2, 32, generator=generator)).to(dtype).transpose(1, 2)
        angles = torch.arange(6.0)[:, None] * (10000.0 ** -(torch.arange(0, 32, 2) / 32))[None]
        angles = torch.cat([angles, angles], -1)[None].expand(2, -1, -1) + torch.rand(2, 1, 1, generator=generator)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        with torch.no_grad():
            try:
                theirs = function(q, k, cos, sin)
            except Exception:  # another formula's arguments
                return False
            ours = step_rotary(q, k, cos, sin)
        if (ours is None or not isinstance(theirs, tuple) or len(theirs) != 2
                or not all(isinstance(t, torch.Tensor) and t.dtype == o.dtype and torch.equal(t, o)
                           for t, o in zip(theirs, ours))):
            return False
    return True


def switch_rotary(model: torch.nn.Module) -> int:
    """Replace ``apply_rotary_pos_emb`` in the modeling modules of ``model``'s layers where it computes the kernel's
    rotary embedding (above); how many modules hold the kernel's version now (0 where none applies, the kernel is not
    built, or ``MEDUSA_TRAIN_STEP_ROTARY=0``)."""
    if switched_off(ENV_SWITCH) or not row_dtypes():
        return 0
    switched = 0
    names = {type(m).__module__ for m in model.modules()}
    for module in (sys.modules.get(name) for name in sorted(names)):
        function = getattr(module, NAME, None)
        if function is None or not callable(function):
            continue
        if not hasattr(function, "step_rotary_of"):
            if not _computes_as_the_kernel(function):
                continue
            setattr(module, NAME, _step_version(function))
        switched += 1
    return switched


def switched_modules() -> list[str]:
    """The modeling modules of this process whose rotary embedding is the kernel's."""
    return sorted(name for name, module in list(sys.modules.items())
                  if hasattr(getattr(module, "__dict__", {}).get(NAME), "step_rotary_of"))


def switch_back() -> int:
    """Every switched module's own ``apply_rotary_pos_emb`` again (a benchmark's "before"); how many."""
    names = switched_modules()
    for name in names:
        module = sys.modules[name]
        setattr(module, NAME, getattr(module, NAME).step_rotary_of)
    return len(names)
