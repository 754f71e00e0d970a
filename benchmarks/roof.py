"""The compute side of a decoding step's limit on a CPU: how long the arithmetic of a step over N tokens takes.

A step over N tokens reads the backbone's weights once (the memory limit, ``bench_decode.read_bandwidth``) and does
N multiply-adds with each weight of its linear layers. At one row the reading dominates; from some N on the
arithmetic does, and no kernel can make a verify over that many nodes cost what a plain step costs. The rates are
measured from the caches (a weight small enough to stay in them, so no memory traffic counts): each linear path the
decoder runs (the row kernel or torch's GEMM) at exactly N rows against a 512-row weight, what the step's own
arithmetic gets at that N, and torch's GEMM over a 1024-cubed product.

The compute limit of a step over N tokens is the backbone's linear multiply-adds per token (attention over the
context left out: ~6% at context 256 for the 135M model) times N over the peak rate; the path's rate says how far
the kernel is from it. The peak is the vector units' own: register-only FMA chains on every thread
(``fma_peak.cpp``, built with the row kernel's instruction-set flags), or where that cannot be built the fastest
rate measured here, torch's GEMM over a large square product or a path at its most rows (MKL's GEMM is slow on AMD
CPUs: 87 G/s on the BF16 CPU, whose FMA chains reach 117).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from medusa_train.tree.cost import median_times


def linear_macs_per_token(backbone: torch.nn.Module) -> int:
    """Multiply-adds of one token through every linear layer of ``backbone`` (LM head included)."""
    return sum(m.weight.numel() for m in backbone.modules() if isinstance(m, torch.nn.Linear))


@torch.no_grad()
def macs_per_second(linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], rows: int, out_features: int,
                    in_features: int, repeats: int = 30) -> float:
    """Multiply-adds per second of ``linear(x, w)`` for ``rows`` float32 rows against a (out, in) weight, median of
    ``repeats`` calls, each call repeated so one timing lasts ~ms."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=generator)
    w = torch.randn(out_features, in_features, generator=generator)
    macs = rows * out_features * in_features
    inner = max(1, int(2e7 // macs))  # ~20 M multiply-adds a timing

    def run():
        for _ in range(inner):
            linear(x, w)

    seconds = median_times([run], repeats, 2, torch.device("cpu"))[0]
    return macs * inner / seconds


def vector_peak_macs_per_s(repeats: int = 5) -> float | None:
    """The CPU's multiply-add peak over torch's threads (``fma_peak.cpp``: the best of ``repeats`` ~0.1 s runs), or
    None where it cannot be built here (no compiler, not an AVX2 / AVX-512 CPU)."""
    from pathlib import Path

    from medusa_train.backbone.native import build_flags, cpu_isa

    isa = cpu_isa()
    if isa is None:
        return None
    try:
        from torch.utils.cpp_extension import load

        source = Path(__file__).with_name("fma_peak.cpp")
        module = load(name=f"medusa_train_fma_peak_{isa.lower()}", sources=[str(source)],
                      extra_cflags=["-O2", "-fopenmp", *build_flags(isa)], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as err:  # no compiler or ninja: the fastest measured rate stands in
        print(f"FMA peak not measured ({type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''})")
        return None
    threads = torch.get_num_threads()
    return max(module.fma_peak(10_000_000, threads) for _ in range(repeats))


def compute_roof(linears: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]], sizes: list[int],
                 in_features: int, macs_per_token: int) -> dict:
    """Each linear path's multiply-add rate at each row count in ``sizes`` against a cached (512 x
    ``in_features``) weight, torch's GEMM over a 1024-cubed product, the fastest of them all as the peak, and each
    size's compute limit in ms at that peak."""
    by_path = {name: {str(n): macs_per_second(fn, n, 512, in_features) for n in sizes} for name, fn in linears.items()}
    gemm = macs_per_second(torch.mm, 1024, 1024, 1024, repeats=5)
    fma = vector_peak_macs_per_s()
    peak = max([fma or 0.0, gemm, *(rate for rates in by_path.values() for rate in rates.values())])
    return {"peak_macs_per_s": peak, "fma_peak_macs_per_s": fma, "gemm_1024_macs_per_s": gemm,
            "macs_per_token": macs_per_token,
            "path_macs_per_s": by_path, "compute_limit_ms": {str(n): macs_per_token * n / peak * 1e3 for n in sizes}}
