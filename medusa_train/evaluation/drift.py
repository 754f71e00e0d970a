"""How far a Medusa-2 backbone moved from the model it started from (the evaluation's ``drift`` entry).

- ``original_backbone``: the model a drift is measured against: the original model (loaded unquantized),
  or for a ``dequantized`` merge the 4-bit base it started from, rebuilt from ``merged/`` minus the LoRA
  update, with plain torch;
- ``backbone_drift``: mean KL and greedy agreement between an original and an adapted backbone;
- ``measure_drift``: the two together on a benchmark's first turns, for the report.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from medusa_train.backbone.generation import encode_chat
from medusa_train.backbone.merge import merged_from, read_backbone_info
from medusa_train.config.evaluate import DriftConfig
from medusa_train.config.model import EvalModelConfig
from medusa_train.data.benchmarks import BenchPrompt


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


def measure_drift(backbone, tokenizer, prompts: Sequence[BenchPrompt], drift: DriftConfig, heads_dir,
                  model: EvalModelConfig | None = None) -> dict:
    """How far ``backbone`` is from ``drift.original`` on the prompts' first turns (see ``backbone_drift``).

    Returns:
        The report's ``drift`` entry: ``original`` (what was compared), ``mean_kl`` (KL(original ||
        evaluated) per token of the original's greedy answers), ``greedy_agreement``, ``num_tokens``,
        ``prompts`` and ``max_new_tokens``.
    """
    from medusa_train.backbone.load import load_backbone

    model = model or EvalModelConfig()
    if drift.original == "auto":
        original, _ = original_backbone(heads_dir, dtype=model.dtype, attn_implementation=model.attn_implementation,
                                        trust_remote_code=model.trust_remote_code)
        described = describe_original(heads_dir)
    else:
        original, _ = load_backbone(drift.original, dtype=model.dtype, trust_remote_code=model.trust_remote_code,
                                    attn_implementation=model.attn_implementation)
        described = drift.original
    original.to(next(backbone.parameters()).device)
    chosen = list(prompts)[:drift.limit] if drift.limit else list(prompts)
    ids = [encode_chat(tokenizer, [{"role": "user", "content": p.turns[0]}])[0].tolist() for p in chosen]
    result = backbone_drift(original, backbone, tokenizer, ids, max_new_tokens=drift.max_new_tokens)
    del original
    return {"original": described, "prompts": len(ids), "max_new_tokens": drift.max_new_tokens, **result}
