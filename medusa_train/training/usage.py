"""What a training run used: its steps' wall time and the process's peak resident memory, in the run's last log
line (peak GPU memory is said once per command at its end: ``cli/entry.report_gpu_memory``)."""

from __future__ import annotations

import resource
import sys


def peak_resident_gib() -> float:
    """This process's peak resident set so far (``ru_maxrss``: KiB on Linux, bytes on macOS), in GiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**30 if sys.platform == "darwin" else 2**20)


def trained_line(first: int, last: int, seconds: float) -> str:
    """``trained steps FIRST-LAST in S s (M min); peak memory G GiB resident`` (``benchmarks/bench_peers_score.py``
    reads it)."""
    return (f"trained steps {first}-{last} in {seconds:.1f} s ({seconds / 60:.1f} min); "
            f"peak memory {peak_resident_gib():.2f} GiB resident")
