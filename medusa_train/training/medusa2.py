"""Medusa-2: a 4-bit (QLoRA) backbone trained jointly with the heads.

    accelerate launch train.py +recipe=medusa2                   # NF4 backbone + LoRA + heads, jointly
    accelerate launch train.py +recipe=medusa2 trainer=smoke     # a few steps on CPU
    accelerate launch train.py +recipe=medusa2 stage=1 trainer.output_dir=outputs/m2-s1   # heads only
    accelerate launch train.py +recipe=medusa2 stage=2 heads.init_from=outputs/m2-s1/export \\
        trainer.output_dir=outputs/m2-s2                         # then jointly, from stage 1's heads

The loss is ``L = L_base + lambda(step) * sum_k w_k L_k``: ``L_base`` is cross-entropy on the
labels (``loss.base=ce``) or self-distillation (``loss.base=distill``), the mean KL from the
original model's next-token distribution to the adapted model's, over the positions whose next
token is a label. The original distribution comes from the same model with its adapters
disabled, so no second copy is held. ``lambda`` rises from 0 to ``loss.head_weight`` over
``loss.head_warmup_steps`` (see ``head_weight_at``). The heads get ``optim.head_lr_multiplier``
times the backbone's learning rate.

Memory stays capped as in Medusa-1: the backbone's hidden states are detached to a leaf, the base
loss and then each head backpropagate into that leaf chunk by chunk, and one
``hidden.backward(leaf.grad)`` carries the sum into the LoRA weights.

The export (``<output_dir>/export``) holds the heads (native layout), the LoRA adapter
(``adapter/``, peft), ``backbone.json`` (how to rebuild the backbone), and with
``trainer.merge_export=true`` a standalone backbone (``merged/``: the 4-bit weights dequantized,
LoRA merged, plus the tokenizer) that needs neither peft nor bitsandbytes; the heads' config then
names it (``"merged"``, relative to the heads folder). ``medusa2_export`` loads either form and
measures how far the backbone moved from the original model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from medusa_train.backbone import assets
from medusa_train.config.train import to_dict
from medusa_train.model.layouts import MEDUSA_PARAMETERS
from medusa_train.training.losses import IGNORE_INDEX, LossResult, head_weights, medusa_loss_backward
from medusa_train.model.medusa2_export import (  # noqa: F401  (re-exported: the export side of this recipe)
    ADAPTER_DIR,
    BACKBONE_INFO,
    MERGED_DIR,
    backbone_drift,
    load_medusa2_export,
    merge_backbone,
    read_backbone_info,
)
from medusa_train.training.medusa1 import Medusa1Recipe, MetricsLog


# ------------------------------------------------------------------------------------ schedule
def head_weight_at(step: int, head_weight: float, warmup_steps: int, schedule: str = "linear") -> float:
    """``lambda(step)``: the heads' loss weight, rising from 0 at step 0 to ``head_weight``.

    Args:
        step: Optimizer steps completed so far.
        head_weight: The weight after warm-up (``loss.head_weight``).
        warmup_steps: Steps of the warm-up (``loss.head_warmup_steps``); 0 means no warm-up.
        schedule: ``linear`` (``w * s / n``) or ``sine`` (``w * sin(pi/2 * s / n)``).
    """
    if schedule not in ("linear", "sine"):
        raise ValueError(f"loss.head_warmup={schedule!r}: must be linear or sine")
    if warmup_steps <= 0 or step >= warmup_steps:
        return head_weight
    progress = max(step, 0) / warmup_steps
    return head_weight * (progress if schedule == "linear" else math.sin(0.5 * math.pi * progress))


# ------------------------------------------------------------------------------------ LoRA
def add_lora(backbone, r: int, alpha: int, dropout: float, target_modules: str | Sequence[str]):
    """Prepare a (quantized) backbone for k-bit training and wrap it with LoRA adapters.

    Gradient checkpointing stays off: on CPU it costs time and the activations are small.

    Args:
        backbone: A causal LM from ``load_backbone`` (4-bit, 8-bit or dense).
        r: LoRA rank.
        alpha: LoRA scaling numerator (``alpha / r``).
        dropout: Dropout on the LoRA input.
        target_modules: ``"all-linear"`` (every linear projection except the output layer) or a
            list of module names.

    Returns:
        A ``peft.PeftModelForCausalLM``; only the LoRA weights require grad.

    Raises:
        ValueError: the targets include the output layer (the LM head is never adapted).
    """
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from peft.tuners.tuners_utils import BaseTunerLayer

    output_name = next(n for n, m in backbone.named_modules() if m is backbone.get_output_embeddings())
    if not isinstance(target_modules, str):
        target_modules = list(target_modules)
        hit = [t for t in target_modules if output_name == t or output_name.endswith("." + t)]
        if hit:
            raise ValueError(f"peft.target_modules={target_modules}: {hit} is the output layer; "
                             "the LM head is never adapted (remove it)")
    if getattr(backbone, "is_loaded_in_4bit", False) or getattr(backbone, "is_loaded_in_8bit", False):
        backbone = prepare_model_for_kbit_training(backbone, use_gradient_checkpointing=False)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                        bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(backbone, config)
    if isinstance(model.get_output_embeddings(), BaseTunerLayer):
        raise ValueError(f"peft.target_modules={target_modules!r} matches the output layer {output_name}; "
                         "the LM head is never adapted")
    return model


# ------------------------------------------------------------------------------------ base loss
@dataclass
class BaseMetrics:
    """The backbone's own next-token figures over the positions whose next token is a label.

    Attributes:
        ce: Mean cross-entropy of the adapted model on the labels.
        kl: Mean KL(original || adapted) per position (0 when no original was given).
        top1: Fraction of labels that are the adapted model's top-1 prediction.
        agreement: Fraction of positions where the adapted and original top-1 agree (1 without original).
        count: Number of positions.
    """

    ce: float
    kl: float
    top1: float
    agreement: float
    count: int


def base_loss_backward(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    labels: torch.Tensor,
    kind: str | None,
    original_hidden: torch.Tensor | None = None,
    chunk_size: int | None = None,
    backward: Callable[[torch.Tensor], None] | None = torch.Tensor.backward,
    loss_scale: float = 1.0,
) -> BaseMetrics:
    """The backbone's next-token loss, forward and backward one sequence chunk at a time.

    Position ``t`` predicts ``labels[:, t + 1]``; only positions with a valid target count. At
    most ``batch x chunk_size`` positions' logits exist at once.

    Args:
        logits_fn: ``hidden -> logits`` (e.g. ``model.base_logits``).
        hidden: (batch, seq, hidden) adapted hidden states; backpropagated into when it requires grad
            (pass a detached leaf, as ``medusa_loss_backward`` does).
        labels: (batch, seq) tokens, ``IGNORE_INDEX`` where not trained.
        kind: What is backpropagated: ``ce``, ``distill`` (KL from ``original_hidden``'s
            distribution), or ``None`` (metrics only).
        original_hidden: (batch, seq, hidden) hidden states of the original model (no grad);
            needed for ``distill`` and for the KL / agreement metrics.
        chunk_size: Sequence positions per chunk; ``None`` for the whole sequence.
        backward: Called on each chunk's share of the mean loss; ``None`` computes metrics only.
        loss_scale: Factor on what is backpropagated (e.g. ``1 / grad_accum_steps``).

    Returns:
        ``BaseMetrics`` (unscaled means).
    """
    if labels.dim() != 2 or hidden.shape[:2] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} differ in (batch, seq)")
    if kind not in (None, "ce", "distill"):
        raise ValueError(f"loss.base={kind!r}: must be null, ce or distill")
    if kind == "distill" and original_hidden is None:
        raise ValueError("loss.base=distill needs the original model's hidden states")
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    valid = targets != IGNORE_INDEX
    step = chunk_size or labels.shape[1]
    chunk_counts = [int(v.sum()) for v in valid.split(step, dim=1)]
    count = sum(chunk_counts)
    train = backward is not None and kind is not None and hidden.requires_grad
    sums = torch.zeros(4, dtype=torch.float64)  # CE, KL, top-1 hits, agreements
    for c, start in enumerate(range(0, labels.shape[1], step)):
        if chunk_counts[c] == 0:
            continue
        mask = valid[:, start:start + step]
        chunk_targets = targets[:, start:start + step][mask]
        with torch.set_grad_enabled(train):
            log_q = logits_fn(hidden[:, start:start + step][mask]).float().log_softmax(-1)
            ce = -log_q.gather(-1, chunk_targets[:, None]).sum()
            kl, agree = torch.zeros(()), torch.tensor(float(chunk_counts[c]))
            if original_hidden is not None:
                with torch.no_grad():
                    log_p = logits_fn(original_hidden[:, start:start + step][mask]).float().log_softmax(-1)
                    agree = (log_p.argmax(-1) == log_q.argmax(-1)).sum()
                with torch.set_grad_enabled(train and kind == "distill"):
                    kl = (log_p.exp() * (log_p - log_q)).sum()
            if train:
                backward((ce if kind == "ce" else kl) * (loss_scale / count))
        with torch.no_grad():
            top1 = (log_q.argmax(-1) == chunk_targets).sum()
            sums += torch.stack([ce.detach(), kl.detach(), top1, agree]).double().cpu()
    n = max(count, 1)
    return BaseMetrics(ce=sums[0].item() / n, kl=sums[1].item() / n, top1=sums[2].item() / n,
                       agreement=sums[3].item() / n if count else 1.0, count=count)


@dataclass
class Medusa2LossResult(LossResult):
    """``LossResult`` of one Medusa-2 micro-batch: ``loss`` is the combined ``L_base + lambda * L_heads``.

    Attributes:
        heads_loss: The heads' weighted loss ``sum_k w_k L_k``.
        head_weight: ``lambda`` used for this micro-batch.
        base: The backbone's own figures (``None`` in stage 1).
    """

    heads_loss: float = 0.0
    head_weight: float = 1.0
    base: BaseMetrics | None = None


def base_term(base: BaseMetrics | None, kind: str | None) -> float:
    """``L_base`` as configured: the CE, the KL, or 0."""
    if base is None or kind is None:
        return 0.0
    return base.ce if kind == "ce" else base.kl


class _StepMetricsLog(MetricsLog):
    """Adds the recipe's Medusa-2 figures of the last optimizer step to each train record."""

    def __init__(self, output_dir: Path, accelerator, recipe: Medusa2Recipe):
        super().__init__(output_dir, accelerator)
        self.recipe = recipe

    def write(self, record: dict) -> None:
        if record.get("split", "train") == "train":
            record = {**record, **self.recipe.step_metrics}
        super().write(record)


# ------------------------------------------------------------------------------------ recipe
class Medusa2Recipe(Medusa1Recipe):
    """Medusa-2: a 4-bit NF4 (or int8) backbone with LoRA adapters, trained jointly with the heads.

    ``stage=1`` trains the heads only on the same quantized backbone (no LoRA); ``stage=2`` (or
    ``stage=null``) trains LoRA and heads jointly, stage 2 from ``heads.init_from``.
    """

    @property
    def joint(self) -> bool:
        return self.cfg.stage != 1

    def setup(self) -> None:
        self.step_metrics: dict[str, float] = {}
        self._window: list[Medusa2LossResult] = []
        super().setup()
        self.metrics = _StepMetricsLog(self.output_dir, self.accelerator, self)
        if self.joint and self.cfg.loss.base is None:
            self.log("warning: loss.base=null: the backbone trains on the heads' loss alone and may drift freely")

    def build_model(self):
        from medusa_train.backbone.load import load_backbone

        cfg, m, device = self.cfg, self.cfg.model, self.accelerator.device
        backbone, tokenizer = load_backbone(
            m.name_or_path, dtype=m.dtype, quantization=m.quantization, trust_remote_code=m.trust_remote_code,
            attn_implementation=m.attn_implementation, bnb_compute_dtype=m.bnb_compute_dtype,
            bnb_double_quant=m.bnb_double_quant, device_map={"": device} if m.quantization else None)
        if not m.quantization:
            backbone.to(device)
        self.peft_model = None
        if self.joint:
            p = cfg.peft
            backbone = self.peft_model = add_lora(backbone, p.r, p.alpha, p.dropout, p.target_modules)
            n_lora = sum(t.numel() for t in backbone.parameters() if t.requires_grad)
            self.log(f"LoRA r={p.r} alpha={p.alpha} on {p.target_modules}: {n_lora / 1e6:.2f} M parameters "
                     f"on a {m.quantization or m.dtype} backbone")
        return self.build_heads(backbone), tokenizer

    def param_groups(self) -> list[dict]:
        lr = self.cfg.optim.lr
        lora = [p for n, p in self.parameters.items() if not n.startswith(MEDUSA_PARAMETERS)]
        heads = [p for n, p in self.parameters.items() if n.startswith(MEDUSA_PARAMETERS)]
        groups = [{"params": lora, "lr": lr, "name": "lora"}] if lora else []  # first: its LR is logged as "lr"
        return groups + [{"params": heads, "lr": lr * self.cfg.optim.head_lr_multiplier, "name": "heads"}]

    def head_weight(self) -> float:
        """``lambda`` at the current optimizer step."""
        loss = self.cfg.loss
        return head_weight_at(self.step, loss.head_weight, loss.head_warmup_steps, loss.head_warmup)

    @torch.no_grad()
    def original_hidden_states(self, batch: dict) -> torch.Tensor:
        """Hidden states of the original model: the same model with its adapters disabled (eval mode)."""
        self.model.eval()
        with self.peft_model.disable_adapter(), self.accelerator.autocast():
            return self.model(batch["input_ids"], attention_mask=batch["attention_mask"]).hidden_states

    def micro_step(self, batch: dict, loss_scale: float) -> LossResult:
        if not self.joint:
            return super().micro_step(batch, loss_scale)
        cfg, acc = self.cfg, self.accelerator
        batch = {k: v.to(acc.device) for k, v in batch.items()}
        lam = self.head_weight()
        original = self.original_hidden_states(batch) if cfg.loss.base == "distill" else None
        self.model.train()  # LoRA dropout on
        hidden = self.hidden_states(batch)
        leaf = hidden.detach().requires_grad_(True)
        with acc.autocast():
            base = None
            if cfg.loss.base is not None:
                base = base_loss_backward(self.model.base_logits, leaf, batch["labels"], cfg.loss.base, original,
                                          cfg.loss.chunk_size, backward=acc.backward, loss_scale=loss_scale)
            inputs, loss_targets = self.head_inputs(leaf, batch["labels"])  # a teacher reads the adapted model
            heads = medusa_loss_backward(self.model.head_logits, inputs, batch["labels"], self.model.num_heads,
                                         head_decay=cfg.loss.head_decay, chunk_size=cfg.loss.chunk_size,
                                         backward=acc.backward if lam > 0 else None, loss_scale=loss_scale * lam,
                                         **loss_targets)
        if leaf.grad is not None:
            hidden.backward(leaf.grad)  # one backward through the backbone for the base loss and every head
        total = base_term(base, cfg.loss.base) + lam * float(heads.loss)
        result = Medusa2LossResult(loss=torch.tensor(total), per_head=heads.per_head, heads_loss=float(heads.loss),
                                   head_weight=lam, base=base)
        self._window.append(result)
        return result

    def optimizer_step(self) -> None:
        super().optimizer_step()
        window, self._window = self._window, []
        self.step_metrics = {"lr_heads": self.scheduler.get_last_lr()[-1]}
        if window:
            self.step_metrics.update(heads_loss=sum(r.heads_loss for r in window) / len(window),
                                     head_weight=window[-1].head_weight,
                                     **_base_record([r.base for r in window if r.base is not None]))

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Heads' loss and accuracy, plus the backbone's CE, KL to the original and agreement with it."""
        if not self.joint:
            return super().evaluate()
        cfg, acc = self.cfg, self.accelerator
        batches = list(self.eval_sampler)[acc.process_index::acc.num_processes]
        k_heads = self.model.num_heads
        sums = torch.zeros(k_heads, 4, dtype=torch.float64)  # per head: loss*n, top1*n, top5*n, n
        base_sums = torch.zeros(5, dtype=torch.float64)  # ce, kl, top1, agreement, n (all times n)
        for batch in DataLoader(self.eval_examples, batch_sampler=batches, collate_fn=self.collator):
            batch = {k: v.to(acc.device) for k, v in batch.items()}
            original = self.original_hidden_states(batch)
            with acc.autocast():
                hidden = self.model(batch["input_ids"], attention_mask=batch["attention_mask"]).hidden_states
                inputs, loss_targets = self.head_inputs(hidden, batch["labels"])
                result = medusa_loss_backward(self.model.head_logits, inputs, batch["labels"], k_heads,
                                              head_decay=cfg.loss.head_decay, chunk_size=cfg.loss.chunk_size,
                                              backward=None, **loss_targets)
                base = base_loss_backward(self.model.base_logits, hidden, batch["labels"], None, original,
                                          cfg.loss.chunk_size, backward=None)
            for k, h in enumerate(result.per_head):
                sums[k] += torch.tensor([h.loss * h.count, h.top1 * h.count, h.top5 * h.count, h.count],
                                        dtype=torch.float64)
            base_sums += torch.tensor([base.ce, base.kl, base.top1, base.agreement, 1.0], dtype=torch.float64) \
                * base.count
        if acc.num_processes > 1:
            sums = acc.reduce(sums.to(acc.device), reduction="sum").cpu()
            base_sums = acc.reduce(base_sums.to(acc.device), reduction="sum").cpu()
        record = {"step": self.step, "split": "eval"}
        weights = head_weights(k_heads, cfg.loss.head_decay)
        heads_loss = 0.0
        for k in range(k_heads):
            n = max(sums[k, 3].item(), 1.0)
            record.update({f"head{k + 1}/loss": sums[k, 0].item() / n, f"head{k + 1}/top1": sums[k, 1].item() / n,
                           f"head{k + 1}/top5": sums[k, 2].item() / n})
            heads_loss += weights[k] * sums[k, 0].item() / n
        n = max(base_sums[4].item(), 1.0)
        base = BaseMetrics(ce=base_sums[0].item() / n, kl=base_sums[1].item() / n, top1=base_sums[2].item() / n,
                           agreement=base_sums[3].item() / n, count=int(base_sums[4].item()))
        lam = self.head_weight()
        record.update(heads_loss=heads_loss, head_weight=lam, **_base_record([base]))
        record["loss"] = base_term(base, cfg.loss.base) + lam * heads_loss
        self.metrics.write(record)
        tops = " ".join(f"{record[f'head{k + 1}/top1']:.3f}" for k in range(k_heads))
        self.log(f"eval @ step {self.step}: loss {record['loss']:.4f}; backbone KL to original {base.kl:.5f}, "
                 f"CE {base.ce:.4f}, top-1 agreement {base.agreement:.4f}; top-1 by head {tops}")
        return record

    # ------------------------------------------------------------------------------------ export
    def export(self) -> Path | None:
        """Write heads, adapter, ``backbone.json`` (and ``merged/`` with ``trainer.merge_export``) atomically."""
        if not self.cfg.trainer.export:
            return None
        cfg, m = self.cfg, self.cfg.model
        target = self.output_dir / "export"
        if self.accelerator.is_main_process:
            merge = cfg.trainer.merge_export
            tmp = assets.atomic_dir(target)
            reference = self.model.config.base_model_name_or_path
            # Heads trained with an adapter must not silently load on the original backbone: they name
            # the merged folder, or nothing (then load_medusa2_export reads backbone.json).
            self.model.config.base_model_name_or_path = MERGED_DIR if merge else (None if self.joint else reference)
            try:
                self.model.save_pretrained(tmp)
            finally:
                self.model.config.base_model_name_or_path = reference
            if self.joint:
                # embeddings are never adapted; "auto" would look the base model up on the hub
                self.peft_model.save_pretrained(tmp / ADAPTER_DIR, save_embedding_layers=False)
            if merge:
                merged = merge_backbone(self.model.backbone, tmp / ADAPTER_DIR if self.joint else None,
                                        m.name_or_path, dtype=m.dtype, trust_remote_code=m.trust_remote_code,
                                        attn_implementation=m.attn_implementation)
                merged.save_pretrained(tmp / MERGED_DIR, safe_serialization=True)
                self.tokenizer.save_pretrained(tmp / MERGED_DIR)
                del merged
            info = {"base_model_name_or_path": str(m.name_or_path), "quantization": m.quantization,
                    "dtype": m.dtype, "bnb_compute_dtype": m.bnb_compute_dtype,
                    "bnb_double_quant": m.bnb_double_quant, "adapter": ADAPTER_DIR if self.joint else None,
                    "merged": MERGED_DIR if merge else None, "stage": cfg.stage}
            (tmp / BACKBONE_INFO).write_text(json.dumps(info, indent=2) + "\n")
            (tmp / "training_config.json").write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
            assets.replace_dir(tmp, target)
            self.log(f"exported heads{', adapter' if self.joint else ''}{', merged backbone' if merge else ''} "
                     f"to {target}")
        self.accelerator.wait_for_everyone()
        return target


def _base_record(bases: list[BaseMetrics]) -> dict[str, float]:
    """Token-weighted means of base figures, keyed ``base/ce``, ``base/kl``, ``base/top1``, ``base/agreement``."""
    n = sum(b.count for b in bases)
    if not n:
        return {}
    return {f"base/{name}": sum(getattr(b, name) * b.count for b in bases) / n
            for name in ("ce", "kl", "top1", "agreement")}
