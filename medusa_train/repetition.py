"""Repetition in generated text: how much of a reply repeats itself, and where an endless loop begins.

Greedy decoding of a small model often falls into a loop: a sentence or a list item comes back
again and again until ``max_new_tokens``. Self-distillation must not train heads on that, and
should not spend its generation time on it either:

- ``repeated_fraction`` scores a finished reply (share of tokens covered by n-grams seen earlier);
- ``loop_start`` finds a *sustained* loop (the last ``window`` n-grams all repeat earlier ones)
  and returns where it begins: the text before it said everything once;
- ``LoopStopper`` is a ``transformers`` stopping criterion that ends each batch row as soon as
  its loop is sustained, so a batch is not held up by rows that can only loop.

A row stopped by ``LoopStopper`` satisfies ``loop_start(row, n, window) is not None``: both use
the same definition, one incrementally and one on the whole reply.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def repeated_grams(tokens: Sequence[int], n: int) -> list[bool]:
    """``flags[i]`` is True when ``tokens[i:i + n]`` already occurred at an earlier position."""
    seen: set[tuple[int, ...]] = set()
    flags = []
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        flags.append(gram in seen)
        seen.add(gram)
    return flags


def repeated_fraction(tokens: Sequence[int], n: int) -> float:
    """Share of ``tokens`` covered by n-grams that already occurred earlier in the same sequence.

    A reply stuck in a loop of period ``p`` scores about ``1 - (start + p) / len``; ordinary text
    repeats few 8-grams.
    """
    if len(tokens) < 2 * n:
        return 0.0
    covered = covered_until = 0
    for i, repeated in enumerate(repeated_grams(tokens, n)):
        if repeated:
            covered += i + n - max(i, covered_until)
            covered_until = i + n
    return covered / len(tokens)


def loop_start(tokens: Sequence[int], n: int, window: int) -> int | None:
    """Where a sustained loop begins, or ``None`` when the reply does not end in one.

    The loop is sustained when the last ``window`` (or more) n-grams of ``tokens`` all occurred
    earlier. The returned index is the first n-gram of that final run of repeats, so
    ``tokens[:index]`` holds the looping text once, and everything after repeats it.
    """
    flags = repeated_grams(tokens, n)
    run = 0
    for repeated in reversed(flags):
        if not repeated:
            break
        run += 1
    return len(flags) - run if run >= window else None


class LoopStopper:
    """Stopping criterion: a row stops once its last ``window`` generated n-grams all repeat earlier ones.

    Pass it in ``stopping_criteria`` to ``model.generate``; it is stateful, so use one per call.
    Only generated tokens count (columns from ``prompt_length`` on). ``stopped_at[r]`` is the
    number of generated tokens row ``r`` had when it was stopped (``None``: never stopped); the
    columns after it are padding.
    """

    def __init__(self, prompt_length: int, n: int, window: int):
        if n < 1 or window < 1:
            raise ValueError(f"n={n}, window={window}: both must be >= 1")
        self.prompt_length, self.n, self.window = prompt_length, n, window
        self.seen: list[set[tuple[int, ...]]] = []
        self.run: list[int] = []
        self.stopped_at: list[int | None] = []
        self.checked = 0  # generated columns already read

    def __call__(self, input_ids: torch.LongTensor, scores=None, **kwargs) -> torch.BoolTensor:
        rows, generated = input_ids.shape[0], input_ids.shape[1] - self.prompt_length
        if not self.seen:
            self.seen, self.run, self.stopped_at = [set() for _ in range(rows)], [0] * rows, [None] * rows
        gen = input_ids[:, self.prompt_length:]
        for end in range(max(self.checked, self.n - 1) + 1, generated + 1):  # n-grams gen[:, end - n:end]
            for r, gram in enumerate(map(tuple, gen[:, end - self.n:end].tolist())):
                self.run[r] = self.run[r] + 1 if gram in self.seen[r] else 0
                self.seen[r].add(gram)
                if self.run[r] >= self.window and self.stopped_at[r] is None:
                    self.stopped_at[r] = end
        self.checked = max(self.checked, generated)
        return torch.tensor([at is not None for at in self.stopped_at], dtype=torch.bool, device=input_ids.device)
