"""Where the shipped configs live: ``configs/`` of the checkout, or the copy inside an installed wheel.

The repository keeps ``configs/`` at its top level; the wheel carries the same folder as package
data at ``medusa_train/configs/`` (see ``pyproject.toml``), so an installed package composes the
training config and finds the built-in trees wherever it runs.
"""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]


def _config_dir() -> Path:
    installed = _PACKAGE / "configs"  # inside a wheel
    return installed if installed.is_dir() else _PACKAGE.parent / "configs"  # a checkout


CONFIG_DIR: Path = _config_dir()
COMMANDS_DIR: Path = CONFIG_DIR / "commands"  # every command but train and capture: a config root of its own
TREE_DIR: Path = CONFIG_DIR / "tree"  # built-in trees: tree=default | chain | small


def heads_name(heads: str) -> str:
    """What a run's outputs about exported heads are named by: the heads folder's name, or its run's name for
    ``<run>/export`` (``outputs/eval/<name>``, ``outputs/trees/<name>-n<nodes>.yaml``)."""
    path = Path(heads).expanduser().resolve()
    return path.parent.name if path.name == "export" and path.parent.name else path.name


def unwritable(folder: str | os.PathLike) -> Path | None:
    """Where writing into ``folder`` (made if absent) would fail: its nearest existing folder or parent when that
    cannot be written, or is a file; ``None`` when the write can start. Commands check it before any work."""
    folder = Path(folder).expanduser().absolute()
    nearest = next(p for p in (folder, *folder.parents) if p.exists())
    return None if nearest.is_dir() and os.access(nearest, os.W_OK | os.X_OK) else nearest


#: ``heads=``: the name ``draft=`` had before EAGLE-3 drafts existed, kept as an alias on every command that reads a draft
DRAFT_ALIAS = "heads"


def take_draft_alias(c) -> list[str]:
    """Fold ``heads=`` (``DRAFT_ALIAS``) into ``draft=`` on command config ``c`` (a draft folder: exported Medusa heads
    or an EAGLE-3 draft); a problem naming both when they disagree."""
    alias = getattr(c, DRAFT_ALIAS)
    if alias is not None:
        if c.draft is not None and c.draft != alias:
            return [f"{DRAFT_ALIAS}={alias} and draft={c.draft}: {DRAFT_ALIAS}= is draft='s other name; give one"]
        c.draft = alias
        setattr(c, DRAFT_ALIAS, None)
    return []
