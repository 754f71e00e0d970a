"""One config-check helper for every command: typed parsing plus every problem at once, each with its key.

Hydra composes YAML into a plain mapping; ``parse_config`` turns it into a command's dataclasses and
reports every problem at once (``heads.num_heads=0: must be >= 1``). A command's own checks are a
function ``config -> list[str]``, written with ``Problems``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any


class ConfigError(ValueError):
    """One or more invalid config values; ``problems`` lists them, each naming its key."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


class FileProblem(ValueError):
    """A file a command reads or writes is unusable (corrupt, not ours, missing a key, read-only): one line naming the
    file (and key), said before the work it would spoil; ``cli/entry.py`` prints it and exits 2, no traceback."""


class Problems(list):
    """Problems found so far; ``need(ok, key, value, rule)`` adds ``"key=value: rule"`` when ``ok`` is false."""

    def need(self, ok: bool, key: str, value, rule: str) -> None:
        if not ok:
            self.append(f"{key}={value!r}: {rule}")


def parse_config(cls, raw: Any, check_fn):
    """A validated ``cls`` (a config dataclass) from a Hydra ``DictConfig`` or a plain dict.

    Unknown keys and wrong types are collected first, then ``check_fn(config)`` adds range and
    consistency problems; every problem is reported at once.

    Raises:
        ConfigError: listing each problem with the key to change.
    """
    from omegaconf import DictConfig, OmegaConf

    if isinstance(raw, DictConfig):
        raw = OmegaConf.to_container(raw, resolve=True)
    problems: list[str] = []
    config = _build(cls, dict(raw or {}), "", problems)
    problems += check_fn(config)
    if problems:
        raise ConfigError(problems)
    return config


def _build(cls, raw: dict, prefix: str, problems: list[str]):
    if not isinstance(raw, dict):
        problems.append(f"{prefix.rstrip('.')}={raw!r}: must be a mapping")
        return cls()
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    problems += [f"{prefix}{key}: unknown key (known: {', '.join(sorted(names))})" for key in raw if key not in names]
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        kind, value, key = hints[f.name], raw[f.name], prefix + f.name
        sub = _dataclass_in(kind)
        if sub is not None:
            values[f.name] = None if value is None and _optional(kind) else _build(sub, value, key + ".", problems)
        else:
            coerced = _coerce(kind, value, key, problems)
            if coerced is not _INVALID:  # an invalid value keeps the default so range checks still run
                values[f.name] = coerced
    return cls(**values)


_INVALID = object()


def _dataclass_in(kind):
    for option in typing.get_args(kind) or (kind,):
        if dataclasses.is_dataclass(option):
            return option
    return None


def _optional(kind) -> bool:
    return type(None) in typing.get_args(kind)


def _coerce(kind, value, key: str, problems: list[str]):
    options = typing.get_args(kind) if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union \
        else (kind,)
    if value is None:
        if type(None) in options:
            return None
        problems.append(f"{key}=null: a value is required")
        return _INVALID
    for option in options:
        origin = typing.get_origin(option) or option
        if origin is bool and isinstance(value, bool):
            return value
        if origin is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if origin is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if origin is str and isinstance(value, str):
            return value
        if origin is list and isinstance(value, (list, tuple)):
            return list(value)
    names = " | ".join("null" if o is type(None) else getattr(typing.get_origin(o) or o, "__name__", str(o))
                       for o in options)
    problems.append(f"{key}={value!r}: expected {names}")
    return _INVALID




DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".arrow")


def looks_like_path(source: str) -> bool:
    """True unless ``source`` could be a hub id (``name`` or ``owner/name``, no file suffix)."""
    import os.path

    return (source.startswith((".", "/", "~")) or source.count("/") > 1 or "\\" in source
            or os.path.splitext(source)[1].lower() in DATA_SUFFIXES)


def data_source_problem(key: str, source: str | None) -> str | None:
    """Why ``source`` (a conversation source) cannot be read, checked before anything loads; ``None`` if it can
    (or if only loading can tell: a ``packaged:`` name, a hub dataset id)."""
    import os

    if not source or source.startswith("packaged:") or not looks_like_path(source):
        return None
    path = os.path.expanduser(source)
    fix = "point it at a .json/.jsonl file of ShareGPT or messages records (or a folder / .parquet / .csv of them)"
    if not os.path.exists(path):
        return f"{key}={source!r}: no such file or directory ({os.path.abspath(path)}): {fix}"
    if not os.access(path, os.R_OK) or (os.path.isdir(path) and not os.access(path, os.X_OK)):
        return f"{key}={source!r}: not readable by this user ({os.path.abspath(path)}): fix its permissions"
    return None


def one_of(names) -> str:
    """``must be a, b or c``: the names there are, for a message."""
    names = list(names)
    return "must be " + (", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0])


def table_row(table: dict, name: str, key: str):
    """``table[name]`` of a registry (methods, families), or a ``ValueError`` naming ``key`` and the names there are."""
    if name not in table:
        raise ValueError(f"{key}={name!r}: {one_of(table)}")
    return table[name]
