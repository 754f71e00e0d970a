"""Loading an export: heads + backbone from a heads folder, for every command that reads one (evaluate,
build-tree, export).

- ``read_exported_draft``: a heads folder with its ``config.json`` read once (any layout, by
  ``model.layouts.read_config_json``): its layout, head count (a draft's default depth) and base model, handed on to
  ``load_exported_draft`` / ``load_draft`` and the served evaluation so none reads it again; ``read_export_config``:
  ``(depth, base model)`` of it;
- ``check_draft_folder``: the same as config problems (``draft=<dir>``), for a command's checks;
- ``load_exported_draft``: ``(MedusaModel, tokenizer)`` in eval mode, the backbone named by the heads (or given), the
  tokenizer rendering chats with the template the heads were trained with (``read_chat_template``);
- ``load_adapted_export``: the same for a Medusa-2 export, its backbone merged or as trained (4-bit + LoRA).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from medusa_train.config.check import Problems
from medusa_train.config.model import EvalModelConfig
from medusa_train.model.family import Family, family_of
from medusa_train.model.files import CONFIG_NAME, read_config_json, resolve_base_model
from medusa_train.model.folder import read_chat_template

__all__ = ["ExportedDraft", "check_draft_folder", "load_draft", "load_exported_draft", "load_adapted_export", "read_chat_template",
           "read_export_config", "read_exported_draft", "use_export_template"]


@dataclass(frozen=True)
class ExportedDraft:
    """A draft folder (heads or draft) and its ``config.json`` as stored, read once (``read_exported_draft``)."""

    path: Path
    config: dict  #: ``config.json`` as stored (any layout)
    depth: int  #: its default depth: Medusa's heads, a chained draft's trained steps (``DraftConfig.depth``)
    base_model: str | None  #: the backbone it names (a path relative to the heads resolved), if any
    family: Family  #: the draft family it holds (``model/family.py``)
    layout: str  #: which of its family's layouts it is in

    @property
    def served_as_is(self) -> bool:
        """Whether vLLM loads the folder as it is (its family's served layout)."""
        return self.family.serves_as_is(self.layout)


def read_exported_draft(heads_dir: str | os.PathLike | ExportedDraft) -> ExportedDraft:
    """``heads_dir`` with its ``config.json`` read (an ``ExportedDraft`` is returned as it is); a base model stored
    relative to the heads (Medusa-2's ``merged``) comes back as its path.

    Raises:
        FileNotFoundError: no ``config.json``.
        ValueError: it does not say how many heads there are.
    """
    if isinstance(heads_dir, ExportedDraft):
        return heads_dir
    path = Path(heads_dir).expanduser()
    raw = read_config_json(path)
    try:
        family, layout = family_of(raw)
    except ValueError as err:
        raise ValueError(f"draft={heads_dir}: {err}") from err
    depth = family.depth_in(raw)
    if not isinstance(depth, int):
        raise ValueError(f"draft={heads_dir}: config.json does not say how many heads there are")
    return ExportedDraft(path, raw, depth, resolve_base_model(path, raw.get("base_model_name_or_path")), family,
                         layout)


def read_export_config(heads_dir: str | os.PathLike) -> tuple[int, str | None]:
    """``(depth, base model)`` of ``read_exported_draft(heads_dir)``."""
    heads = read_exported_draft(heads_dir)
    return heads.depth, heads.base_model


def check_draft_folder(heads: str | None, p: Problems) -> tuple[int | None, str | None]:
    """Adds the problems of ``draft=`` to ``p``; returns ``(depth, base model)`` when the folder reads."""
    if not heads:
        return None, None  # the schema check says it is required
    if not (Path(heads).expanduser() / CONFIG_NAME).is_file():
        p.append(f"draft={heads}: not a folder of exported heads (no config.json)")
        return None, None
    try:
        return read_export_config(Path(heads).expanduser())
    except ValueError as err:
        p.append(str(err))
        return None, None


def use_export_template(tokenizer, heads_dir: str | os.PathLike):
    """Set ``tokenizer.chat_template`` to the template ``heads_dir`` records (``read_chat_template``), if any;
    returns ``tokenizer``."""
    template = read_chat_template(heads_dir)
    if template:
        tokenizer.chat_template = template
    return tokenizer


def load_exported_draft(heads_dir: str | os.PathLike | ExportedDraft, model: EvalModelConfig | None = None,
               device: str | None = None, export_template: bool = True):
    """Load a backbone and the heads in ``heads_dir``, in the backbone's dtype, on ``device``, to decode with: a backbone
    the decoder cannot verify a tree on is refused here (``model/contract.py``).

    Args:
        heads_dir: Folder of exported heads (any layout ``MedusaModel.from_pretrained`` reads, or an EAGLE-3
            draft), or the ``ExportedDraft`` read of it.
        model: Backbone settings; its ``name_or_path`` defaults to the base model of the heads.
        device: ``cuda`` when available, else ``cpu`` by default.
        export_template: Render chats with the template the heads were trained with, when the folder records
            one (``read_chat_template``); ``False`` keeps the tokenizer's own. ``model.chat_template``, when set,
            is used instead of either.

    Returns:
        ``(MedusaModel, tokenizer)`` in eval mode.
    """
    from medusa_train.backbone.attention import use_grouped_attention
    from medusa_train.backbone.load import load_backbone
    from medusa_train.backbone.row_layers import use_row_kernel
    from medusa_train.model.contract import check_tree_decodable

    model = model or EvalModelConfig()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if model.form == "adapter":  # Medusa-2: the 4-bit base + LoRA, as in training (peft and bitsandbytes)
        draft, tokenizer = load_adapted_export(read_exported_draft(heads_dir).path, "adapter", dtype=model.dtype, device_map=device,
                                                attn_implementation=model.attn_implementation,
                                                export_template=export_template)
        check_tree_decodable(draft.backbone)
        return draft.eval(), _user_template(tokenizer, model.chat_template)
    heads = read_exported_draft(heads_dir)
    name = model.name_or_path or heads.base_model
    backbone, tokenizer = load_backbone(name, dtype=model.dtype, trust_remote_code=model.trust_remote_code,
                                        attn_implementation=model.attn_implementation)
    check_tree_decodable(backbone)  # said now, not at the first prompt's decoding
    backbone.to(device)
    use_row_kernel(backbone)  # a CPU backbone's decoding steps: medusa_train/backbone/row_layers.py
    use_grouped_attention()  # a CPU step's masked tokens read the cached keys once: medusa_train/backbone/attention.py
    draft = load_draft(heads, backbone)
    for part in draft.draft_modules():
        part.to(backbone.get_output_embeddings().weight.dtype)
        use_row_kernel(part)  # the draft's few rows a step too (its output layers read as much as a backbone's)
    if export_template:
        tokenizer = use_export_template(tokenizer, heads.path)
    return draft.eval(), _user_template(tokenizer, model.chat_template)


def load_draft(heads_dir: str | os.PathLike | ExportedDraft, backbone):
    """The draft in ``heads_dir`` on ``backbone``, of the family its ``config.json`` names (read once, handed to its
    model class's ``from_pretrained``)."""
    heads = read_exported_draft(heads_dir)
    return heads.family.model_class().from_pretrained(heads.path, backbone=backbone, stored_config=heads.config)


def _user_template(tokenizer, value: str | None):
    """``tokenizer`` rendering with ``model.chat_template`` when one is set (over the heads' own)."""
    if value:
        from medusa_train.backbone.chat_template import resolve_chat_template

        tokenizer.chat_template = resolve_chat_template(value)
    return tokenizer


def load_adapted_export(directory: str | os.PathLike, form: str = "merged", dtype: str | None = None,
                        device_map: str | dict | None = None, attn_implementation: str | None = None,
                        export_template: bool = True):
    """Load a Medusa-2 export as ``(MedusaModel, tokenizer)`` in eval mode.

    Args:
        directory: ``<output_dir>/export`` of a medusa2 run.
        form: ``merged`` (the standalone ``merged/`` backbone; plain transformers) or ``adapter``
            (the original model quantized as in training, plus the LoRA adapter; needs peft and
            bitsandbytes; stage-1 exports have no adapter and load the quantized backbone alone).
        dtype: Backbone dtype (default: the training ``model.dtype``).
        device_map: Passed to ``from_pretrained`` for the quantized load.
        attn_implementation: ``sdpa`` / ``eager``; ``None`` keeps transformers' default.
        export_template: See ``load_exported_draft``.
    """
    from medusa_train.backbone.load import load_backbone
    from medusa_train.backbone.merge import read_backbone_info

    directory = Path(directory)
    info = read_backbone_info(directory)
    dtype = dtype or info["dtype"]
    if form == "merged":
        if not info.get("merged"):
            raise ValueError(f"{directory} holds no merged backbone (train with trainer.merge_export=true); "
                             "use form='adapter'")
        backbone, tokenizer = load_backbone(directory / info["merged"], dtype=dtype,
                                            attn_implementation=attn_implementation)
    elif form == "adapter":
        backbone, tokenizer = load_backbone(
            info["base_model_name_or_path"], dtype=dtype, quantization=info["quantization"],
            bnb_compute_dtype=info.get("bnb_compute_dtype"), bnb_double_quant=info.get("bnb_double_quant", True),
            device_map=device_map, attn_implementation=attn_implementation)
        if info.get("adapter"):
            from peft import PeftModel

            backbone = PeftModel.from_pretrained(backbone, str(directory / info["adapter"]))
    else:
        raise ValueError(f"form={form!r}: must be merged or adapter")
    model = load_draft(directory, backbone)  # heads of the family its config.json names (Medusa-2's)
    if export_template:
        use_export_template(tokenizer, directory)
    return model.eval().requires_grad_(False), tokenizer
