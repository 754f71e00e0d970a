"""The row kernel: a backbone's float32 (and bfloat16) linear layers on a CPU, for the few rows of a decoding step.

A decoding step on a CPU is memory-bound: a 1-token step and a verify over a few tree nodes read the same
weights. A library GEMM does not treat them alike: at 2-16 rows it packs the weights on each call and computes
afterwards, so a 2-token verify in float32 costs 1.8x a 1-token step on an AVX2 CPU (``docs/results.md``, "Step
cost"). ``rows.cpp`` packs each layer's weights once (``pack_weight``: panels of 32 outputs on AVX-512, 24 on
AVX2, k-major, so a vector load brings one k for every output of the panel) and streams them once a step, used
by every row; each output is one vector lane summing its k in order, so a row's output is bitwise the same in any
verify it is part of, and no lanes are summed across at the end (the kernel before this one read ``nn.Linear``'s
own layout and summed each output's lanes: as long as the products themselves at K = 576). A panel is read once, in
L1-sized blocks that every group of rows takes in turn while the next block is prefetched (so memory keeps reading
while the rows multiply). A float32 step of 1-64 rows takes the kernel (on an Intel CPU whose packed weights are not
in 2 MB pages a 1-token step stays on MKL's GEMV, and 2-3 rows on AVX-512), a bfloat16 step of 1-16 rows on an Intel
CPU (1-64 on AMX's tiles, below, and on other vendors' CPUs, where MKL's small-row paths are slow: ``row_range``).

``use_row_kernel(model)`` (``row_layers.py``) switches every plain ``nn.Linear`` of a model to it (and its Llama-style
RMS norms to the kernel's norm: ``row_norms.py``). A switched layer uses the kernel
only where it applies (no autograd, CPU tensors of a dtype ``row_dtypes`` has, the rows ``row_range`` gives) and
``F.linear`` everywhere else: training, prefill, CUDA and the dtypes the kernel does not take are untouched. It
packs its weights at its first kernel call and again whenever they change (a new tensor, or one written in place:
its version counter), and holds the packed copy until switched back: the weights' memory twice while decoding,
none of it in the state dict. Every decoder on the machine gets it at once (HF ``generate``, prompt lookup and
ours run the same backbone), so a speedup still divides by the best plain decoding there. The kernel is compiled
for this CPU on first use (AVX-512 or AVX2 with FMA; ~10 s, kept in torch's ``~/.cache/torch_extensions`` and
imported from there afterwards); without a compiler, or on another CPU, layers stay as they are and one line says
why. ``MEDUSA_TRAIN_ROW_KERNEL=0`` turns it off (a benchmark's "before").

bfloat16: where an AVX-512 CPU has AVX512-BF16 (``bf16_possible``), the kernel takes bfloat16 layers too (one
instruction sums a pair of bf16 products into each float32 lane; the bias added in float32; each output rounded once
to bf16, to nearest even): on the AMD EPYC torch's bf16 linears read their weights at 9-14 GB/s; on the Intel Xeon
with AMX torch's bf16 GEMM takes ~54 ms for the backbone's pass over 1-8 rows where the kernel takes 37-55.
A draft vocabulary's rows of the LM head take the kernel as the LM head does (``step_linear``).

AMX: where the CPU also has AMX's tiles (Intel's from Sapphire Rapids; ``amx_possible``), bfloat16 layers run on them
from the same packed panels (one tile instruction multiplies 16 rows by 32 k of 16 outputs): the backbone's linears
over 1 / 16 / 32 / 64 rows take 14.0 / 16.2 / 18.9 / 26.5 ms on the AMX CPU, at its measured read rate, where the
AVX512-BF16 path takes 15.9 / 37.1 / 59.0 / 109.5 and torch's AMX GEMM (packing the weights each call) ~30-40: so
bfloat16 steps of 1-64 rows take it there (``MAX_ROWS``). Its sums are each row's alone, in the same order at any
number of rows, so tree decoding there is plain greedy too; they are not the AVX512-BF16 path's (~1 output in 8,000
rounds otherwise), so a cached reply names which it was made on (``linears_for``).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from medusa_train.backbone import huge_pages, native
from medusa_train.backbone.native import cpu_isa, cpu_vendor

#: the fewest rows (tokens in a step) the kernel takes, by instruction set, on an Intel CPU. One row stays torch's
#: there (MKL's GEMV streams the weights already, 9% faster than the kernel's on the AVX2 code paths); on AVX-512
#: two rows too (MKL's 2-row path was as fast as the kernel there). Measured against the kernel before packed panels
#: (eighth session); the panels' kernel is 9-13% faster at 1-4 rows on AMD and not yet measured on an Intel CPU
MIN_ROWS = {"AVX512": 4, "AVX2": 2}
#: ... unless the packed weights sit in 2 MB pages (``huge_pages.possible``): then from one row on both (the AMX CPU,
#: float32, the backbone's 211 linears at 1 / 2 rows: torch's 30.2 / 30.6 ms, the kernel's panels 27.9 / 26.9; on the
#: AVX2 code paths 34.6 / 59.8 against 26.0 / 28.5; in 4 KB pages the kernel took 51.1 at one row; 2026-12-01)
MIN_ROWS_HUGE_PAGES = 1
#: the most rows it takes (a verify over the largest tree), float32 on every CPU: since the kernel reads each panel
#: once in L1-sized blocks it is faster than torch's GEMM to 64 rows on Intel too (the AMX CPU, the backbone's 210
#: float32 linears, two threads, 16 / 32 / 64 rows: torch's 37.8 / 42.8 / 61.9 ms, the kernel 22.5 / 27.3 / 44.1; on
#: the AVX2 code paths 46.7 / 60.9 / 79.3 against 23.0 / 36.7 / 64.6; 2026-12-01); on other vendors' CPUs (AMD EPYC,
#: float32, 32 / 64 tokens: 127 / 175 ms on torch's GEMM, 80 / 135 on the kernel before it, the same on the AVX2 code
#: paths) and on AMX's tiles (1 / 16 / 64 rows: 14.0 / 16.2 / 26.5 ms, torch's AMX GEMM ~30 / 30 / 37) in bfloat16 too
MAX_ROWS = 64
#: the fewest bfloat16 rows it takes on an Intel CPU: from one (the AMX CPU, the backbone's bf16 pass over 1 / 2 / 4 /
#: 8 / 16 / 32 rows: torch's AMX GEMM 54.3 / 55.7 / 53.7 / 59.5 / 62.4 / 72.4 ms, the kernel 36.8 / 40.8 / 44.7 /
#: 55.3 / 64.9 / 88.2; twentieth session, docs/results.md): a plain step and a verify over up to 16 nodes then sum
#: alike, so bf16 tree decoding there is plain greedy for trees of up to ``MAX_ROWS_BF16`` nodes (an Intel CPU
#: without AMX's tiles: with them, ``MAX_ROWS``)
MIN_ROWS_BF16 = 1
#: ... and to 16: more bfloat16 rows go to torch's GEMM on an Intel CPU without AMX's tiles in use (on the AMX CPU
#: with the tiles switched off, the backbone's bf16 linears over 16 / 24 / 64 rows: torch's AMX GEMM 20.7 / 21.3 /
#: 26.4 ms, the AVX512-BF16 path 18.6 / 25.8 / 62.1; 2026-12-01)
MAX_ROWS_BF16 = 16
#: on any other CPU, from one row: MKL gives other vendors' CPUs slower small-row paths (AMD EPYC, AVX-512, float32:
#: the backbone's 1-token pass 48.6 ms on MKL's GEMV, 31.1 ms on the kernel; a 2-token pass 74.4 against 36.9).
#: A plain step, HF ``generate``'s included, then runs the kernel too: every speedup still divides by it
MIN_ROWS_ELSEWHERE = 1
ENV_SWITCH = "MEDUSA_TRAIN_ROW_KERNEL"  #: ``0`` / ``off``: never switch layers
#: ``0`` / ``off``: bfloat16 stays on the AVX512-BF16 path where the CPU has AMX (a benchmark's "before", or a machine
#: whose tiles misbehave)
AMX_SWITCH = "MEDUSA_TRAIN_AMX_TILES"
SOURCE = Path(__file__).with_suffix(".cpp")  #: rows.cpp beside this file


def switched_off() -> bool:
    """True when ``MEDUSA_TRAIN_ROW_KERNEL`` says not to use the kernel."""
    return native.switched_off(ENV_SWITCH)


@functools.cache
def row_kernel():
    """The compiled kernel module for this CPU, or a string saying why there is none (built once a process)."""
    return native.build_for_cpu("rows", SOURCE, ENV_SWITCH)


def _build(isa: str, flags: list[str]):
    """The kernel built (or imported, built before) for ``isa`` with ``flags``, or a string saying why it could not be."""
    return native.build("rows", SOURCE, isa, flags)


@functools.cache
def row_range(dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """The fewest and the most rows of ``dtype`` a switched layer sends to the kernel on this CPU (``(1, 0)``: none)."""
    isa = cpu_isa()
    if isa is None:
        return 1, 0
    if dtype == torch.bfloat16 and amx_possible():
        return 1, MAX_ROWS
    if cpu_vendor() in ("GenuineIntel", None):
        if dtype == torch.bfloat16:
            return MIN_ROWS_BF16, MAX_ROWS_BF16
        return (MIN_ROWS_HUGE_PAGES if huge_pages.possible() else MIN_ROWS[isa]), MAX_ROWS
    return MIN_ROWS_ELSEWHERE, MAX_ROWS


def bf16_possible() -> bool:
    """Whether the kernel can take bfloat16 layers here: an AVX-512 CPU with AVX512-BF16 (on the AMD EPYC torch's
    bfloat16 linears stream their weights at 9-14 GB/s where the kernel's bf16 path reaches 19-27; on the Intel Xeon
    it is faster than torch's AMX GEMM at 1-8 rows: ``MIN_ROWS_BF16``; docs/results.md, "Step cost")."""
    return cpu_isa() == "AVX512" and "avx512_bf16" in native.cpu_flags()


@functools.cache
def amx_possible() -> bool:
    """Whether bfloat16 layers run on AMX's tiles here: the kernel was built with AMX's flags (a CPU with AMX-BF16, a
    compiler that knows them) and Linux gave this process the tiles' state (asked for once, as oneDNN asks), unless
    ``MEDUSA_TRAIN_AMX_TILES=0``."""
    if native.switched_off(AMX_SWITCH):
        return False
    kernel = row_kernel()
    return not isinstance(kernel, str) and hasattr(kernel, "rows_linear_amx") and bool(kernel.amx_permitted())


@functools.cache
def row_dtypes() -> frozenset:
    """The dtypes the built kernel takes on this CPU: float32, and bfloat16 where ``bf16_possible`` (none unbuilt)."""
    kernel = row_kernel()
    if isinstance(kernel, str):
        return frozenset()
    bf16 = bf16_possible() and hasattr(kernel, "rows_linear_bf16")
    return frozenset({torch.float32, torch.bfloat16} if bf16 else {torch.float32})


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """``w`` (N, K) packed as the kernel reads it: panels of ``panel`` outputs (the last one padded with zeros), each
    holding for every step along K its outputs' weights side by side (float32: one k, as (panels, K, panel);
    bfloat16: a pair of k, as (panels, K / 2, panel, 2), an odd K padded with a zero weight). A copy, in 2 MB pages
    where Linux gives them (``huge_pages``): ``w`` is left as it is."""
    panel = row_kernel().panel
    n, k = w.shape
    panels, steps = -(-n // panel), k if w.dtype == torch.float32 else -(-k // 2)
    padded = torch.zeros(panels * panel, k if w.dtype == torch.float32 else 2 * steps, dtype=w.dtype)
    padded[:n, :k] = w
    if w.dtype == torch.float32:
        order = padded.view(panels, panel, k).transpose(1, 2)
    else:
        order = padded.view(panels, panel, steps, 2).permute(0, 2, 1, 3)
    return huge_pages.empty(tuple(order.shape), w.dtype).copy_(order)  # streamed every step: in 2 MB pages


def rows_linear(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` through the row kernel: x (M, K), w (N, K) and bias (N,) CPU tensors of one dtype it
    takes (float32, or bfloat16 where ``row_dtypes`` has it: float32 sums and bias rounded once to bfloat16); (M, N)
    in that dtype. Packs ``w`` on every call unless given ``packed`` (``pack_weight(w)``, made by the caller once; a
    switched layer keeps its own: ``RowLinear``)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"rows_linear: x (M, K) and w (N, K), not {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype or x.dtype not in row_dtypes() or x.device.type != "cpu" or w.device.type != "cpu":
        taken = ", ".join(sorted(str(d).removeprefix("torch.") for d in row_dtypes())) or "none: not built"
        raise ValueError(f"rows_linear: CPU tensors of one dtype the kernel takes here ({taken}), not "
                         f"{x.dtype} / {w.dtype} on {x.device} / {w.device}")
    if bias is not None and (bias.shape != (w.shape[0],) or bias.dtype != w.dtype or bias.device.type != "cpu"):
        raise ValueError(f"rows_linear: a bias of shape ({w.shape[0]},) in {w.dtype} on the CPU, not "
                         f"{tuple(bias.shape)} in {bias.dtype} on {bias.device}")
    return _rows_linear(x, pack_weight(w.contiguous()) if packed is None else packed, w.shape[0], bias)


def _rows_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` from ``w`` packed (``pack_weight``) with ``n`` outputs, once the arguments are known to
    fit: x (..., K), every leading dimension a row; (..., n). bf16 rows of an odd K get the zero input their last
    pair's weight is padded against; the bias, in x's dtype, is added to the float32 sums before their one rounding.
    Lean on purpose: a decoding step makes ~200 of these calls (a ``RowLinear`` call ~10 us, the kernel's own ~1)."""
    x = x.contiguous() if x.dtype == torch.float32 or x.shape[-1] % 2 == 0 else F.pad(x, (0, 1))
    bias = None if bias is None else bias.contiguous()  # held here: the kernel reads it through a pointer
    y = x.new_empty((*x.shape[:-1], n))
    kernel = row_kernel()
    run = (kernel.rows_linear if x.dtype == torch.float32
           else kernel.rows_linear_amx if amx_possible() else kernel.rows_linear_bf16)
    run(x.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
        math.prod(x.shape[:-1]), x.shape[-1], n)
    return y


#: where a holder keeps its packed weight: (the weight, its data pointer and version, packed, the data packed from).
#: The last keeps that data alive, so no other data can land at its address while the pack is held: a dtype round
#: trip (``layer.bfloat16().float()``) once put new weights where the old were freed, at the same version, and the
#: stale pack ran (CI, 2026-12-07; the old data is held until the next call packs again)
PACKED = "_row_kernel_packed"


def step_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, held: dict) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` through the row kernel where it applies to this call (no autograd, CPU tensors of
    a dtype ``row_dtypes`` has, the rows ``row_range`` gives), else None. ``held``: the dict its packed weight is kept
    in (a layer's own ``__dict__``, a draft vocabulary's), packed again whenever the weight is not the one packed
    (another tensor, other data under it, or the same data written in place: its version counter; the data packed
    from is held with the pack, so other data under the same parameter can never share its address)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    fewest, most = row_range(x.dtype)
    # ``is_cpu``, not ``device.type``: ~0.1 us against ~0.9, in a check made ~200 times a step
    if not (fewest <= rows <= most and x.dtype == weight.dtype and x.dtype in row_dtypes() and x.is_cpu
            and weight.is_cpu and (bias is None or (bias.dtype == x.dtype and bias.is_cpu))
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad)))):
        return None
    packed = held.get(PACKED)
    if packed is None or packed[0] is not weight or packed[1] != (weight.data_ptr(), weight._version):
        with torch.no_grad():
            data = weight.detach()
            packed = (weight, (data.data_ptr(), data._version), pack_weight(data.contiguous()), data)
        held[PACKED] = packed
    return _rows_linear(x, packed[2], weight.shape[0], bias)


class RowLinear(torch.nn.Linear):
    """An ``nn.Linear`` that runs a decoding step's few CPU rows through the row kernel (float32; bfloat16 where
    ``row_dtypes`` has it: its sums and bias rounded once), ``step_linear``; every other call is ``F.linear``'s.

    The same parameters and state dict as the layer it was; ``use_row_kernel`` switches a layer's class to it. It
    packs its weight at the first call that takes the kernel and keeps the packed copy in its ``__dict__`` (not a
    parameter or buffer: never in the state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = step_linear(x, self.weight, self.bias, self.__dict__)
        return F.linear(x, self.weight, self.bias) if y is None else y


def linears_for(device: torch.device | str, dtype: torch.dtype) -> str:
    """What a decoding step's linear layers run on for a backbone on ``device`` in ``dtype`` once ``use_row_kernel``
    has run: the row kernel (``row kernel, panels (AVX512), rows 1-64``: the rows it takes, the others torch's;
    bfloat16 on AMX: ``row kernel, AMX tiles``) or ``torch``. Its sums round differently from torch's (and from those
    of the kernel before it, which summed each output's lanes at the end; the tiles' from the panels'), so a cached
    greedy reply names the one it was made on."""
    if torch.device(device).type != "cpu" or dtype not in row_dtypes():
        return "torch"
    if dtype == torch.bfloat16 and amx_possible():
        return "row kernel, AMX tiles"
    fewest, most = row_range(dtype)
    return f"row kernel, panels ({cpu_isa()}), rows {fewest}-{most}"
