"""Medusa-2: a 4-bit (QLoRA) backbone trained jointly with the heads.

    accelerate launch train.py +recipe=medusa2                   # NF4 backbone + LoRA + heads, jointly
    accelerate launch train.py +recipe=medusa2 debug=smoke     # a few steps on CPU
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

The export (``<output_dir>/export``: heads, LoRA adapter, ``backbone.json``, optionally a merged backbone) is
written by ``export/run.py`` from the trained recipe.

With several processes and ``model.fsdp=true`` (or accelerate's FSDP) the 4-bit backbone's decoder layers,
LoRA included, are sharded over the processes (FSDP-QLoRA, ``shard.py``): every process loads the 4-bit
backbone itself, keeps 1/N of each layer, and the heads stay whole, averaged by DDP as without sharding.
Checkpoints and the adapter export hold the LoRA weights whole, gathered from every process.

setup -> train -> cleanup (``export/run.py`` writes the export in between); shared parts are free functions in ``loop.py`` (this
recipe inherits from none).
"""


from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from medusa_train.backbone.load import load_backbone_for
from medusa_train.backbone.lora import add_lora
from medusa_train.config.train import TrainConfig
from medusa_train.data.examples import load_examples
from medusa_train.families.medusa import recipe
from medusa_train.families.medusa.layouts import MEDUSA_PARAMETERS
from medusa_train.model.family import captured_for
from medusa_train.training import loop, setup, validation_walk
from medusa_train.training.backbone_loss import (
    BaseMetrics,
    base_loss_backward,
    base_record,
    base_sums,
    base_term,
    from_sums,
)
from medusa_train.training.losses import LossResult
from medusa_train.training.recipe_base import RecipeBase
from medusa_train.training.shard import full, is_sharded, shard_backbone


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


@dataclass
class Medusa2LossResult(LossResult):
    """``LossResult`` of one joint micro-batch: ``loss`` is the combined ``L_base + lambda * L_heads``.

    Attributes:
        heads_loss: The heads' weighted loss ``sum_k w_k L_k``.
        head_weight: ``lambda`` used for this micro-batch.
        base: The backbone's own figures (``None`` without a base loss).
    """

    heads_loss: float = 0.0
    head_weight: float = 1.0
    base: BaseMetrics | None = None


class Medusa2Recipe(RecipeBase):
    """Medusa-2: a 4-bit NF4 (or int8) backbone with LoRA adapters, trained jointly with the heads.

    ``stage=1`` trains the heads only on the same quantized backbone (no LoRA; hidden states may be
    captured once); ``stage=2`` (or ``stage=null``) trains LoRA and heads jointly, stage 2 from
    ``heads.init_from``.
    """

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.joint = cfg.stage != 1
        self.step_metrics: dict[str, float] = {}
        self.window: list[Medusa2LossResult] = []

    # ------------------------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg, m = self.cfg, self.cfg.model
        self.accelerator = acc = setup.make_accelerator(cfg)
        sharded = setup.shards_backbone(cfg, acc)  # 4-bit weights stored as the compute dtype, to shard
        backbone, self.tokenizer = load_backbone_for(cfg.model, acc.device, sharded=sharded)
        self.peft_model = None
        if self.joint:
            p = cfg.peft
            backbone = self.peft_model = add_lora(backbone, p.r, p.alpha, p.dropout, p.target_modules,
                                                  gradient_checkpointing=p.gradient_checkpointing)
            n_lora = sum(t.numel() for t in backbone.parameters() if t.requires_grad)
            loop.say(acc, f"LoRA r={p.r} alpha={p.alpha} on {p.target_modules}: {n_lora / 1e6:.2f} M parameters "
                          f"on a {m.quantization or m.dtype} backbone; gradient checkpointing "
                          f"{'on' if p.gradient_checkpointing else 'off'} (peft.gradient_checkpointing)")
        if sharded:  # every process loaded it (with the same LoRA initialisation): each keeps its shards
            loop.say(acc, shard_backbone(backbone, acc.device, acc.num_processes, loaded_everywhere=True)
                     .summary(acc.num_processes))
        train, evals = load_examples(cfg.data, self.tokenizer, acc)
        self.model = recipe.build_heads(cfg, backbone, acc.device, train)
        self.validation = validation_walk.prepare(cfg, acc, self.tokenizer, backbone, captured_for(cfg), adapts=self.joint,
                                             sharded=sharded)
        data = setup.build_data(cfg, self.tokenizer, self.model, acc, train, evals)
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        lora = [p for n, p in named if not n.startswith(MEDUSA_PARAMETERS)]
        heads = [p for n, p in named if n.startswith(MEDUSA_PARAMETERS)]
        groups = [{"params": lora, "lr": cfg.optim.lr, "name": "lora"}] if lora else []  # first: its LR is logged
        groups.append({"params": heads, "lr": cfg.optim.lr * cfg.optim.head_lr_multiplier, "name": "heads"})
        metrics = loop.MetricsLog(Path(cfg.trainer.output_dir), acc, extra=lambda: self.step_metrics)
        self.run = loop.start_run(cfg, acc, self.model, data, groups, metrics, sharded)
        if self.joint and cfg.loss.base is None:
            loop.say(acc, "warning: loss.base=null: the backbone trains on the heads' loss alone and may drift freely")

    # ------------------------------------------------------------------------------------ train
    def train(self) -> dict:
        """Train to the configured steps; returns the last eval record."""
        return loop.train_loop(self.run, self.micro_step, self.evaluate, on_step=self.note_step)

    def head_weight(self) -> float:
        """``lambda`` at the current optimizer step."""
        loss = self.cfg.loss
        return head_weight_at(self.run.step, loss.head_weight, loss.head_warmup_steps, loss.head_warmup)

    @torch.no_grad()
    def original_hidden_states(self, batch: dict) -> torch.Tensor:
        """Hidden states of the original model: the same model with its adapters disabled (eval mode)."""
        self.model.eval()
        with self.peft_model.disable_adapter(), self.accelerator.autocast():
            return self.model(batch["input_ids"], attention_mask=batch["attention_mask"]).hidden_states

    def micro_step(self, batch: dict, loss_scale: float) -> LossResult:
        """Stage 1: the heads' loss on the frozen backbone. Joint: ``L_base + lambda * L_heads``, with one
        backward through the backbone for the base loss and every head."""
        batch = {k: v.to(self.accelerator.device) for k, v in batch.items()}
        if not self.joint:
            return loop.backward_step(self.run, lambda: recipe.heads_loss(
                self.run, loop.hidden_states(self.run, batch), batch["labels"], self.accelerator.backward, loss_scale)[0])
        result = loop.backward_step(self.run, lambda: self.joint_step(batch, loss_scale))
        self.window.append(result)
        return result

    def joint_step(self, batch: dict, loss_scale: float) -> Medusa2LossResult:
        """``L_base + lambda * L_heads`` of one micro-batch, forward and backward."""
        cfg, acc = self.cfg, self.accelerator
        lam = self.head_weight()
        original = self.original_hidden_states(batch) if cfg.loss.base == "distill" else None
        self.model.train()  # LoRA dropout on
        hidden = loop.hidden_states(self.run, batch, grad=True)
        leaf = hidden.detach().requires_grad_(True)
        base = None
        if cfg.loss.base is not None:
            with acc.autocast():
                base = base_loss_backward(self.model.base_logits, leaf, batch["labels"], cfg.loss.base, original,
                                          cfg.loss.chunk_size, backward=acc.backward, loss_scale=loss_scale)
        # a teacher reads the adapted model
        heads, _ = recipe.heads_loss(self.run, leaf, batch["labels"], acc.backward if lam > 0 else None,
                                   loss_scale * lam)
        if leaf.grad is not None:
            hidden.backward(leaf.grad)  # one backward through the backbone for the base loss and every head
        total = base_term(base, cfg.loss.base) + lam * float(heads.loss)
        return Medusa2LossResult(loss=torch.tensor(total), per_head=heads.per_head, heads_loss=float(heads.loss),
                                 head_weight=lam, base=base)

    def note_step(self) -> None:
        """The last optimizer step's Medusa-2 figures, added to the next train record."""
        window, self.window = self.window, []
        self.step_metrics = {"lr_heads": self.run.scheduler.get_last_lr()[-1]}
        if window:
            heads = torch.tensor([sum(r.heads_loss for r in window), len(window)], dtype=torch.float64)
            sums = torch.cat([heads, base_sums([r.base for r in window if r.base is not None])])
            acc = self.accelerator
            if acc.num_processes > 1:  # every process's micro-batches, as the step's loss is
                sums = acc.reduce(sums.to(acc.device), reduction="sum").cpu()
            self.step_metrics.update(heads_loss=sums[0].item() / sums[1].item(), head_weight=window[-1].head_weight,
                                     **base_record(from_sums(sums[2:])))

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Heads' loss and accuracy; jointly also the backbone's CE, KL to the original and agreement with it."""
        cfg, acc, k_heads = self.cfg, self.accelerator, self.model.num_heads
        sums = loop.HeadEvalSums(k_heads)
        base_totals = base_sums([])
        for batch in loop.eval_batches(self.run):
            original = self.original_hidden_states(batch) if self.joint else None
            hidden = loop.hidden_states(self.run, batch)
            sums.add(*recipe.heads_loss(self.run, hidden, batch["labels"], None))
            if self.joint:
                with acc.autocast():
                    base = base_loss_backward(self.model.base_logits, hidden, batch["labels"], None, original,
                                              cfg.loss.chunk_size, backward=None)
                base_totals += base_sums([base])
        record = sums.record(self.run)
        message = f"eval @ step {self.run.step}: loss {record['loss']:.4f}"
        if self.joint:
            if acc.num_processes > 1:
                base_totals = acc.reduce(base_totals.to(acc.device), reduction="sum").cpu()
            base = from_sums(base_totals)
            lam = self.head_weight()
            heads_loss = record["loss"]
            record.update(heads_loss=heads_loss, head_weight=lam, **base_record(base))
            record["loss"] = base_term(base, cfg.loss.base) + lam * heads_loss
            message = (f"eval @ step {self.run.step}: loss {record['loss']:.4f}; backbone KL to original {base.kl:.5f}, "
                       f"CE {base.ce:.4f}, top-1 agreement {base.agreement:.4f}")
        loop.say(acc, f"{message}; top-1 by head {loop.top1_summary(record, k_heads)}")
        record.update(validation_walk.walk(self.validation, self.model, acc))
        self.run.metrics.write(record)
        return record

    def whole_adapter(self) -> dict[str, torch.Tensor] | None:
        """The LoRA weights whole, gathered from every process, when they are sharded (``None`` when they are not:
        peft reads them from the model). A collective: every process calls it."""
        named = [(n, p) for n, p in self.peft_model.named_parameters() if p.requires_grad]
        if not any(is_sharded(p) for _, p in named):
            return None
        return {n: full(p.detach()).cpu() for n, p in named}

    def adapted_backbone(self):
        """The export rebuilds the backbone this run adapted (its adapter, or its whole weights)."""
        from medusa_train.training.run_folder import AdaptedBackbone

        return AdaptedBackbone(self.joint, self.peft_model, self.tokenizer, self.whole_adapter)
