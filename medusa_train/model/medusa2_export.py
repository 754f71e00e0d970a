"""A Medusa-2 export after training: merge the backbone, load either form, measure how far it moved.

``<output_dir>/export`` of a medusa2 run holds the heads, ``backbone.json`` (what the backbone was
loaded from and how), ``adapter/`` (peft's LoRA adapter) and, with ``trainer.merge_export=true``,
``merged/``: the LoRA update merged into the original, unquantized weights (``trainer.merge_into=original``,
the default: the user's model plus what training learnt, nothing lost to quantization), or into the 4-bit
weights dequantized (``dequantized``: exactly the model that trained), loadable by plain transformers.
Nothing here imports peft or bitsandbytes unless the adapter form is asked for.

- ``merge_backbone``: write-side, builds ``merged/`` from the trained model;
- ``load_medusa2_export``: ``(MedusaModel, tokenizer)`` from either form;
- ``original_backbone``: the model a drift is measured against: the original model (loaded unquantized),
  or for a ``dequantized`` merge the 4-bit base it started from, rebuilt from ``merged/`` minus the LoRA
  update, with plain torch;
- ``backbone_drift``: mean KL and greedy agreement between an original and an adapted backbone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
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


def load_medusa2_export(directory: str | os.PathLike, form: str = "merged", dtype: str | None = None,
                        device_map: str | dict | None = None, attn_implementation: str | None = None):
    """Load a Medusa-2 export as ``(MedusaModel, tokenizer)`` in eval mode.

    Args:
        directory: ``<output_dir>/export`` of a medusa2 run.
        form: ``merged`` (the standalone ``merged/`` backbone; plain transformers) or ``adapter``
            (the original model quantized as in training, plus the LoRA adapter; needs peft and
            bitsandbytes; stage-1 exports have no adapter and load the quantized backbone alone).
        dtype: Backbone dtype (default: the training ``model.dtype``).
        device_map: Passed to ``from_pretrained`` for the quantized load.
        attn_implementation: ``sdpa`` / ``eager``; ``None`` keeps transformers' default.
    """
    from medusa_train.backbone.load import load_backbone
    from medusa_train.model.medusa import MedusaModel

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
    model = MedusaModel.from_pretrained(directory, backbone=backbone)
    return model.eval().requires_grad_(False), tokenizer


def merged_from(info: dict) -> str:
    """What an export's ``merged/`` adds the LoRA update to (``trainer.merge_into``); exports written before
    the choice existed merged into the dequantized weights."""
    return info.get("merged_from") or ("dequantized" if info.get("merged") else "original")


def describe_original(directory: str | os.PathLike) -> str:
    """What ``original_backbone(directory)`` is, for a report."""
    info = read_backbone_info(directory)
    if merged_from(info) == "original":
        return f"the original model {info['base_model_name_or_path']} (unquantized, without the adapter)"
    return "the Medusa-2 export's 4-bit base (dequantized, without the adapter)"


def original_backbone(directory: str | os.PathLike, dtype: str | None = None, attn_implementation: str | None = None,
                      trust_remote_code: bool = False):
    """The model a Medusa-2 export's drift is measured against (``drift.original=auto``), without peft or
    bitsandbytes.

    With ``merged/`` merged into the original weights (``trainer.merge_into=original``, the default), or
    without ``merged/``: the original model, ``base_model_name_or_path`` of ``backbone.json`` loaded
    unquantized, so the drift includes what quantization and training together changed. With a
    ``dequantized`` merge: the 4-bit base dequantized, with no adapter (the "original" of
    ``loss.base=distill``), rebuilt as ``merged/`` minus the LoRA update ``scale * B @ A`` of every adapted
    layer, read from ``adapter/`` with safetensors; ``merged/`` was stored in the training dtype, so that
    equals the dequantized base up to the dtype's rounding of ``W + scale * B @ A``.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.
    """
    from safetensors.torch import load_file

    from medusa_train.backbone.load import load_backbone

    directory = Path(directory)
    info = read_backbone_info(directory)
    if merged_from(info) == "original":
        model, tokenizer = load_backbone(info["base_model_name_or_path"], dtype=dtype or info["dtype"],
                                         attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)
        return model.eval().requires_grad_(False), tokenizer
    if not info.get("merged"):
        raise ValueError(f"{directory} holds no merged backbone (train with trainer.merge_export=true)")
    model, tokenizer = load_backbone(directory / info["merged"], dtype=dtype or info["dtype"],
                                     attn_implementation=attn_implementation)
    if not info.get("adapter"):  # stage 1: the backbone was never adapted
        return model, tokenizer
    adapter = directory / info["adapter"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    if config.get("rank_pattern") or config.get("alpha_pattern") or config.get("fan_in_fan_out"):
        raise ValueError(f"{adapter}: per-layer ranks, alphas or fan_in_fan_out are not supported here")
    r, alpha = config["r"], config["lora_alpha"]
    scale = alpha / (r ** 0.5 if config.get("use_rslora") else r)
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    undone = 0
    with torch.no_grad():
        for key, a in weights.items():
            if ".lora_A." not in key:
                continue
            b = weights[key.replace(".lora_A.", ".lora_B.")]
            name = key.split(".lora_A.")[0].removeprefix("base_model.model.")
            layer = model.get_submodule(name)
            delta = scale * (b.float() @ a.float())
            layer.weight.copy_((layer.weight.float() - delta).to(layer.weight.dtype))
            undone += 1
    if not undone:
        raise ValueError(f"{adapter}: no LoRA weights found")
    return model.eval().requires_grad_(False), tokenizer


# ------------------------------------------------------------------------------------ drift
@torch.no_grad()
def backbone_drift(original, adapted, tokenizer, prompts: Sequence[str | Sequence[int]],
                   max_new_tokens: int = 64) -> dict[str, float]:
    """How far the adapted backbone moved from the original, on the original's own greedy answers.

    For each prompt the original model answers greedily; both models then read prompt + answer,
    and at every answer position we compare their next-token distributions.

    Args:
        original: The original causal LM (e.g. ``load_backbone(base)``). Pass the adapted peft model
            itself to use it with its adapters disabled (the 4-bit original the adapter started from).
        adapted: The adapted causal LM (merged backbone or peft model).
        tokenizer: Tokenizes string prompts as they are (apply the chat template first).
        prompts: Strings or token id lists.
        max_new_tokens: Length of the original's greedy answer (shorter when it ends with eos).

    Returns:
        ``mean_kl``: mean KL(original || adapted) per answer token; ``greedy_agreement``: fraction
        of answer positions where both models' top-1 tokens agree; ``num_tokens``: positions compared.
    """
    from contextlib import nullcontext

    same = original is adapted
    modes = [(m, m.training) for m in {id(original): original, id(adapted): adapted}.values()]
    for model, _ in modes:
        model.eval()
    kl_sum, agree, count = 0.0, 0, 0
    device = next(adapted.parameters()).device
    try:
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids if isinstance(prompt, str) \
                else torch.tensor([list(prompt)])
            ids = ids.to(device)
            with original.disable_adapter() if same else nullcontext():
                sequence = original.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
                log_p = original(input_ids=sequence).logits[0, ids.shape[1] - 1:-1].float().log_softmax(-1)
            log_q = adapted(input_ids=sequence).logits[0, ids.shape[1] - 1:-1].float().log_softmax(-1)
            kl_sum += (log_p.exp() * (log_p - log_q)).sum().item()
            agree += int((log_p.argmax(-1) == log_q.argmax(-1)).sum())
            count += log_p.shape[0]
    finally:
        for model, training in modes:
            model.train(training)
    return {"mean_kl": kl_sum / max(count, 1), "greedy_agreement": agree / max(count, 1), "num_tokens": count}
