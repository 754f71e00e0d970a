"""Repetition in generated text: how much of a reply repeats itself, and where an endless loop begins.

Greedy decoding of a small model often falls into a loop: a sentence or a list item comes back
again and again until ``max_new_tokens``. Self-distillation must not train heads on that, and
should not spend its generation time on it either:

- ``repeated_fraction`` scores a finished reply (share of tokens covered by n-grams seen earlier);
- ``loop_start`` finds a *sustained* loop (the last ``window`` n-grams all repeat earlier ones)
  and returns where it begins: the text before it said everything once;
- ``LoopTracker`` follows a reply as it is generated and says when its loop is sustained, so
  generation can stop that reply there instead of looping on to ``max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence


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


class LoopTracker:
    """One reply's loop detector, fed a token at a time: ``push`` returns True once the loop is sustained.

    After ``push`` has returned True for the token that made the reply ``m`` tokens long,
    ``loop_start(tokens[:m], n, window)`` is not None and it was None for ``tokens[:m - 1]``:
    the same definition, computed incrementally (O(1) per token).
    """

    def __init__(self, n: int, window: int):
        if n < 1 or window < 1:
            raise ValueError(f"n={n}, window={window}: both must be >= 1")
        self.n, self.window = n, window
        self.tokens: list[int] = []
        self.seen: set[tuple[int, ...]] = set()
        self.run = 0  # trailing n-grams that all occurred earlier

    @property
    def loop_start(self) -> int:
        """Where the current run of repeated n-grams begins (``loop_start``'s answer once ``push`` said True)."""
        return max(len(self.tokens) - self.n + 1, 0) - self.run

    def push(self, token: int) -> bool:
        self.tokens.append(int(token))
        if len(self.tokens) >= self.n:
            gram = tuple(self.tokens[-self.n:])
            self.run = self.run + 1 if gram in self.seen else 0
            self.seen.add(gram)
        return self.run >= self.window
