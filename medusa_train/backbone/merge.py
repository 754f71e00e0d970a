"""Merging a Medusa-2 backbone: the LoRA update into the original (or dequantized 4-bit) weights, and the
names of a Medusa-2 export's backbone files.

``<output_dir>/export`` of a medusa2 run holds the heads, ``backbone.json`` (what the backbone was
loaded from and how), ``adapter/`` (peft's LoRA adapter) and, with ``trainer.merge_export=true``,
``merged/``: the LoRA update merged into the original, unquantized weights (``trainer.merge_into=original``,
the default: the user's model plus what training learnt, nothing lost to quantization), or into the 4-bit
weights dequantized (``dequantized``: exactly the model that trained), loadable by plain transformers.
Nothing here imports peft or bitsandbytes unless the adapter form is asked for.

- ``merge_backbone``: write-side, builds ``merged/`` from the trained model (``export/run.py``);
- ``read_backbone_info`` / ``merged_from``: what ``backbone.json`` says.

Loading either form is ``medusa_train.model.load.load_adapted_export``; how far the backbone moved,
``medusa_train.evaluation.drift``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

ADAPTER_DIR = "adapter"
MERGED_DIR = "merged"
BACKBONE_INFO = "backbone.json"
MERGE_INTO = ("original", "dequantized")  #: what ``merged/`` adds the LoRA update to (``trainer.merge_into``)


# ------------------------------------------------------------------------------------ merge and load
def dequantize_into(quantized: torch.nn.Module, dense: torch.nn.Module) -> int:
    """Copy every bitsandbytes layer's dequantized weight into the same-named layer of ``dense``.

    Args:
        quantized: The trained model (a peft model's base model, or a plain quantized model).
        dense: The same architecture loaded unquantized.

    Returns:
        How many layers were copied (0 when nothing is quantized).
    """
    try:
        import bitsandbytes as bnb
    except ImportError:
        return 0
    from peft.utils.integrations import dequantize_bnb_weight

    copied = 0
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if not isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
                continue
            if getattr(getattr(module.weight, "quant_state", None), "packing_format_for_cpu", False):
                raise RuntimeError(f"{name}: 4-bit weight repacked for CPU inference; load it with load_backbone, "
                                   "which turns the repacking off")
            target = dense.get_submodule(name.removesuffix(".base_layer"))  # peft wraps the layer as base_layer
            weight = dequantize_bnb_weight(module.weight, getattr(module, "state", None))
            target.weight.copy_(weight.reshape(target.weight.shape).to(target.weight.dtype))
            copied += 1
    return copied


def merge_backbone(trained, adapter_dir: str | os.PathLike | None, base_name_or_path: str,
                   dtype: str = "bfloat16", into: str = "original", **load_kwargs):
    """A standalone backbone: the adapter merged into the original weights (or the dequantized 4-bit ones).

    The original model is loaded unquantized in ``dtype``; with ``into="dequantized"`` each quantized
    layer's weight is first replaced by the dequantized weight the adapter was trained against. The saved
    adapter is then applied and merged (``merge_and_unload``): ``W + scale * B @ A``. The result needs
    neither peft nor bitsandbytes.

    Args:
        trained: The trained backbone (a peft model or a plain, possibly quantized, model).
        adapter_dir: The adapter saved by peft's ``save_pretrained``; ``None`` to merge nothing.
        base_name_or_path: What the trained backbone was loaded from (``model.name_or_path``).
        dtype: Weight dtype of the result (``model.dtype``).
        into: ``original`` (the unquantized weights of ``base_name_or_path``) or ``dequantized``
            (``trainer.merge_into``).
        **load_kwargs: Passed to ``load_backbone`` (``trust_remote_code``, ``attn_implementation``).
    """
    from medusa_train.backbone.load import load_backbone

    if into not in MERGE_INTO:
        raise ValueError(f"trainer.merge_into={into!r}: must be original or dequantized")
    dense, _ = load_backbone(base_name_or_path, dtype=dtype, **load_kwargs)
    if into == "dequantized":
        dequantize_into(trained.get_base_model() if hasattr(trained, "get_base_model") else trained, dense)
    if adapter_dir is not None:
        from peft import PeftModel

        dense = PeftModel.from_pretrained(dense, str(adapter_dir)).merge_and_unload()
    dense.name_or_path = str(base_name_or_path)
    return dense.eval().requires_grad_(False)


def read_backbone_info(directory: str | os.PathLike) -> dict:
    """The ``backbone.json`` of a Medusa-2 export (base model, quantization, adapter, merged folder)."""
    path = Path(directory) / BACKBONE_INFO
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no {BACKBONE_INFO}; not a Medusa-2 export (medusa1 heads load "
                                "with MedusaModel.from_pretrained)")
    return json.loads(path.read_text())


def merged_from(info: dict) -> str:
    """What an export's ``merged/`` adds the LoRA update to (``trainer.merge_into``); exports written before
    the choice existed merged into the dequantized weights."""
    return info.get("merged_from") or ("dequantized" if info.get("merged") else "original")
