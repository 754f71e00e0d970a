"""Repetition measures and the loop stopper used by self-distillation."""

import random

import pytest
import torch

from medusa_train.repetition import LoopStopper, loop_start, repeated_fraction, repeated_grams


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


@pytest.mark.parametrize("prompt_len", [0, 5])
def test_loop_stopper_stops_each_row_where_loop_start_says_its_loop_is_sustained(prompt_len):
    rows = [looping(12, 5, 160, seed=1), looping(40, 11, 160, seed=2), list(range(160))]
    stopper = LoopStopper(prompt_len, n=8, window=16)
    prompt = torch.full((3, prompt_len), 7)
    stopped_when = [None, None, None]
    for length in range(1, 161):  # generate() calls it once per new token
        ids = torch.cat([prompt, torch.tensor([r[:length] for r in rows])], dim=1)
        flags = stopper(ids, None)
        assert flags.dtype == torch.bool and flags.shape == (3,)
        for r in range(3):
            if flags[r] and stopped_when[r] is None:
                stopped_when[r] = length
    assert stopped_when[2] is None and stopper.stopped_at[2] is None
    for r in (0, 1):
        at = stopper.stopped_at[r]
        assert at == stopped_when[r]
        # the first length at which the reply ends in a sustained loop
        assert loop_start(rows[r][:at], 8, 16) is not None and loop_start(rows[r][:at - 1], 8, 16) is None
    assert loop_start(rows[0][:stopper.stopped_at[0]], 8, 16) == 12 + 5
    assert loop_start(rows[1][:stopper.stopped_at[1]], 8, 16) == 40 + 11


def test_loop_stopper_catches_up_when_called_after_several_tokens():
    row = looping(20, 6, 120, seed=3)
    every = LoopStopper(0, n=4, window=10)
    for length in range(1, 121):
        every(torch.tensor([row[:length]]), None)
    sparse = LoopStopper(0, n=4, window=10)
    for length in range(3, 121, 7):
        sparse(torch.tensor([row[:length]]), None)
    sparse(torch.tensor([row]), None)
    assert sparse.stopped_at == every.stopped_at and every.stopped_at[0] is not None
    with pytest.raises(ValueError, match="window=0"):
        LoopStopper(0, n=8, window=0)
