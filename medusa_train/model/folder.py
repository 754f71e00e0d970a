"""Writing a heads folder, and what travels in it beside the heads: the chat template they were trained with.

Every writer of a heads folder (``MedusaModel.save_pretrained``, ``export.write``, a run's export in
``export/run.py``) goes through ``replace_folder``: the files are written to a temporary folder beside the
target, which is then renamed into place, replacing the previous one whole. Only a folder of our own is
replaced: an existing, non-empty target must hold a ``config.json`` of a draft we read (any layout of any family:
``family.family_of``) and nothing but the names our writers put there (``OUR_NAMES`` and each family's ``files``). Any other
file means the folder is someone else's, and the write is refused before anything is touched. A
``serving.json`` written by ``medusa-train choose-k`` into an export is carried over to the new one.

``chat_template.jinja`` (what Hugging Face tokenizers also save) holds the template of the run that trained the
heads: ``read_chat_template`` is the one reader of it (``model.load.load_exported_draft`` sets it on the tokenizer).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from medusa_train.backbone import assets
from medusa_train.backbone.chat_template import resolve_chat_template
from medusa_train.backbone.merge import ADAPTER_DIR, BACKBONE_INFO, MERGED_DIR
from medusa_train.config.paths import unwritable
from medusa_train.model.files import CONFIG_NAME, WEIGHTS_NAME

CHAT_TEMPLATE_NAME = "chat_template.jinja"
SERVING_NAME = "serving.json"  #: written into a vllm export by ``medusa-train choose-k`` (the measured K)
#: what a serving.json row served besides a free baseline's name (``ngram``, ``suffix``): no speculation, or the draft
PLAIN_SERVER, DRAFT_SERVER = "plain", "draft"
TRAINING_CONFIG_NAME = "training_config.json"  #: a run's export: the training config that made it
VALIDATION_FILE = "validation.json"  #: a run's export: the last validation walk's figures (training/validation_walk.py)
#: a run's record in its export, carried by a conversion of the folder (``export.write.export_folder``)
RECORD_NAMES = (TRAINING_CONFIG_NAME, VALIDATION_FILE)
#: Every name a writer of ours puts in any draft folder besides the family's own files (``Family.files``); a run's
#: export also holds the Medusa-2 backbone's files
OUR_NAMES = frozenset({CONFIG_NAME, WEIGHTS_NAME, CHAT_TEMPLATE_NAME, SERVING_NAME, TRAINING_CONFIG_NAME,
                       VALIDATION_FILE, BACKBONE_INFO, ADAPTER_DIR, MERGED_DIR})
KEPT_NAMES = (SERVING_NAME,)  #: written by another tool into our folder: carried over when it is replaced


# ---------------------------------------------------------------------------------- whose folder
def foreign_entries(directory: str | os.PathLike) -> list[str]:
    """What makes ``directory`` a folder we must not replace: ``[]`` when it is absent, empty, or ours.

    Ours: a ``config.json`` of a draft (any layout of any family) and nothing but ``OUR_NAMES`` and
    ``family_files()``.

    Returns:
        The entries that are not ours (sorted): every one when there is no draft's ``config.json``;
        ``[directory's name]`` when it is a file.
    """
    directory = Path(directory)
    if not directory.exists():
        return []
    if not directory.is_dir():
        return [directory.name]
    names = sorted(p.name for p in directory.iterdir())
    if names and not _is_draft_config(directory / CONFIG_NAME):
        return names  # not a heads folder: nothing in it is ours (a model's model.safetensors, say)
    ours = OUR_NAMES | family_files()
    return [name for name in names if name not in ours]


def output_problem(directory: str | os.PathLike, option: str | None = None) -> str | None:
    """Why ``directory`` cannot be replaced by a heads folder (``None``: it can), naming ``option``.

    Args:
        directory: The folder to write.
        option: The setting that names it (``output``, ``trainer.output_dir``), for the message.
    """
    directory = Path(directory)
    foreign = foreign_entries(directory)
    change = f"choose another {option}=" if option else "write to another folder"
    if not foreign:  # replaced through a temporary folder beside it: its parent must take one
        blocked = unwritable(directory.absolute().parent)
        return f"{directory}: {blocked} cannot be written; {change}" if blocked else None
    if not directory.is_dir():
        return f"{directory} is a file, not a folder: {change}"
    listed = ", ".join(foreign[:8]) + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else "")
    return (f"{directory} is not empty and holds files medusa-train did not write ({listed}); it is not "
            f"replaced, so that nothing of yours is deleted: {change}, or move those files out")


def check_output(directory: str | os.PathLike, option: str | None = None) -> None:
    """Raise ``ValueError`` (see ``output_problem``) unless ``directory`` may be replaced by a heads folder."""
    problem = output_problem(directory, option)
    if problem:
        raise ValueError(problem)


def family_files() -> frozenset[str]:
    """The files each family's layouts write besides ``OUR_NAMES`` (``Family.files``)."""
    from medusa_train.model.family import (
        FAMILIES,  # the family table imports the families, which write through here
    )

    return frozenset(name for family in FAMILIES.values() for name in family.files)


def _is_draft_config(path: Path) -> bool:
    from medusa_train.model.family import (
        family_of,  # the family table imports the families, which write through here
    )

    try:
        family_of(json.loads(path.read_text()))
    except (OSError, ValueError, AttributeError, TypeError):
        return False
    return True


# ---------------------------------------------------------------------------------- writers
def replace_folder(final: str | os.PathLike, fill: Callable[[Path], None], option: str | None = None) -> Path:
    """Write a heads folder atomically: ``fill(tmp)`` writes into a fresh temporary folder, renamed to ``final``.

    Args:
        final: The folder to write; an existing one must be ours (``check_output``), and is replaced whole but
            for ``KEPT_NAMES`` (``serving.json``), carried over unless ``fill`` wrote them.
        fill: Writes every file of the new folder into the folder it is given.
        option: The setting that names ``final``, for the message when it is refused.

    Raises:
        ValueError: ``final`` holds files that are not ours (nothing is written).
    """
    final = Path(final)
    check_output(final, option)
    tmp = assets.atomic_dir(final)
    try:
        fill(tmp)
        for name in KEPT_NAMES:
            if (final / name).is_file() and not (tmp / name).exists():
                shutil.copy2(final / name, tmp / name)
        assets.replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def write_heads_files(folder: Path, files: dict[str, dict[str, torch.Tensor]], config: dict,
                      chat_template: str | None = None) -> None:
    """Write tensor files (``.pt`` with ``torch.save``, else safetensors), ``config.json`` and, when given,
    ``chat_template.jinja`` into ``folder``."""
    for name, state in files.items():
        if name.endswith(".pt"):
            torch.save(state, folder / name)
        else:
            save_file(state, str(folder / name), metadata={"format": "pt"})
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    if chat_template:
        (folder / CHAT_TEMPLATE_NAME).write_text(chat_template, encoding="utf-8")


def write_heads_folder(final: str | os.PathLike, files: dict[str, dict[str, torch.Tensor]], config: dict,
                       chat_template: str | None = None, option: str | None = None) -> Path:
    """``write_heads_files`` into ``final``, through ``replace_folder`` (atomic; only our folders replaced)."""
    return replace_folder(final, lambda tmp: write_heads_files(tmp, files, config, chat_template), option)


# ---------------------------------------------------------------------------------- the chat template
def read_chat_template(heads_dir: str | os.PathLike) -> str | None:
    """The chat template the heads in ``heads_dir`` were trained with, or ``None`` when the folder records none
    (then the tokenizer's own applies).

    ``chat_template.jinja`` when the folder has one; else, for an export made before the template travelled
    with the heads, the ``data.chat_template`` its ``training_config.json`` names (a template, or a file).

    Raises:
        ValueError: ``training_config.json`` names a template file that is no longer there.
    """
    heads_dir = Path(heads_dir)
    stored = heads_dir / CHAT_TEMPLATE_NAME
    if stored.is_file():
        return stored.read_text(encoding="utf-8")
    training = heads_dir / TRAINING_CONFIG_NAME  # a run's record (``training.run_folder``), read here: model/ is below
    if not training.is_file():
        return None
    value = (json.loads(training.read_text()).get("data") or {}).get("chat_template")
    if not value:
        return None
    try:
        return resolve_chat_template(value)
    except OSError as err:
        raise ValueError(f"{training} says the heads were trained with data.chat_template={value!r}, which cannot "
                         f"be read here ({err.strerror or err}); put that template in {stored}") from err
