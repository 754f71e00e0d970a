"""A draft folder's files as every family names and reads them: ``config.json`` (the one reader of it, which tells
the family and layout apart: ``model/family.py``), ``model.safetensors``, the strict check of what a file holds, and
the backbone a folder names."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from medusa_train.config.check import FileProblem

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


def check_tensors(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...] | None],
                  source: str) -> None:
    """Raise one ``ValueError`` naming every missing, unexpected or wrongly shaped tensor.

    Args:
        tensors: What the file holds.
        expected: Every name the layout requires, with its shape (``None``: any shape).
        source: Where the tensors came from, for the message.
    """
    missing = [k for k in expected if k not in tensors]
    unexpected = sorted(k for k in tensors if k not in expected)
    wrong = [f"{k}: file {tuple(tensors[k].shape)} vs config {tuple(shape)}" for k, shape in expected.items()
             if k in tensors and shape is not None and tuple(tensors[k].shape) != tuple(shape)]
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    if wrong:
        problems.append(f"wrong shapes: {'; '.join(wrong)}")
    if problems:
        raise ValueError(f"heads in {source} do not match their config.json ({'; '.join(problems)})")


def read_config_json(directory: str | os.PathLike) -> dict:
    """A heads folder's ``config.json`` as stored (any layout): the one reader of it.

    Raises:
        FileNotFoundError: no ``config.json``.
        FileProblem: it is not a JSON object (a ``ValueError``).
    """
    directory = Path(directory)
    config_path = directory / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: is {directory} a folder of exported heads?")
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, OSError) as err:  # not JSON, not UTF-8, unreadable
        raise FileProblem(f"{config_path}: cannot be read as JSON ({err}); export the draft again") from err
    if not isinstance(config, dict):
        raise FileProblem(f"{config_path}: holds {type(config).__name__}, not a JSON object; export the draft again")
    return config


def resolve_base_model(directory: str | os.PathLike, base: str | None) -> str | None:
    """The heads' base model as a loadable reference: a relative folder beside the heads (Medusa-2's
    ``merged``) becomes its path; anything else (hub id, absolute path, ``packaged:``) is kept."""
    if base and not Path(base).is_absolute() and (Path(directory) / base / "config.json").is_file():
        return str(Path(directory) / base)
    return base
