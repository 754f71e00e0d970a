"""A command's time budget (``max_minutes``: distill, evaluate's ``bench.max_minutes``, build-tree's
``guard_max_minutes``): the work is sized to the machine by stopping to start new items once it is spent, never by
cutting one short; what was done is kept and the command says how much."""

from __future__ import annotations

import time


def budget_spent(started: float, minutes: float | None) -> bool:
    """Whether ``minutes`` have passed since ``started`` (a ``time.perf_counter()`` reading); never when ``minutes``
    is ``None`` (no budget)."""
    return bool(minutes) and time.perf_counter() - started >= minutes * 60
