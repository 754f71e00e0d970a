"""Python's garbage collections while timed decoding ran: how many of each generation, and the seconds they took.

A batch-1 step on a GPU is a few milliseconds of host work, so a collection over many objects can cost a step several
times over; the report keeps what ran inside its timed region, beside ``plain_steadiness``, so a disturbed timing can
be told from one that was the machine's own (``evaluation/summary.py``).
"""

from __future__ import annotations

import gc
import time


class CollectorPauses:
    """A context in which every collection is counted and timed (``gc.callbacks``)."""

    def __init__(self):
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            generation = min(int(info["generation"]), 2)
            self.collections[generation] += 1
            self.seconds[generation] += time.perf_counter() - self._start

    def __enter__(self) -> CollectorPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict:
        """``{collections: [gen 0, 1, 2], seconds: [...], total_s}``."""
        return {"collections": list(self.collections), "seconds": [round(s, 4) for s in self.seconds],
                "total_s": round(sum(self.seconds), 4)}
