"""Reading conversation records: ShareGPT and messages layouts, local files, hub ids, packaged data.

Every source ends up as a list of conversations, each a list of
``{"role": "system" | "user" | "assistant" | "tool", "content": str}`` (tool calls and tool names kept where
given), plus a :class:`SkipStats`
that says how many records were kept and why the others were dropped.

``packaged:sharegpt-v3`` is a top-level JSON array cut off mid-string, so ``json.load``
fails on it. It is read item by item once, normalised, and written to a jsonl beside the
packaged file (temporary name, then ``os.replace``); later loads read that jsonl.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from medusa_train.backbone.assets import is_packaged, packaged_data_file
from medusa_train.config.check import ConfigError, looks_like_path
from medusa_train.data.records import Conversation, Skip, normalise_record

# Packaged sources that hold conversations (packaged:mt-bench holds questions, not conversations).
CONVERSATION_PACKAGES = ("packaged:sharegpt-v3",)

# Bump when the normalisation rules change, so stale converted files are not reused.
NORMALISED_FORMAT_VERSION = 2

# Local files read through datasets.load_dataset; any other file is read here as JSON / JSON lines.
DATASETS_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}

_SEPARATOR = re.compile(r"[\s,]*")  # whitespace and the commas between array items


@dataclass
class SkipStats:
    """Counts of records kept, left out by ``max_samples`` and skipped, by reason.

    Reasons used: ``malformed`` (not JSON, or not a conversation record), ``not_utf8`` (a line or text that is
    not UTF-8: random bytes, another encoding), ``empty`` (no turn
    with text), ``unknown_role``, ``non_text_content`` (an image, audio or file part), ``no_assistant``
    (no assistant turn with text), ``truncated_source`` (a partial record at the end of a cut-off file),
    ``no_assistant_after_truncation`` (no assistant token left within ``max_length``),
    ``template_error`` (the chat template refused the conversation) and ``tool_turns_unsupported`` /
    ``tool_calls_unsupported`` (the chat template does not render tool results / tool calls).
    Invariant: ``kept + capped + total_skipped`` is the number of records read; ``truncated`` counts kept
    examples cut at ``max_length`` tokens.
    """

    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    capped: int = 0  #: usable conversations left out by ``max_samples``
    truncated: int = 0  #: kept examples cut at ``max_length`` tokens

    def skip(self, reason: str, count: int = 1) -> None:
        """Record ``count`` records dropped for ``reason``."""
        self.skipped[reason] += count

    @property
    def total_skipped(self) -> int:
        """Number of records dropped for any reason."""
        return sum(self.skipped.values())

    def summary(self) -> str:
        """One line, e.g. ``kept 17,545 conversations, skipped 126 (empty 126)``."""
        line = f"kept {self.kept:,} conversations, skipped {self.total_skipped:,}"
        if self.skipped:
            reasons = ", ".join(f"{reason} {n:,}" for reason, n in sorted(self.skipped.items()))
            line += f" ({reasons})"
        return line

    def to_dict(self) -> dict:
        return {"kept": self.kept, "skipped": dict(self.skipped), "capped": self.capped, "truncated": self.truncated}

    @classmethod
    def from_dict(cls, d: dict) -> SkipStats:
        return cls(d["kept"], Counter(d["skipped"]), d.get("capped", 0), d.get("truncated", 0))


def _collect(records: Iterable[Any], stats: SkipStats, max_samples: int | None) -> list[Conversation]:
    """Normalise ``records`` into conversations, counting skips; keep the first ``max_samples`` and count the
    rest as ``capped`` (they are read, so the log can say how many were left out)."""
    conversations: list[Conversation] = []
    for record in records:
        try:
            conversation = normalise_record(record)
        except Skip as skip:
            stats.skip(skip.reason)
            continue
        if max_samples is not None and len(conversations) >= max_samples:
            stats.capped += 1
            continue
        conversations.append(conversation)
        stats.kept += 1
    return conversations


class _Broken:
    """Stands for a record that could not be parsed (counted as ``malformed``, ``not_utf8`` or ``truncated_source``)."""

    def __init__(self, reason: str):
        self.reason = reason


def _iter_jsonl(path: Path) -> Iterator[Any]:
    """Records of a JSON-lines file, read as bytes: a line that is not UTF-8 yields ``_Broken("not_utf8")``, one
    that is not valid JSON ``_Broken("malformed")``; neither stops the reading."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f):
            try:
                line = raw.decode("utf-8-sig" if number == 0 else "utf-8")
            except UnicodeDecodeError:
                yield _Broken("not_utf8")
                continue
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except (ValueError, RecursionError):  # JSONDecodeError, or nesting too deep to parse
                yield _Broken("malformed")


def _iter_json_array(text: str) -> Iterator[Any]:
    """Items of a top-level JSON array, one by one; a cut-off tail yields ``_Broken("truncated_source")``.

    A syntax error stops the reading (the array cannot be re-synchronised): whatever follows it
    counts as one truncated record.
    """
    decoder = json.JSONDecoder()
    pos = _SEPARATOR.match(text, text.index("[") + 1).end()
    while pos < len(text) and text[pos] != "]":
        try:
            item, end = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):  # JSONDecodeError, or nesting too deep to parse
            yield _Broken("truncated_source")
            return
        yield item
        pos = _SEPARATOR.match(text, end).end()
    if pos >= len(text):  # no closing bracket: the file was cut right after an item
        yield _Broken("truncated_source")


def _iter_json_file(path: Path) -> Iterator[Any]:
    """Records of a ``.json`` file: a (possibly truncated) array, a single object, or JSON lines."""
    # Bytes that are not UTF-8 become lone surrogates, so an item holding them is skipped as ``not_utf8``
    # (normalise_record) instead of the whole file failing to decode.
    text = path.read_bytes().decode("utf-8-sig", errors="surrogateescape")
    if not text.lstrip().startswith("["):
        try:
            single = json.loads(text)
        except (ValueError, RecursionError):
            yield from _iter_jsonl(path)  # JSON lines under a .json name: line by line
            return
        yield single
        return
    yield from _iter_json_array(text)


def _unwrap(records: Iterable[Any], stats: SkipStats) -> Iterator[Any]:
    """Count ``_Broken`` placeholders as skips and pass real records through."""
    for record in records:
        if isinstance(record, _Broken):
            stats.skip(record.reason)
        else:
            yield record


def _is_offline() -> bool:
    truthy = {"1", "true", "yes", "on"}
    return any(os.environ.get(k, "").strip().lower() in truthy for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _load_with_datasets(source: str, local: bool) -> Iterator[Any]:
    """Records of a local directory / parquet / csv file, or of a hub dataset id, via ``datasets``."""
    import datasets  # heavy import: only when needed

    if local:
        path = Path(source)
        try:
            if path.is_dir():
                dataset = datasets.load_dataset(str(path), split="train")
            else:
                dataset = datasets.load_dataset(DATASETS_BUILDERS[path.suffix.lower()], data_files=str(path),
                                                split="train")
        except Exception as err:  # a broken parquet/csv/arrow file or folder: say which, with datasets' reason
            reason = (str(err).strip().splitlines() or [""])[0][:300]
            raise ConfigError([f"data.source={source!r}: could not be read as a dataset "
                               f"({type(err).__name__}: {reason}). Use a .json/.jsonl file of ShareGPT or messages "
                               "records, or a folder / .parquet / .csv file that datasets.load_dataset reads"]) from err
    else:
        offline_hint = (
            f"data.source={source!r} is not a local file, so it was taken as a hub dataset id. Point "
            "data.source at a local .json/.jsonl file of ShareGPT or messages records, or use packaged:sharegpt-v3."
        )
        if _is_offline():
            raise ConnectionError(f"{offline_hint} The hub is offline here (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE).")
        try:
            dataset = datasets.load_dataset(source, split="train")
        except (ConnectionError, OSError) as err:
            raise ConnectionError(f"{offline_hint} Loading it from the hub failed: {err}") from err
    yield from dataset


def normalised_cache_path(source_file: Path) -> Path:
    """Where the normalised jsonl of a packaged source file lives (beside it, in the cache)."""
    return source_file.with_name(f"{source_file.stem}.normalised-v{NORMALISED_FORMAT_VERSION}.jsonl")


def convert_to_normalised_jsonl(source_file: Path, target: Path) -> SkipStats:
    """Stream a (possibly truncated) JSON array of records into a normalised jsonl, atomically.

    Each line of ``target`` is either ``{"messages": [...]}`` or ``{"skipped": reason}``, in
    source order, so a later partial read (``max_samples``) still reports exact counts.

    Args:
        source_file: the JSON array (``packaged:sharegpt-v3`` is cut off mid-string).
        target: the jsonl to write; written to a temporary name, then renamed into place.

    Returns:
        The counts of the whole conversion.
    """
    stats = SkipStats()
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        with open(partial, "w", encoding="utf-8") as out:
            for record in _iter_json_file(source_file):
                try:
                    if isinstance(record, _Broken):
                        raise Skip(record.reason)
                    line = {"messages": normalise_record(record)}
                    stats.kept += 1
                except Skip as skip:
                    line = {"skipped": skip.reason}
                    stats.skip(skip.reason)
                out.write(json.dumps(line, ensure_ascii=False) + "\n")
        os.replace(partial, target)  # atomic: readers see no file or the whole file
    finally:
        partial.unlink(missing_ok=True)
    return stats


def _read_normalised(path: Path, stats: SkipStats, max_samples: int | None) -> list[Conversation]:
    conversations: list[Conversation] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith('{"skipped"'):
                stats.skip(json.loads(line)["skipped"])
            elif max_samples is not None and len(conversations) >= max_samples:
                stats.capped += 1  # counted, not parsed
            else:
                conversations.append(json.loads(line)["messages"])
                stats.kept += 1
    return conversations


def _load_packaged(source: str, max_samples: int | None) -> tuple[list[Conversation], SkipStats]:
    if source not in CONVERSATION_PACKAGES:
        raise ValueError(
            f"data.source={source!r} is not a packaged conversation set; use one of: "
            + ", ".join(CONVERSATION_PACKAGES)
        )
    source_file = packaged_data_file(source)
    cached = normalised_cache_path(source_file)
    if not cached.exists():
        convert_to_normalised_jsonl(source_file, cached)
    stats = SkipStats()
    return _read_normalised(cached, stats, max_samples), stats


def load_conversations(
    source: str | os.PathLike, max_samples: int | None = None
) -> tuple[list[Conversation], SkipStats]:
    """Read conversations from a local file, a hub dataset id or a packaged set.

    Records may be ShareGPT (``{"conversations": [{"from": "human"|"gpt"|..., "value"}]}``)
    or messages (``{"messages": [{"role", "content"}]}``). Local files (``.json``, ``.jsonl`` or any other name)
    are parsed here, record by record, so a line that is not UTF-8 (``not_utf8``) or not JSON (``malformed``),
    or a cut-off array, is a counted skip, never an exception; directories, ``.parquet`` / ``.csv`` / ``.arrow``
    files and hub ids go through ``datasets.load_dataset``. An empty result is not an error here
    (``usable.check_selected`` refuses it, naming the skips).

    Args:
        source: a path, a hub dataset id (online only), or ``packaged:sharegpt-v3``.
        max_samples: keep at most this many conversations (the first ones, in file order); the rest are
            still read and counted in ``stats.capped``.

    Returns:
        ``(conversations, stats)``; each conversation is a list of
        ``{"role": "system"|"user"|"assistant", "content": str}``.

    Raises:
        FileNotFoundError: ``source`` looks like a path and does not exist.
        ConfigError: a local folder / parquet / csv / arrow file that ``datasets`` cannot read.
        ConnectionError: ``source`` looks like a hub id and the hub cannot be reached.
        ValueError: an unknown ``packaged:`` name.
    """
    if is_packaged(source):
        return _load_packaged(source, max_samples)
    stats = SkipStats()
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".jsonl":
        records: Iterable[Any] = _iter_jsonl(path)
    elif path.is_file() and path.suffix.lower() not in DATASETS_BUILDERS:  # .json, or any other name: read as JSON
        records = _iter_json_file(path)
    elif path.exists():
        records = _load_with_datasets(str(path), local=True)
    elif looks_like_path(str(source)):
        raise FileNotFoundError(
            f"data.source={str(source)!r}: no such file or directory: {path.resolve()}. "
            "Set data.source to a .json/.jsonl file of ShareGPT or messages records, or packaged:sharegpt-v3."
        )
    else:
        records = _load_with_datasets(str(source), local=False)
    return _collect(_unwrap(records, stats), stats, max_samples), stats
