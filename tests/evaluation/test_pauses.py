"""The report's count of garbage collections inside its timed region."""

from __future__ import annotations

import gc

from medusa_train.evaluation.pauses import CollectorPauses


def test_collections_inside_are_counted_by_generation_and_none_after():
    before = len(gc.callbacks)
    with CollectorPauses() as pauses:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    assert pauses.collections[0] >= 1 and pauses.collections[2] == 2  # gen 0 may also run on its own
    assert all(s >= 0 for s in pauses.seconds) and pauses.summary()["total_s"] == round(sum(pauses.seconds), 4)
    gc.collect(2)  # outside: not counted, and the callback is gone
    assert pauses.collections[2] == 2 and len(gc.callbacks) == before
