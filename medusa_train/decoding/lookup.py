"""Context lookup: guess what follows the text so far from what followed its last n tokens before.

The drafter of prompt-lookup and n-gram speculation, kept as an index updated as tokens arrive: every
n-gram (``min_ngram <= n <= max_ngram``) that already has a token after it maps to the position of that
token in its most recent occurrence. A proposal tries the context's last ``max_ngram`` tokens first, then
shorter suffixes, and returns up to ``length`` tokens that followed the match. Each token added costs
``max_ngram - min_ngram + 1`` dictionary writes and each proposal as many reads: the time per step does not
grow with the context (no rescan of the prompt and the text generated so far).
"""

from __future__ import annotations

from collections.abc import Iterable


class LookupChain:
    """The context (prompt and generated tokens) and its n-gram index.

    Args:
        max_ngram: The longest suffix matched (tried first).
        min_ngram: The shortest suffix matched.
        tokens: The context so far (e.g. the prompt).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, tokens: Iterable[int] = ()):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"lookup n-gram sizes min={min_ngram}, max={max_ngram}: need 1 <= min <= max")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        # per n, n-gram -> the position right after its most recent occurrence that has a token after it
        self._after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the context: the n-grams each new token follows become findable."""
        for token in tokens:
            self.tokens.append(int(token))
            follows = len(self.tokens) - 1  # the new token's position: it follows the n-grams ending just before
            for n, index in self._after.items():
                if follows >= n:
                    index[tuple(self.tokens[follows - n:follows])] = follows

    def propose(self, length: int) -> list[int]:
        """Up to ``length`` tokens that followed the most recent earlier occurrence of the context's longest
        matching suffix (``max_ngram`` tokens down to ``min_ngram``); ``[]`` when none occurred before."""
        if length <= 0:
            return []
        for n in range(min(self.max_ngram, len(self.tokens)), self.min_ngram - 1, -1):
            start = self._after[n].get(tuple(self.tokens[len(self.tokens) - n:]))
            if start is not None:
                return self.tokens[start:start + length]
        return []

    def __len__(self) -> int:
        return len(self.tokens)
