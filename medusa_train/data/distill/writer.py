"""The resumable output files: an append-only jsonl per kind of line, their sidecars, and the resume checks.

``X.jsonl`` holds the records and ``X.skipped.jsonl`` the skips, one ``id`` per line, appended and
fsynced one conversation at a time; a line torn by a kill is dropped when the file is opened again.
``X.stats.json`` is written first with the record settings and rewritten with the counts at the end; it is
also the proof that the other two are ours (``ownership_problem``): an existing output is continued, and a torn line
cut, only when its stats file says medusa-train distill wrote it, checked before any byte changes. Resuming an output
made with other record settings, or from another source, is refused; a refused run removes the empty files it made.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from pathlib import Path

from medusa_train.config.check import ConfigError
from medusa_train.config.distill import DistillConfig, record_settings
from medusa_train.config.paths import unwritable

WRITTEN_BY = "medusa-train distill"  #: the stats file's mark: the output beside it is ours


class JsonlAppender:
    """An append-only jsonl with one ``id`` per line; a torn last line (from a kill) is dropped on open.

    Opened only on a path that is ours or new (``ownership_problem``); a file it created and left empty is removed
    when the run fails (``__exit__``), so a refusal leaves nothing behind."""

    def __init__(self, path: Path):
        self.path = path
        self.lines: list[dict] = []
        self.dropped_torn_line = False
        path.parent.mkdir(parents=True, exist_ok=True)
        self.created = not path.exists()
        self.file = open(path, "ab")  # O_APPEND: every write lands at the end

    def lock(self) -> None:
        """Refuse a second process writing the same file (released by the OS even on SIGKILL)."""
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            raise RuntimeError(f"output={self.path}: another distill process is writing it") from err

    def recover(self) -> None:
        """Read the finished lines; truncate a last line that has no newline or is not valid JSON."""
        data = self.path.read_bytes()
        keep = data.rfind(b"\n") + 1
        lines = data[:keep].splitlines()
        if lines:
            try:
                json.loads(lines[-1])
            except json.JSONDecodeError:  # a torn line that happened to end at a newline byte
                keep -= len(lines.pop()) + 1
        if keep < len(data):
            os.truncate(self.path, keep)
            self.dropped_torn_line = True
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"output={self.path}: line {number} is not JSON; not a distill output?") from err
            if not isinstance(record, dict) or "id" not in record:
                raise ValueError(f"output={self.path}: line {number} has no id; not a distill output?")
            self.lines.append(record)

    def append(self, record: dict) -> None:
        self.file.write((json.dumps(record, ensure_ascii=False) + "\n").encode())
        self.file.flush()
        os.fsync(self.file.fileno())
        self.lines.append(record)

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.close()
        if exc_type is not None and self.created and self.path.stat().st_size == 0:
            self.path.unlink()  # made by this run, which failed before writing a line: nothing of it is kept


def default_output(cfg: DistillConfig) -> Path:
    """``outputs/distill/<model label>-<num_prompts>.jsonl``."""
    name = str(cfg.model.name_or_path)
    label = name.split(":", 1)[1] if name.startswith("packaged:") else Path(name.rstrip("/")).name
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", label.removesuffix(".gguf")) or "model"
    return Path("outputs/distill") / f"{label}-{cfg.num_prompts or 'all'}.jsonl"


def sidecar(output: Path, suffix: str) -> Path:
    """``X.jsonl`` -> ``X<suffix>`` (``.skipped.jsonl``, ``.stats.json``)."""
    return output.with_name(output.name.removesuffix(".jsonl") + suffix)


def written_by_distill(stats_path: Path) -> bool:
    """Whether ``stats_path`` is a stats file medusa-train distill wrote (its mark, or the record settings every
    version wrote)."""
    try:
        stats = json.loads(stats_path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(stats, dict) and (stats.get("written_by") == WRITTEN_BY
                                        or isinstance(stats.get("record_settings"), dict))


def ownership_problem(output: Path) -> str | None:
    """Why distill must not write ``output`` and its sidecars (``None``: it may): one of them holds something and the
    stats file does not say distill wrote them. Checked before anything is opened, truncated or written."""
    stats = sidecar(output, ".stats.json")
    if blocked := unwritable(output.parent):
        return f"output={output}: {blocked} cannot be written; choose another output="
    if written_by_distill(stats):
        return None
    held = [p for p in (output, sidecar(output, ".skipped.jsonl"), stats)
            if p.exists() and (not p.is_file() or p.stat().st_size > 0)]
    if not held:
        return None
    names = ", ".join(p.name for p in held)
    return (f"output={output}: {names} {'exists' if len(held) == 1 else 'exist'} and {stats.name} does not say "
            "medusa-train distill wrote it; nothing was changed: choose another output= (or move the file away)")


def check_same_settings(stats_path: Path, cfg: DistillConfig) -> None:
    """Refuse to continue an output whose saved record settings differ from ``cfg``'s (``ConfigError``)."""
    if not stats_path.exists():
        return
    before = json.loads(stats_path.read_text()).get("record_settings", {})
    now = record_settings(cfg)
    changed = [f"{k}: {before[k]!r} -> {now[k]!r}" for k in now if k in before and before[k] != now[k]]
    if changed:
        raise ConfigError([f"output={cfg.output}: it was made with other settings ({'; '.join(changed)}); "
                           "delete it or write to another output="])


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` to a temporary name, then rename it into place (a crash never leaves half a file)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    os.replace(partial, path)


def check_ids(lines: list[dict], known_ids: dict[int, str], path: Path) -> None:
    """Refuse lines whose ids are not distill ids, or belong to another source than ``known_ids``."""
    for record in lines:
        prefix = str(record["id"]).split("-", 1)[0]
        if not prefix.isdigit():
            raise ValueError(f"output={path}: id {record['id']!r} is not a distill id; not a distill output?")
        index = int(prefix)
        if index in known_ids and known_ids[index] != record["id"]:
            raise ValueError(f"output={path}: record {record['id']} does not match conversation {index} of the "
                             f"source ({known_ids[index]}); it was made from another source. Delete it or set output=")
