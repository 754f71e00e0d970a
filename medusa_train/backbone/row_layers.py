"""A model's layers switched to the row kernel for decoding steps, and back: its plain linear layers to ``RowLinear``
(``rows.py``) and its Llama-style RMS norms to the kernel's norm (``row_norms.py``), one call for every decoding path
(a loaded draft's backbone and draft, distillation, validation replies, the benchmarks), so every decoder of a process
runs the same layers (HF ``generate``, prompt lookup and ours: a speedup still divides by the best plain decoding); and
its family's Llama-style rotary embedding to the kernel's (``row_rotary.py``: bitwise transformers', every model of that
family in the process)."""

from __future__ import annotations

import contextlib

import torch

from medusa_train.backbone import huge_pages
from medusa_train.backbone.native import cpu_isa
from medusa_train.backbone.row_norms import is_row_norm, switch_norms
from medusa_train.backbone.row_norms import switch_back as switch_norm_back
from medusa_train.backbone.row_rotary import switch_back as switch_rotary_back
from medusa_train.backbone.row_rotary import switch_rotary
from medusa_train.backbone.rows import PACKED, RowLinear, amx_possible, bf16_possible, row_dtypes, row_kernel


def _switch_back(layer: torch.nn.Module) -> None:
    """A ``RowLinear`` a plain ``nn.Linear`` again, its packed weights let go."""
    layer.__dict__.pop(PACKED, None)
    layer.__class__ = torch.nn.Linear


def use_row_kernel(model: torch.nn.Module) -> tuple[int, str]:
    """Switch ``model``'s plain ``nn.Linear`` layers to ``RowLinear`` when it sits on a CPU in float32 (or in
    bfloat16, where ``bf16_possible``).

    Returns ``(layers switched, what was done)``; 0 layers where the model is elsewhere or in another dtype,
    the kernel is switched off, or it could not be built (the reason is in the message). Quantized and adapter
    layers (subclasses of ``nn.Linear``) are left alone."""
    params = list(model.parameters())
    if not params or any(p.device.type != "cpu" for p in params):
        return 0, "row kernel: not used (the model is not on a CPU)"
    wanted = {torch.float32, torch.bfloat16} if bf16_possible() else {torch.float32}
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.dtype in wanted]
    if not layers:
        kinds = "float32 or bfloat16" if len(wanted) > 1 else "float32"
        return 0, f"row kernel: not used (no {kinds} linear layers)"
    kernel = row_kernel()
    if isinstance(kernel, str):
        return 0, f"row kernel: {kernel}; these steps use torch's GEMM"
    layers = [m for m in layers if m.weight.dtype in row_dtypes()]
    if not layers:
        return 0, "row kernel: not used (built without bfloat16 here)"
    for layer in layers:
        layer.__class__ = RowLinear
    norms = switch_norms(model)
    rotary = switch_rotary(model)
    kinds = sorted({str(m.weight.dtype).removeprefix("torch.") for m in layers})
    bf16 = (", AVX512-BF16" + (", AMX tiles" if amx_possible() else "")) if torch.bfloat16 in row_dtypes() else ""
    pages = "2 MB pages" if huge_pages.possible() else f"4 KB pages: huge pages {huge_pages.transparent_huge_pages()}"
    return len(layers), (f"row kernel: {len(layers)} {' and '.join(kinds)} linear layers"
                         + (f" and {norms} RMS norms" if norms else "") + (" and the rotary embedding" if rotary else "")
                         + f" ({cpu_isa()}{bf16}; weights in {pages})")


@contextlib.contextmanager
def row_kernel_during(model: torch.nn.Module):
    """``use_row_kernel`` for the block only: the layers it switched are plain ``nn.Linear`` again after it, its norms
    their own classes (greedy replies from a backbone that trains before and after them; the family's rotary embedding
    stays the kernel's: bitwise transformers', and transformers' own under autograd). Yields ``use_row_kernel``'s
    ``(count, message)``."""
    before = {id(m) for m in model.modules() if type(m) is RowLinear or is_row_norm(m)}
    switched = use_row_kernel(model)
    try:
        yield switched
    finally:
        for layer in model.modules():
            if id(layer) in before:
                continue
            if type(layer) is RowLinear:
                _switch_back(layer)
            elif is_row_norm(layer):
                switch_norm_back(layer)


def without_row_kernel(model: torch.nn.Module) -> int:
    """Switch ``RowLinear`` layers back to ``nn.Linear``, RMS norms to their own classes and every family's rotary
    embedding to transformers' (a benchmark's "before" on the same model); how many linear layers."""
    layers = [m for m in model.modules() if type(m) is RowLinear]
    for layer in layers:
        _switch_back(layer)
    for norm in [m for m in model.modules() if is_row_norm(m)]:
        switch_norm_back(norm)
    switch_rotary_back()
    return len(layers)


def linear_path(model: torch.nn.Module) -> str:
    """What a decoding step's linear layers run on, for a report: the row kernel or torch's GEMM."""
    switched = [m for m in model.modules() if type(m) is RowLinear]
    if not switched:
        return "torch GEMM"
    tiles = ", AMX tiles" if amx_possible() and any(m.weight.dtype == torch.bfloat16 for m in switched) else ""
    norms = sum(1 for m in model.modules() if is_row_norm(m))
    return (f"row kernel ({cpu_isa()}{tiles}, {len(switched)} layers" + (f", {norms} RMS norms" if norms else "")
            + f", packed in {'2 MB' if huge_pages.possible() else '4 KB'} pages)")
