"""Writing Medusa heads in each layout the family writes: ``native``, ``medusa_v1`` (original Medusa / TensorRT-LLM)
or ``vllm``. The layouts are defined, and read back, in ``families/medusa/layouts.py``; ``export/write.py`` is the command's
entry (it asks the family table which writer a folder needs).

Every write goes to a temporary folder beside the target and is renamed into place; only a heads folder of ours is
replaced, a folder holding anything else is refused (``model.folder.replace_folder``). The chat template the heads
were trained with (``chat_template.jinja``) travels with them into every layout.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from medusa_train.families.medusa.config import check_fits
from medusa_train.families.medusa.layouts import (
    LAYOUTS,
    MEDUSA_V1_PT_NAME,
    MEDUSA_V1_WEIGHTS_NAME,
    SHARED_LM_HEAD_KEY,
    TOKEN_MAP_KEY,
    VLLM_WEIGHTS_NAME,
    MedusaConfig,
    check_shared_lm_head,
    layout_names,
    native_shapes,
    read_heads,
)
from medusa_train.model.files import WEIGHTS_NAME, check_tensors
from medusa_train.model.folder import check_output, read_chat_template, write_heads_folder


def export_heads(model, directory: str | os.PathLike, format: str, lm_head_pt: bool = False,
                 max_paths: int = 64, topk: int = 10, chat_template: str | None = None,
                 option: str | None = None) -> Path:
    """Write ``model``'s heads to ``directory`` in ``format``.

    Args:
        model: The heads (and, when they share it, the backbone's LM head) to write.
        directory: Target folder; an existing one is replaced whole if it is a heads folder of ours (its
            ``serving.json`` kept), and refused if it holds anything else.
        format: ``native``, ``medusa_v1`` or ``vllm``.
        lm_head_pt: ``medusa_v1`` only: also write ``medusa_lm_head.pt`` (a ``torch.save`` of the same
            tensors), the only file the original Medusa loader reads.
        max_paths: ``vllm`` only: written to ``config.json`` for vLLM.
        topk: ``vllm`` only: written to ``config.json`` for vLLM.
        chat_template: The template the heads were trained with, written as ``chat_template.jinja``.
        option: The setting that names ``directory`` (``output``), for the message when it is refused.

    Returns:
        The folder written.
    """
    lm_head = model.lm_head.weight if model.config.share_lm_head else None
    return write_heads(model.config, model.heads_state_dict(), directory, format, lm_head_weight=lm_head,
                       lm_head_pt=lm_head_pt, max_paths=max_paths, topk=topk, chat_template=chat_template,
                       option=option)


def write_heads(config: MedusaConfig, tensors: dict[str, torch.Tensor], directory: str | os.PathLike,
                format: str, lm_head_weight: torch.Tensor | None = None, lm_head_pt: bool = False,
                max_paths: int = 64, topk: int = 10, chat_template: str | None = None,
                option: str | None = None) -> Path:
    """Write native-keyed head tensors in ``format`` (what ``export_heads`` does, without a model).

    Args:
        config: The heads' config.
        tensors: Native-keyed tensors (``heads.{h}.…``), exactly those ``config`` describes.
        directory: Target folder; see ``export_heads``.
        format: ``native``, ``medusa_v1`` or ``vllm``.
        lm_head_weight: The backbone's LM head, required when ``config.share_lm_head`` and
            ``format`` is not native: ``medusa_v1`` gets a copy per head, ``vllm`` one copy (the whole
            LM head, also for heads with a draft vocabulary: vLLM 0.32 loads no ``token_map``).
        lm_head_pt: See ``export_heads``.
        max_paths: See ``export_heads``.
        topk: See ``export_heads``.
        chat_template: See ``export_heads``.
        option: See ``export_heads``.

    Raises:
        ValueError: a ``directory`` that holds files of someone else's, an unknown format or bad option, tensors that do not match ``config``, a
            shared LM head that is missing, heads with a native-only feature
            (``MedusaConfig.native_only_features``) for a layout other than native, a draft vocabulary for ``medusa_v1``, or a draft vocabulary
            with the heads' own output layers for ``vllm`` (``MedusaConfig.vllm_problem``).
    """
    check_options(format, lm_head_pt, max_paths, topk)
    check_output(directory, option)
    if problem := config.layout_problem(format):
        raise ValueError(f"format={format}: these heads {problem}")
    writer = {"native": _native, "medusa_v1": _medusa_v1, "vllm": _vllm}[format]
    if config.share_lm_head and writer is not _native and lm_head_weight is None:
        raise ValueError(f"format={format} stores the heads' shared LM head: pass lm_head_weight")
    check_tensors(tensors, native_shapes(config), "the heads to export")

    tensors = {k: t.detach().cpu().contiguous() for k, t in tensors.items()}
    dtype = _dtype_of(tensors, config)
    if lm_head_weight is not None:
        lm_head_weight = lm_head_weight.detach().cpu().to(dtype)
        if tuple(lm_head_weight.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(f"lm_head_weight has shape {tuple(lm_head_weight.shape)}: pass the backbone's whole LM "
                             f"head ({config.vocab_size}, {config.hidden_size})")
    files, meta = writer(config, tensors, lm_head_weight, dtype, lm_head_pt=lm_head_pt, max_paths=max_paths, topk=topk)
    return write_heads_folder(directory, files, meta, chat_template=chat_template, option=option)


def option_problems(format: str | None, lm_head_pt: bool = False, max_paths: int = 64, topk: int = 10) -> list[str]:
    """Every problem with the options of a Medusa export, each naming the option (``format=None``: not checked)."""
    problems = []
    if format is not None and format not in LAYOUTS:
        problems.append(f"format={format}: must be one of {', '.join(LAYOUTS)}")
    if lm_head_pt and format != "medusa_v1":
        problems.append(f"lm_head_pt=true: only format=medusa_v1 has a .pt file (format={format})")
    for name, value in (("max_paths", max_paths), ("topk", topk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{name}={value}: must be an integer >= 1")
    return problems


def check_options(format: str, lm_head_pt: bool, max_paths: int, topk: int) -> None:
    problems = option_problems(format, lm_head_pt, max_paths, topk)
    if problems:
        raise ValueError("cannot export heads: " + "; ".join(problems))


def _dtype_of(tensors: dict[str, torch.Tensor], config: MedusaConfig) -> torch.dtype:
    floats = [t for t in tensors.values() if t.is_floating_point()]  # not the token_map's int64
    return floats[0].dtype if floats else getattr(torch, config.dtype)


def _native(config: MedusaConfig, tensors: dict, lm_head: torch.Tensor | None, dtype: torch.dtype, **_):
    return {WEIGHTS_NAME: tensors}, {**config.to_dict(), "dtype": str(dtype).removeprefix("torch.")}


def _medusa_v1(config: MedusaConfig, tensors: dict, lm_head: torch.Tensor | None, dtype: torch.dtype,
               lm_head_pt: bool, **_):
    names = layout_names(config.num_heads, config.num_layers, "medusa_v1")
    if config.share_lm_head:  # the layout has no shared option: every head gets its own copy
        tensors = {**tensors, **{f"heads.{h}.lm_head.weight": lm_head.clone() for h in range(config.num_heads)}}
    state = {names[k]: t for k, t in tensors.items()}
    files = {MEDUSA_V1_WEIGHTS_NAME: state}
    if lm_head_pt:
        files[MEDUSA_V1_PT_NAME] = state
    meta = {"medusa_num_heads": config.num_heads, "medusa_num_layers": config.num_layers,
            "base_model_name_or_path": config.base_model_name_or_path,
            "hidden_size": config.hidden_size, "vocab_size": config.vocab_size}
    return files, meta


def _vllm(config: MedusaConfig, tensors: dict, lm_head: torch.Tensor | None, dtype: torch.dtype, max_paths: int,
          topk: int, **_):
    # No token_map: vLLM 0.32 refuses one at load. Heads sharing the LM head get the whole of it (they then
    # guess from every token, not only the draft vocabulary's); write_heads refuses the other draft heads.
    names = layout_names(config.num_heads, config.num_layers, "vllm")
    state = {names[k]: t for k, t in tensors.items() if k != TOKEN_MAP_KEY}
    if config.share_lm_head:
        state[SHARED_LM_HEAD_KEY] = lm_head
    meta = {"model_type": "medusa", "architectures": ["MedusaModel"],
            "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
            "num_heads": config.num_heads, "num_hidden_layers": config.num_layers,
            "max_paths": max_paths, "topk": topk, "truncated_vocab_size": config.vocab_size,
            "medusa_fc_bias": True, "original_lm_head": config.share_lm_head,
            "base_model_name_or_path": config.base_model_name_or_path,
            "torch_dtype": str(dtype).removeprefix("torch.")}
    return {VLLM_WEIGHTS_NAME: state}, meta


def export_medusa_folder(heads: str | os.PathLike, output: str | os.PathLike, format: str, lm_head_pt: bool = False,
                  max_paths: int = 64, topk: int = 10, model: str | None = None, dtype: str | None = None) -> Path:
    """Convert a Medusa heads folder (any layout) to ``format`` (``export.write.export_folder`` asks the family).

    The backbone is loaded only when it is needed: when the heads share its LM head and the target
    layout stores a copy of it. It is then the one named in the heads' ``config.json`` unless
    ``model`` is given, in ``dtype`` (default: the heads' dtype). The chat template the heads carry
    (``model.folder.read_chat_template``) is written with them.

    Args:
        heads: Folder to read (``native``, ``medusa_v1`` or ``vllm``).
        output: Folder to write; an existing one is replaced whole if it is a heads folder of ours (its
            ``serving.json`` kept), and refused, naming ``output=``, if it holds anything else.
        format: ``native``, ``medusa_v1`` or ``vllm``.
        lm_head_pt: See ``export_heads``.
        max_paths: See ``export_heads``.
        topk: See ``export_heads``.
        model: Backbone to load instead of the heads' ``base_model_name_or_path``.
        dtype: Dtype to load the backbone in.
    """
    check_options(format, lm_head_pt, max_paths, topk)
    check_output(output, "output")
    config, tensors = read_heads(heads)
    options = dict(lm_head_pt=lm_head_pt, max_paths=max_paths, topk=topk, chat_template=read_chat_template(heads),
                   option="output")
    if not (config.share_lm_head and format != "native"):
        tensors.pop(SHARED_LM_HEAD_KEY, None)  # a native shared-head export stores no LM head
        return write_heads(config, tensors, output, format, **options)
    from medusa_train.backbone.load import load_backbone

    name = model or config.base_model_name_or_path
    if not name:
        raise ValueError(f"{heads}/config.json names no base model and these heads share its LM head: "
                         "pass model=<backbone>")
    backbone, _ = load_backbone(name, dtype=dtype or config.dtype)
    check_fits(backbone, config)
    lm_head = backbone.get_output_embeddings().weight
    stored = tensors.pop(SHARED_LM_HEAD_KEY, None)  # vLLM original_lm_head heads: it must be this backbone's
    if stored is not None:
        rows = lm_head if config.draft_vocab_size is None else lm_head[tensors[TOKEN_MAP_KEY].to(lm_head.device)]
        check_shared_lm_head(stored, rows, source=str(heads))
    return write_heads(config, tensors, output, format, lm_head_weight=lm_head, **options)
