"""What a training run used: its steps' wall time and the process's peak memory, in the run's last log line."""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory(device: torch.device) -> str:
    """This process's peak memory so far: resident set (``ru_maxrss``: KiB on Linux, bytes on macOS) and, on CUDA,
    the most the caching allocator held for tensors."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**30 if sys.platform == "darwin" else 2**20)
    line = f"peak memory {rss:.2f} GiB resident"
    if device.type == "cuda":
        line += f", {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB CUDA ({device})"
    return line


def trained_line(first: int, last: int, seconds: float, device: torch.device) -> str:
    """``trained steps FIRST-LAST in S s (M min); peak memory ...`` (``benchmarks/bench_peers_score.py`` reads it)."""
    return f"trained steps {first}-{last} in {seconds:.1f} s ({seconds / 60:.1f} min); {peak_memory(device)}"
