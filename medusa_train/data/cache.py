"""Tokenised once: a source's train and held-out examples, in Arrow on disk, reused by every process and run.

``tokenized_splits`` keys a folder under ``$MEDUSA_TRAIN_CACHE/tokenized`` by everything that makes the
examples: the tokenizer (its whole definition, not its name), the chat template, the source's fingerprint
(path, size and modification time of each file; the name of a hub dataset), ``max_length`` and the split
settings (``max_samples``, ``eval_size``, ``seed``). The first call reads the conversations, splits them,
and tokenises both splits with ``datasets.map`` over several processes; the folder is written under a
temporary name and renamed into place, so a crash leaves no half cache. Every later call (another rank,
a restart, the next run) memory-maps it: examples live in Arrow (``input_ids``, ``labels`` as int32 and a
``length`` column), not in Python lists.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from medusa_train.data.sources import NORMALISED_FORMAT_VERSION, SkipStats, load_conversations
from medusa_train.data.usable import check_selected, check_tokenized, split_notes

CACHE_FORMAT = 2  # bump when what a cached example holds, or how it is made, changes
SPLITS = ("train", "eval")
CONVERSATIONS_PER_PROCESS = 1000  # below this, one process tokenises faster than starting more


@dataclass
class TokenizedData:
    """The two splits (``datasets.Dataset``: ``input_ids``, ``labels``, ``length``), their counts, and where and
    how they came: ``from_cache`` (an earlier run made them), ``seconds`` (reading and tokenising, or loading)."""

    train: Any
    evals: Any
    stats: SkipStats
    selected: int  #: conversations read and selected (after max_samples), before tokenising skipped any
    folder: Path
    from_cache: bool
    seconds: float
    notes: list[str] = field(default_factory=list)  #: log lines for a run with no evaluation, saying why


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A digest of what decides the tokens: the tokenizer's whole definition, its special tokens, its template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    extra = json.dumps([str(tokenizer.special_tokens_map), getattr(tokenizer, "chat_template", None)], sort_keys=True)
    return hashlib.sha256((body + extra).encode()).hexdigest()


def source_fingerprint(source: str) -> dict:
    """What identifies the source's content: each file's path, size and modification time (a hub id: its name)."""
    from medusa_train.backbone.assets import is_packaged, packaged_data_file

    if is_packaged(source):
        files = [packaged_data_file(source)]
    else:
        path = Path(source).expanduser()
        if not path.exists():
            return {"source": source}  # a hub dataset id: datasets keys its own download
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return {"source": source, "normalised": NORMALISED_FORMAT_VERSION,
            "files": [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]}


def cache_key(tokenizer: Any, source: str, max_length: int, max_samples: int | None, eval_size: int | float,
              seed: int, held_out: frozenset[str] = frozenset()) -> str:
    from medusa_train.data.held_out import keys_digest

    parts = {"format": CACHE_FORMAT, "tokenizer": tokenizer_fingerprint(tokenizer), "source": source_fingerprint(source),
             "max_length": max_length, "max_samples": max_samples, "eval_size": eval_size, "seed": seed}
    if held_out:
        parts["held_out"] = keys_digest(held_out)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def default_cache_root() -> Path:
    from medusa_train.backbone import assets

    return assets.cache_dir() / "tokenized"


def _tokenize_rows(rows: dict, tokenizer: Any, max_length: int, support: dict) -> dict:
    """``datasets.map`` function: JSON conversations -> input_ids, labels, length, skip reason, truncated."""
    from medusa_train.data.tokenize import tokenize_batch

    results = tokenize_batch(tokenizer, [json.loads(m) for m in rows["messages"]], max_length, support)
    out: dict[str, list] = {"input_ids": [], "labels": [], "length": [], "skip": [], "truncated": []}
    for result in results:
        example = result if isinstance(result, dict) else {"input_ids": [], "labels": [], "truncated": False}
        out["input_ids"].append(example["input_ids"])
        out["labels"].append(example["labels"])
        out["length"].append(len(example["input_ids"]))
        out["skip"].append(result if isinstance(result, str) else "")
        out["truncated"].append(example["truncated"])
    return out


def _tokenize_split(tokenizer: Any, conversations: list, max_length: int, support: dict, num_proc: int,
                    target: Path, stats: SkipStats, desc: str) -> int:
    """Tokenise one split into ``target`` (``save_to_disk``), counting skips and truncations in ``stats``; the
    number of examples kept."""
    import datasets

    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32")),
                                  "labels": datasets.Sequence(datasets.Value("int32")),
                                  "length": datasets.Value("int32"), "skip": datasets.Value("string"),
                                  "truncated": datasets.Value("bool")})
    if not conversations:  # data.eval_size=0: an empty split (datasets.map of no rows returns no columns)
        empty = datasets.Dataset.from_dict({name: [] for name in features}, features=features)
        _save(empty.remove_columns(["skip", "truncated"]), target)
        return 0
    rows = datasets.Dataset.from_dict({"messages": [json.dumps(c, ensure_ascii=False) for c in conversations]})
    procs = max(1, min(num_proc, len(conversations) // CONVERSATIONS_PER_PROCESS))
    scratch = target.with_name(f"{target.name}.map")
    scratch.mkdir(parents=True, exist_ok=True)
    done = rows.map(_tokenize_rows, batched=True, batch_size=256, num_proc=procs if procs > 1 else None,
                    remove_columns=["messages"], features=features, desc=desc,
                    fn_kwargs={"tokenizer": tokenizer, "max_length": max_length, "support": support},
                    cache_file_name=str(scratch / "rows.arrow"), new_fingerprint=f"medusa-{target.name}")
    skips, truncated = done["skip"], done["truncated"]
    kept = [i for i, reason in enumerate(skips) if not reason]
    for reason in skips:
        if reason:
            stats.skip(reason)
            stats.kept -= 1
    stats.truncated += sum(1 for i in kept if truncated[i])
    _save(done.select(kept).remove_columns(["skip", "truncated"]), target)
    del done
    shutil.rmtree(scratch, ignore_errors=True)
    return len(kept)


def _save(dataset: Any, target: Path) -> None:
    """``save_to_disk``; an empty split in one (empty) shard, as ``load_from_disk`` cannot read zero shards."""
    dataset.save_to_disk(str(target), num_shards=None if len(dataset) else 1)


def default_num_proc() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def tokenized_splits(tokenizer: Any, source: str, max_length: int, max_samples: int | None = None,
                     eval_size: int | float = 0.01, seed: int = 0, num_proc: int | None = None,
                     cache_root: str | os.PathLike | None = None,
                     held_out: frozenset[str] = frozenset()) -> TokenizedData:
    """The tokenised train / held-out examples of ``source``, made once and read from disk afterwards.

    Args:
        tokenizer: a fast tokenizer with a chat template (set ``tokenizer.chat_template`` before, to override it).
        source, max_length, max_samples, eval_size, seed: as :func:`~medusa_train.data.batching.build_datasets`.
        num_proc: tokenising processes (default: the CPUs, at most 8; one below 1,000 conversations a split).
        cache_root: where the folders go (default ``$MEDUSA_TRAIN_CACHE/tokenized``).
        held_out: normalised prompts (``data.validation.held_out``): every conversation with a user turn among them
            is removed before the split, counted in ``stats`` as skipped for ``validation_prompt``.

    Returns:
        A :class:`TokenizedData`; ``stats.kept == len(train) + len(evals)``; ``len(train) >= 1``.

    Raises:
        ConfigError: before tokenising, a source with no usable conversation (empty, or every record skipped:
            the error names ``data.source`` and the skips by reason) or a ``data.eval_size`` that holds out every
            conversation; after it, no training example left. ``eval_size=0`` is not refused: every
            conversation trains, no evaluation runs, and ``notes`` says so (see ``usable.py``).
    """
    import datasets

    from medusa_train.data.batching import split_indices
    from medusa_train.data.tokenize import template_support

    if max_length < 1:
        raise ValueError(f"data.max_length={max_length}: must be >= 1")
    started = time.perf_counter()
    root = Path(cache_root) if cache_root else default_cache_root()
    folder = root / cache_key(tokenizer, source, max_length, max_samples, eval_size, seed, held_out)
    from_cache = (folder / "stats.json").is_file()
    if not from_cache:
        conversations, stats = load_conversations(source, max_samples=max_samples)
        if held_out:
            from medusa_train.data.held_out import holds_out

            kept = [c for c in conversations if not holds_out(c, held_out)]
            if len(kept) < len(conversations):
                stats.skip("validation_prompt", len(conversations) - len(kept))
                stats.kept -= len(conversations) - len(kept)
            conversations = kept
        selected = len(conversations)
        check_selected(source, stats, selected, eval_size, max_samples)
        indices = dict(zip(SPLITS, split_indices(len(conversations), eval_size, seed)))
        support = template_support(tokenizer)
        partial = folder.with_name(f".{folder.name}.{os.getpid()}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        try:
            kept = [_tokenize_split(tokenizer, [conversations[i] for i in indices[split]], max_length, support,
                                    num_proc or default_num_proc(), partial / split, stats, f"tokenizing {split}")
                    for split in SPLITS]
            del conversations
            check_tokenized(source, stats, *kept, eval_size)  # nothing useless is cached
            (partial / "stats.json").write_text(json.dumps({
                "stats": stats.to_dict(), "selected": selected, "source": source, "max_length": max_length, "max_samples": max_samples,
                "eval_size": eval_size, "seed": seed, "tokenizer": getattr(tokenizer, "name_or_path", ""),
                "seconds": round(time.perf_counter() - started, 2)}, indent=2) + "\n")
            try:
                os.rename(partial, folder)
            except OSError:  # another process (another node's first rank) finished first: use its folder
                if not (folder / "stats.json").is_file():
                    raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    recorded = json.loads((folder / "stats.json").read_text())
    train, evals = (datasets.load_from_disk(str(folder / split)) for split in SPLITS)
    return TokenizedData(train, evals, SkipStats.from_dict(recorded["stats"]), recorded["selected"], folder,
                         from_cache, time.perf_counter() - started, split_notes(eval_size, len(train), len(evals)))
