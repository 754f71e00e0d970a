"""``medusa-train export``'s work: a draft folder converted to another layout of its family's, as the family table
(``model/family.py``) says which layouts it has, which writer converts it and which options those take.

    medusa-train export draft=out/run/export format=vllm output=out/heads-vllm
"""

from __future__ import annotations

import os
from pathlib import Path

from medusa_train.model.family import FAMILIES, LAYOUTS, family_of, layout_problem
from medusa_train.model.files import read_config_json
from medusa_train.model.folder import RECORD_NAMES, check_output


def option_problems(format: str | None, lm_head_pt: bool = False, max_paths: int = 64, topk: int = 10) -> list[str]:
    """Every problem with the export options, each naming the option (``format=None``: not checked); the options
    past ``format`` are those some family's layouts take (``Family.option_problems``)."""
    known = format is None or format in LAYOUTS
    problems = [] if known else [f"format={format}: must be one of {', '.join(LAYOUTS)}"]
    for family in FAMILIES.values():
        problems += [p for p in family.option_problems(format, lm_head_pt, max_paths, topk) if p not in problems]
    return problems


def export_folder(draft: str | os.PathLike, output: str | os.PathLike, format: str, lm_head_pt: bool = False,
                  max_paths: int = 64, topk: int = 10, model: str | None = None, dtype: str | None = None) -> Path:
    """Convert a draft folder (any layout of any family) to ``format``; what ``medusa-train export`` runs.

    Args:
        draft: The draft folder to read (Medusa heads or an EAGLE-3 draft, any layout).
        output: Folder to write; an existing one is replaced whole if it is a folder of ours (its ``serving.json``
            kept), and refused, naming ``output=``, if it holds anything else. The source's record of the run that
            trained it (``training_config.json``, ``validation.json``) is written with it, also in place.
        format: One of the layouts its family writes (``Family.layouts``).
        lm_head_pt: ``medusa_v1`` only: also write ``medusa_lm_head.pt``.
        max_paths: ``vllm`` Medusa heads: written to ``config.json`` for vLLM.
        topk: ``vllm`` Medusa heads: written to ``config.json`` for vLLM.
        model: Backbone to load instead of the one the folder names (when the layout stores its LM head).
        dtype: Dtype to load that backbone in.

    Raises:
        ValueError: bad options, a layout the family has no form for, an ``output`` holding files not ours.
    """
    problems = option_problems(format, lm_head_pt, max_paths, topk)
    if problems:
        raise ValueError("cannot export the draft: " + "; ".join(problems))
    check_output(output, "output")
    family, _ = family_of(read_config_json(draft))
    if format not in family.layouts:
        raise ValueError(f"format={format}: {draft} holds {layout_problem(family, None, format)}")
    record = {name: (Path(draft) / name).read_bytes() for name in RECORD_NAMES if (Path(draft) / name).is_file()}
    written = family.convert_folder(draft, output, format, lm_head_pt=lm_head_pt, max_paths=max_paths, topk=topk,
                                    model=model, dtype=dtype)
    for name, content in record.items():  # the run's record goes with its draft (in place too: read before)
        if not (written / name).exists():
            (written / name).write_bytes(content)
    return written
