"""Repetition measures and the loop stopper used by self-distillation."""

import random

import pytest

from medusa_train.data.distill.repetition import LoopTracker, loop_start, repeated_fraction, repeated_grams


def looping(prefix_len: int, period: int, total: int, seed: int = 0) -> list[int]:
    """``prefix_len`` distinct tokens, then one ``period``-long cycle repeated up to ``total`` tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1000, 2000) for _ in range(prefix_len)]
    cycle = [rng.randrange(3000, 4000) for _ in range(period)]
    return (prefix + cycle * total)[:total]


def test_loop_start_is_where_the_first_repeat_begins():
    tokens = looping(prefix_len=30, period=7, total=200)
    # the 30-token prefix and one 7-token cycle are new; the n-gram at 37 is the first repeat
    assert loop_start(tokens, n=8, window=64) == 37
    assert all(repeated_grams(tokens, 8)[37:]) and not any(repeated_grams(tokens, 8)[:37])
    assert loop_start(tokens, n=8, window=200) is None  # the loop is not that long
    assert loop_start(list(range(300)), n=8, window=8) is None
    assert loop_start(tokens + list(range(5000, 5010)), n=8, window=64) is None  # the loop ended


def test_a_repeated_phrase_inside_ordinary_text_is_not_a_loop():
    text = list(range(100)) + list(range(10, 30)) + list(range(200, 300))  # one 20-token quote
    assert loop_start(text, n=8, window=64) is None
    assert repeated_fraction(text, 8) < 0.1


def test_loop_tracker_says_sustained_exactly_when_loop_start_first_finds_the_loop():
    for seed, (prefix, period) in enumerate([(12, 5), (40, 11), (0, 3)]):
        row = looping(prefix, period, 160, seed=seed)
        tracker = LoopTracker(n=8, window=16)
        first = next(m for m, token in enumerate(row, start=1) if tracker.push(token))
        assert loop_start(row[:first], 8, 16) == prefix + period == tracker.loop_start
        assert loop_start(row[:first - 1], 8, 16) is None
    tracker = LoopTracker(n=8, window=16)
    assert not any(tracker.push(t) for t in range(300))
    with pytest.raises(ValueError, match="window=0"):
        LoopTracker(n=8, window=0)
