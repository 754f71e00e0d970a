"""Typed training configuration: the schema behind ``configs/``, checked before any heavy work.

Hydra composes YAML into a plain mapping; ``build_config`` turns it into these dataclasses and
reports every problem at once, each with the key to change (``heads.num_heads=0: must be >= 1``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from medusa_train.config.capture import check_mixed_precision, check_placement
from medusa_train.config.check import Problems, parse_config
from medusa_train.config.data import DataConfig, check_data
from medusa_train.config.methods import METHODS, draft_settings_problems, method_choices, with_draft_settings
from medusa_train.config.model import ModelConfig, check_model


@dataclass
class LossConfig:
    head_decay: float = 0.8  #: weight of head k is head_decay**k (normalised to sum 1)
    chunk_size: int | None = None  #: split the sequence so at most chunk x vocab logits exist at once
    #: text (the data's next tokens) | greedy (the frozen backbone's greedy continuation)
    #: | teacher (the backbone's whole next-token distribution: soft labels)
    targets: str = "text"
    base: str | None = None  #: medusa2: null (heads only) | ce | distill (KL to the adapter-free model)
    head_weight: float = 0.2  #: medusa2: lambda, the heads' weight after warm-up
    head_warmup_steps: int = 0  #: medusa2: steps over which lambda rises from 0
    head_warmup: str = "linear"  #: medusa2: linear | sine


@dataclass
class OptimConfig:
    lr: float = 1e-3  #: peak learning rate (of the heads in medusa1; of the backbone in medusa2)
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_ratio: float = 0.05  #: fraction of steps for linear warm-up (ignored when warmup_steps is set)
    warmup_steps: int | None = None
    min_lr_ratio: float = 0.0  #: cosine decays to lr * min_lr_ratio
    max_grad_norm: float | None = 1.0  #: gradient clipping (null = off)
    grad_accum_steps: int = 1  #: micro-batches per optimizer step
    head_lr_multiplier: float = 1.0  #: medusa2: heads' LR = lr * this


@dataclass
class TrainerConfig:
    output_dir: str = "outputs/medusa1"  #: everything a run writes goes here
    epochs: int = 1  #: passes over the training set (ignored when max_steps is set)
    max_steps: int | None = None  #: optimizer steps; overrides epochs
    resume: str = "auto"  #: auto (latest checkpoint in output_dir) | never | path to a checkpoint
    #: continue the checkpoint with this run's settings where they differ (otherwise refused, naming the keys); the
    #: new settings take effect and metrics.jsonl records which changed
    resume_new_settings: bool = False
    save_every: int = 200  #: optimizer steps between checkpoints (0 = only at the end)
    keep_last: int = 2  #: checkpoints kept
    eval_every: int = 200  #: optimizer steps between evals (0 = only at start and end)
    log_every: int = 10  #: optimizer steps between metric lines
    mixed_precision: str = "bfloat16"  #: no | bfloat16 | float16: autocast's dtype (spelled as model.dtype is)
    seed: int = 42
    export: bool = True  #: write <output_dir>/export at the end
    merge_export: bool = False  #: medusa2: also write export/merged, a standalone backbone with the LoRA merged
    #: medusa2, merged/: original (the LoRA added to the unquantized weights of model.name_or_path) | dequantized
    #: (added to the 4-bit weights dequantized: exactly the model that trained, with its quantization loss)
    merge_into: str = "original"


@dataclass
class PeftConfig:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] | str = "all-linear"  #: module names, or all-linear (every projection but lm_head)
    #: recompute the backbone's activations in the backward pass (same gradients, ~1/3 more compute): at 8B x 2048
    #: tokens the activations do not fit without it; false is faster where they do (small models, CPU)
    gradient_checkpointing: bool = True


@dataclass
class LoggerConfig:
    project: str = "medusa-train"  #: W&B project
    entity: str | None = None
    name: str | None = None  #: run name (default: W&B's)
    tags: list[str] = field(default_factory=list)


@with_draft_settings(after="data")  # each family's draft settings section (heads, eagle3: config/methods.py)
@dataclass
class TrainConfig:
    #: a training method, config/methods.py's table (medusa1, medusa2, eagle3)
    method: str = "medusa1"
    stage: int | None = None  #: a method that adapts the backbone (medusa2), in two stages: 1 = draft only, 2 = joint
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    logger: LoggerConfig | None = None  #: null | wandb


def build_config(raw: Any) -> TrainConfig:
    """A validated ``TrainConfig`` (see ``parse_config``)."""
    return parse_config(TrainConfig, raw, check)


def fsdp_problems(c: TrainConfig, fsdp: bool | None = None) -> list[str]:
    """What ``model.fsdp`` (or accelerate's FSDP, ``fsdp=True``) cannot run with, each naming the key to change.

    Medusa-1 shards a frozen unquantized backbone; Medusa-2 (FSDP-QLoRA) a 4-bit NF4 one with its LoRA."""
    if not (c.model.fsdp if fsdp is None else fsdp):
        return []
    name = "model.fsdp=true" if fsdp is None else "accelerate's FSDP"
    q = c.model.quantization
    if METHODS[c.method].adapts_backbone:
        rules = [(q == "nf4", f"model.quantization={q}",
                  "Medusa-2 shards a 4-bit NF4 backbone (FSDP-QLoRA: its packed weights stored as the compute "
                  "dtype); 8-bit weights and an unquantized backbone are not sharded: set model.quantization=nf4, "
                  "or drop model.fsdp (each process then holds the whole backbone, configs/accelerate/ddp.yaml)"),
                 (not (c.trainer.merge_export and c.trainer.merge_into == "dequantized"),
                  "trainer.merge_into=dequantized",
                  "the 4-bit weights are sharded over the processes, so none holds them whole to dequantize: "
                  "use trainer.merge_into=original (the LoRA merged into the original weights), or "
                  "trainer.merge_export=false")]
    else:
        rules = [(q is None, f"model.quantization={q}",
                  "Medusa-1 shards an unquantized frozen backbone: drop model.quantization "
                  "(a 4-bit backbone is sharded by +recipe=medusa2)")]
    rules += [(c.model.device_map is None, f"model.device_map={c.model.device_map}",
               "FSDP places the layers itself: drop model.device_map"),
              (not c.data.cache_hidden_states, "data.cache_hidden_states=true",
               "training on captured states never runs the backbone, so there is nothing to shard: capture a "
               "backbone larger than one device with one process and model.device_map=auto (medusa-train capture), "
               "then train without FSDP")]
    return [f"{name} with {key}: {why}" for ok, key, why in rules if not ok]


def check(c: TrainConfig) -> list[str]:
    """Range and consistency checks; returns every problem found."""
    p = Problems()
    if c.method not in METHODS:
        p.append(f"method={c.method}: {method_choices()}")
        return p  # every other check depends on what the method trains
    m = METHODS[c.method]
    p += m.problems(c) if m.problems else []
    adapting = [name for name, row in METHODS.items() if row.adapts_backbone]
    p.need(c.stage in (None, 1, 2), "stage", c.stage, "must be null, 1 or 2")
    p.need(c.stage is None or m.adapts_backbone, "stage", c.stage,
           f"only applies to a method that adapts the backbone (+recipe={'|'.join(adapting)})")
    p += check_model(c.model)
    p += check_placement(c.model)
    p += draft_settings_problems(c)
    p += check_data(c.data)
    p.need(not (c.data.cache_hidden_states and m.trains_backbone(c.stage)), "data.cache_hidden_states",
           True, "needs a frozen backbone: use it with +recipe=medusa1 (or medusa2 stage=1)")
    p += fsdp_problems(c)
    p.need(0.0 < c.loss.head_decay <= 1.0, "loss.head_decay", c.loss.head_decay, "must be in (0, 1]")
    p.need(c.loss.chunk_size is None or c.loss.chunk_size >= 1, "loss.chunk_size", c.loss.chunk_size,
           "must be >= 1 or null")
    p.need(c.loss.targets in ("text", "greedy", "teacher"), "loss.targets", c.loss.targets,
           "must be text, greedy or teacher")
    p.need(c.loss.targets != "greedy" or not m.trains_backbone(c.stage), "loss.targets", c.loss.targets,
           "greedy targets come from a frozen backbone: use +recipe=medusa1 (or medusa2 stage=1)")
    p.need(c.loss.base in (None, "ce", "distill"), "loss.base", c.loss.base, "must be null, ce or distill")
    p.need(c.loss.head_weight >= 0, "loss.head_weight", c.loss.head_weight, "must be >= 0")
    p.need(c.loss.head_warmup_steps >= 0, "loss.head_warmup_steps", c.loss.head_warmup_steps, "must be >= 0")
    p.need(c.loss.head_warmup in ("linear", "sine"), "loss.head_warmup", c.loss.head_warmup, "must be linear or sine")
    p.need(c.optim.lr > 0, "optim.lr", c.optim.lr, "must be > 0")
    p.need(c.optim.weight_decay >= 0, "optim.weight_decay", c.optim.weight_decay, "must be >= 0")
    p.need(len(c.optim.betas) == 2 and all(0 <= b < 1 for b in c.optim.betas), "optim.betas", c.optim.betas,
           "must be two numbers in [0, 1)")
    p.need(0 <= c.optim.warmup_ratio < 1, "optim.warmup_ratio", c.optim.warmup_ratio, "must be in [0, 1)")
    p.need(c.optim.warmup_steps is None or c.optim.warmup_steps >= 0, "optim.warmup_steps", c.optim.warmup_steps,
           "must be >= 0")
    p.need(0 <= c.optim.min_lr_ratio <= 1, "optim.min_lr_ratio", c.optim.min_lr_ratio, "must be in [0, 1]")
    p.need(c.optim.max_grad_norm is None or c.optim.max_grad_norm > 0, "optim.max_grad_norm", c.optim.max_grad_norm,
           "must be > 0 or null")
    p.need(c.optim.grad_accum_steps >= 1, "optim.grad_accum_steps", c.optim.grad_accum_steps, "must be >= 1")
    p.need(c.optim.head_lr_multiplier > 0, "optim.head_lr_multiplier", c.optim.head_lr_multiplier, "must be > 0")
    p.need(c.trainer.epochs >= 1, "trainer.epochs", c.trainer.epochs, "must be >= 1")
    p.need(c.trainer.max_steps is None or c.trainer.max_steps >= 1, "trainer.max_steps", c.trainer.max_steps,
           "must be >= 1 or null (use epochs)")
    p.need(c.trainer.resume in ("auto", "never") or os.path.isdir(c.trainer.resume), "trainer.resume",
           c.trainer.resume, "must be auto, never, or an existing checkpoint folder")
    for key in ("save_every", "eval_every"):
        p.need(getattr(c.trainer, key) >= 0, f"trainer.{key}", getattr(c.trainer, key), "must be >= 0")
    p.need(c.trainer.keep_last >= 1, "trainer.keep_last", c.trainer.keep_last, "must be >= 1")
    p.need(c.trainer.log_every >= 1, "trainer.log_every", c.trainer.log_every, "must be >= 1")
    p += check_mixed_precision(c.trainer)
    p.need(bool(c.trainer.output_dir), "trainer.output_dir", c.trainer.output_dir, "must be set")
    p.need(c.trainer.merge_into in ("original", "dequantized"), "trainer.merge_into", c.trainer.merge_into,
           "must be original or dequantized")
    p.need(c.peft.r >= 1, "peft.r", c.peft.r, "must be >= 1")
    p.need(0 <= c.peft.dropout < 1, "peft.dropout", c.peft.dropout, "must be in [0, 1)")
    if c.logger is not None:
        p += wandb_problems()
    return p


def wandb_problems() -> list[str]:
    """W&B without a key and without WANDB_MODE fails deep inside a run; say how to choose, up front."""
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return []
    netrc = os.path.expanduser(os.environ.get("NETRC", "~/.netrc"))
    if os.path.isfile(netrc) and "api.wandb.ai" in open(netrc, encoding="utf-8", errors="ignore").read():
        return []
    return ["logger=wandb: no W&B API key found. Run `wandb login` (or set WANDB_API_KEY), or set "
            "WANDB_MODE=offline to log locally and `wandb sync` later, or WANDB_MODE=disabled, or use logger=null"]


def to_dict(config: TrainConfig) -> dict:
    """Plain nested dict of the config (for W&B, checkpoints and the exported training config)."""
    return dataclasses.asdict(config)
