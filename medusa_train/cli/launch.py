"""Make ``accelerate launch --cpu --num_processes N`` start N processes.

accelerate 1.x starts CPU multi-process runs only through mpirun; without it, ``--cpu
--num_processes 2`` quietly runs a single process. When an entry point finds itself started
that way (``ACCELERATE_USE_CPU`` set, no ``WORLD_SIZE``, and its parent ``accelerate launch``
asked for N > 1), it re-executes itself under ``torch.distributed.run`` with N processes, which
accelerate then sees as a MULTI_CPU (gloo) run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def requested_cpu_processes() -> int:
    """N from the parent ``accelerate launch --cpu --num_processes N``; 1 when that does not apply."""
    if os.environ.get("WORLD_SIZE") or os.environ.get("ACCELERATE_USE_CPU", "").lower() != "true":
        return 1
    try:
        parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="ignore").split("\0")
    except OSError:
        return 1
    if not any("accelerate" in part for part in parent):
        return 1
    for i, part in enumerate(parent):
        if part in ("--num_processes", "--num-processes") and i + 1 < len(parent):
            return int(parent[i + 1]) if parent[i + 1].isdigit() else 1
        if part.startswith(("--num_processes=", "--num-processes=")):
            value = part.split("=", 1)[1]
            return int(value) if value.isdigit() else 1
    return 1


def relaunch_cpu_processes_if_asked() -> None:
    """Re-exec this script under torch.distributed.run when N > 1 CPU processes were asked for."""
    n = requested_cpu_processes()
    if n <= 1:
        return
    print(f"[medusa_train] accelerate launch --cpu runs one process without mpirun; "
          f"starting {n} processes with torch.distributed.run", flush=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
           *started_as(sys.orig_argv)]
    os.execv(sys.executable, cmd)


def started_as(orig_argv: list[str]) -> list[str]:
    """This process's command line past the interpreter and its options, as torch.distributed.run takes it:
    ``--module NAME ARGS`` for ``python -m NAME ARGS`` (``accelerate launch -m medusa_train capture ...``), else
    the script and its arguments (``train.py``, the ``medusa-train`` script). Read from ``sys.orig_argv``:
    ``medusa-train <command>`` rewrites ``sys.argv``."""
    i = 1
    while i < len(orig_argv) and orig_argv[i].startswith("-") and orig_argv[i] != "-m":
        i += 2 if orig_argv[i] in ("-X", "-W") else 1  # options that take their value as the next word
    if i < len(orig_argv) and orig_argv[i] == "-m":
        return ["--module", *orig_argv[i + 1:]]
    return orig_argv[i:]
