"""Which generated replies are not trained on: empty, stuck in a loop, or cut off by the length limit."""

from __future__ import annotations

from collections.abc import Sequence

from medusa_train.config.distill import FilterConfig
from medusa_train.data.distill.repetition import repeated_fraction


def degenerate_reason(text: str, tokens: Sequence[int], finished: bool, filters: FilterConfig,
                      looped: bool = False) -> str | None:
    """Why a reply should not be trained on (``empty``, ``repetition``, ``length``), or ``None``.

    ``looped``: generation was stopped in a sustained loop; ``tokens`` then end where it began
    (kept with ``filters.trim_loops``, else the reply counts as ``repetition``).
    """
    if not text.strip():
        return "empty"
    if looped and not filters.trim_loops:
        return "repetition"
    if filters.max_repeated_fraction is not None and \
            repeated_fraction(tokens, filters.repetition_ngram) >= filters.max_repeated_fraction:
        return "repetition"
    if not finished and not looped and filters.skip_truncated:
        return "length"
    return None
