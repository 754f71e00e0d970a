"""Held-out prompts by normalised text: what leaves the training data (``data/validation.py`` draws them;
``data/cache.py`` removes every conversation holding one)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from medusa_train.data.benchmarks import normalise_prompt


def held_out(prompts: Iterable[str]) -> frozenset[str]:
    """The normalised texts of ``prompts``: a conversation with a user turn among them is held out."""
    return frozenset(normalise_prompt(p) for p in prompts)


def holds_out(conversation: Sequence[dict], keys: frozenset[str]) -> bool:
    """Whether ``conversation`` has a user turn among the held-out ``keys``."""
    return any(m.get("role") == "user" and isinstance(m.get("content"), str) and normalise_prompt(m["content"]) in keys
               for m in conversation)


def keys_digest(keys: frozenset[str]) -> str:
    return hashlib.sha256("\n".join(sorted(keys)).encode()).hexdigest()[:16]
