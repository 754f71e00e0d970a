"""Typed training configuration: the schema behind ``configs/``, checked before any heavy work.

Hydra composes YAML into a plain mapping; ``build_config`` turns it into these dataclasses and
reports every problem at once, each with the key to change (``heads.num_heads=0: must be >= 1``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from medusa_train.config.chat_template import chat_template_problem
from medusa_train.config.check import (
    Problems,
    data_source_problem,
    parse_config,
)
from medusa_train.config.dtype import parse_dtype


@dataclass
class ModelConfig:
    name_or_path: str = "packaged:smollm2-135m-instruct"  #: local HF folder, hub id, .gguf, or packaged:NAME
    dtype: str = "bfloat16"  #: backbone weight dtype: bfloat16 | float32 | float16 (or bf16, fp32, fp16)
    quantization: str | None = None  #: null | nf4 | int8 (bitsandbytes; the medusa2 recipe uses nf4)
    trust_remote_code: bool = False  #: allow custom modeling code shipped with the model
    #: sdpa | eager | flash_attention_2 | flash_attention_3 (installed, CUDA, bf16/fp16) | null (transformers' default)
    attn_implementation: str | None = "sdpa"
    bnb_compute_dtype: str | None = None  #: compute dtype of 4-bit layers (default: dtype)
    bnb_double_quant: bool = True  #: double-quantise the 4-bit scales
    #: null (one device per process) | auto (accelerate's big-model placement over every GPU, then CPU and
    #: disk: for a backbone larger than one device, in medusa-train capture with one process)
    device_map: str | None = None
    #: with several processes: shard the backbone's decoder layers over them (FSDP2), each process holding 1/N of
    #: them (medusa1: the frozen backbone; medusa2: the NF4 layers with their LoRA, FSDP-QLoRA); the heads stay
    #: whole on every process. Implied by accelerate's FSDP (configs/accelerate/fsdp.yaml)
    fsdp: bool = False


@dataclass
class DataConfig:
    source: str = "packaged:sharegpt-v3"  #: json/jsonl file (ShareGPT or messages records), hub id, or packaged:NAME
    max_samples: int | None = None  #: use the first N conversations (null = all; data=sharegpt: 2000)
    max_length: int = 2048  #: tokens per example after the chat template (longer ones are cut; data=sharegpt: 512)
    #: Jinja chat template (its text, or a file holding it) used instead of the tokenizer's; null: the tokenizer's
    chat_template: str | None = None
    num_proc: int | None = None  #: processes tokenising (null: the CPUs, at most 8); the result is cached on disk
    eval_size: int = 64  #: held-out conversations for periodic eval
    batch_size: int = 4  #: examples per device per micro-batch
    eval_batch_size: int | None = None  #: default: batch_size
    seed: int = 0  #: train/eval split and shuffling seed
    #: medusa1 and eagle3: run the frozen backbone once, train from its captured states (eagle3: the three states
    #: the draft reads, the final one and the token ids)
    cache_hidden_states: bool = False
    cache_dir: str | None = None  #: where hidden-state caches go (default: $MEDUSA_TRAIN_CACHE/hidden)
    #: bytes of hidden states + labels per capture shard (medusa-train capture; each process holds one whole shard
    #: in host memory while writing it): 2**30 = 1 GiB, about 131k tokens at hidden 4096 in bf16
    shard_bytes: int = 1073741824


@dataclass
class HeadsConfig:
    num_heads: int = 4  #: Medusa heads; head k predicts the token k+2 ahead
    num_layers: int = 1  #: ResBlocks per head
    share_lm_head: bool = False  #: project through the frozen LM head instead of a trainable clone
    init_from: str | None = None  #: start from heads saved earlier (an export folder)
    next_token_input: bool = False  #: heads also read the base model's next token (native export only)
    path_input: bool = False  #: with next_token_input: head k reads the k+1 tokens of its tree path (Hydra-style)
    prefix_attention: bool = False  #: heads read through one causal attention layer over the prefix (native export only)
    #: heads score only the K most frequent training targets (a draft vocabulary, token_map); null: every token.
    #: The verify pass keeps the whole vocabulary, so greedy output is unchanged. Native and vllm export only.
    vocab_size: int | None = None


@dataclass
class Eagle3Settings:
    """The EAGLE-3 draft of ``+recipe=eagle3`` (one decoder layer on three of the backbone's hidden states)."""

    ttt_steps: int = 7  #: chained draft steps trained (training-time test); step s weighs loss.head_decay**s
    #: the draft scores only the K tokens most often trained on (d2t maps them back); null: every token
    vocab_size: int | None = None
    #: the three backbone layers whose entering hidden state the draft reads (vLLM's count); null: (2, L//2, L-3)
    aux_layer_ids: list[int] | None = None
    intermediate_size: int | None = None  #: the draft MLP's width; null: the backbone's


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
    save_every: int = 200  #: optimizer steps between checkpoints (0 = only at the end)
    keep_last: int = 2  #: checkpoints kept
    eval_every: int = 200  #: optimizer steps between evals (0 = only at start and end)
    log_every: int = 10  #: optimizer steps between metric lines
    mixed_precision: str = "bf16"  #: no | bf16 | fp16 (autocast)
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


@dataclass
class TrainConfig:
    method: str = "medusa1"  #: medusa1 (frozen backbone) | medusa2 (QLoRA backbone + heads) | eagle3 (a draft layer)
    stage: int | None = None  #: medusa2 two-stage option: 1 = heads only, 2 = joint
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    heads: HeadsConfig = field(default_factory=HeadsConfig)
    eagle3: Eagle3Settings = field(default_factory=Eagle3Settings)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    logger: LoggerConfig | None = None  #: null | wandb


def build_config(raw: Any) -> TrainConfig:
    """A validated ``TrainConfig`` (see ``parse_config``)."""
    return parse_config(TrainConfig, raw, check)


def check_model(m: ModelConfig) -> list[str]:
    """Problems of a ``model`` section (shared by training and distillation), each naming its key; its dtypes
    are stored by their canonical names (``bf16`` -> ``bfloat16``)."""
    problems: list[str] = []
    parse_dtype(problems, m, "model.dtype")
    parse_dtype(problems, m, "model.bnb_compute_dtype", "bnb_compute_dtype", optional=True)
    rules = [(bool(m.name_or_path), "name_or_path", m.name_or_path, "must name a model"),
             (m.quantization in (None, "nf4", "int8"), "quantization", m.quantization, "must be null, nf4 or int8"),
             (m.attn_implementation in (None, "sdpa", "eager", *FLASH_ATTENTION), "attn_implementation",
              m.attn_implementation, f"must be sdpa, eager, {', '.join(FLASH_ATTENTION)} or null")]
    if m.attn_implementation in FLASH_ATTENTION:
        rules += [(m.dtype != "float32", "attn_implementation", m.attn_implementation,
                   "runs in bfloat16 or float16 only: set model.dtype=bfloat16, or use model.attn_implementation=sdpa"),
                  (flash_attention_available(m.attn_implementation), "attn_implementation", m.attn_implementation,
                   f"not available here: it needs CUDA and {FLASH_ATTENTION[m.attn_implementation]}, "
                   "or use model.attn_implementation=sdpa")]
    return problems + [f"model.{key}={value!r}: {rule}" for ok, key, value, rule in rules if not ok]


#: attention kernels training, distillation and capture may use, and what each needs installed
FLASH_ATTENTION = {"flash_attention_2": "the flash-attn package: pip install flash-attn --no-build-isolation",
                   "flash_attention_3": "FlashAttention-3: install flash_attn_interface from flash-attention's hopper/"}


def flash_attention_available(name: str) -> bool:
    """Whether transformers can run ``name`` (``flash_attention_2`` / ``_3``) here: package installed, CUDA present."""
    from transformers import utils

    return utils.is_flash_attn_3_available() if name == "flash_attention_3" else utils.is_flash_attn_2_available()


def fsdp_problems(c: TrainConfig, fsdp: bool | None = None) -> list[str]:
    """What ``model.fsdp`` (or accelerate's FSDP, ``fsdp=True``) cannot run with, each naming the key to change.

    Medusa-1 shards a frozen unquantized backbone; Medusa-2 (FSDP-QLoRA) a 4-bit NF4 one with its LoRA."""
    if not (c.model.fsdp if fsdp is None else fsdp):
        return []
    name = "model.fsdp=true" if fsdp is None else "accelerate's FSDP"
    q = c.model.quantization
    if c.method == "medusa2":
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


def eagle3_problems(c: TrainConfig) -> list[str]:
    """What ``+recipe=eagle3`` needs: a frozen unquantized backbone on each process, the backbone's distribution as
    target, a draft it can build."""
    e = c.eagle3
    if c.method != "eagle3":
        return []
    p = Problems()
    p.need(e.ttt_steps >= 1, "eagle3.ttt_steps", e.ttt_steps, "must be >= 1")
    p.need(e.vocab_size is None or e.vocab_size >= 1, "eagle3.vocab_size", e.vocab_size,
           "must be >= 1 (the draft vocabulary's size), or null for the whole vocabulary")
    p.need(e.aux_layer_ids is None or (len(e.aux_layer_ids) == 3 and len(set(e.aux_layer_ids)) == 3
                                       and min(e.aux_layer_ids) >= 0), "eagle3.aux_layer_ids", e.aux_layer_ids,
           "must be three distinct layer indices >= 0, or null for vLLM's (2, L//2, L-3)")
    p.need(e.intermediate_size is None or e.intermediate_size >= 1, "eagle3.intermediate_size", e.intermediate_size,
           "must be >= 1 or null")
    p.need(c.loss.targets == "teacher", "loss.targets", c.loss.targets,
           "an EAGLE-3 draft learns the backbone's distribution: use loss.targets=teacher (+recipe=eagle3 sets it)")
    p.need(c.model.quantization is None, "model.quantization", c.model.quantization,
           "the EAGLE-3 recipe reads a frozen unquantized backbone: drop model.quantization")
    p.need(not c.model.fsdp, "model.fsdp", True, "the EAGLE-3 recipe does not shard the backbone: drop model.fsdp")
    return p


def check(c: TrainConfig) -> list[str]:
    """Range and consistency checks; returns every problem found."""
    p = Problems()
    p.need(c.method in ("medusa1", "medusa2", "eagle3"), "method", c.method, "must be medusa1, medusa2 or eagle3")
    p += eagle3_problems(c)
    p.need(c.stage in (None, 1, 2), "stage", c.stage, "must be null, 1 or 2")
    p.need(c.stage is None or c.method == "medusa2", "stage", c.stage, "only applies to +recipe=medusa2")
    p.need(not (c.method == "medusa2" and c.stage == 2 and not c.heads.init_from), "heads.init_from", None,
           "stage=2 starts from stage 1's heads: set heads.init_from=<stage-1 output_dir>/export")
    p += check_model(c.model)
    p.need(c.heads.num_heads >= 1, "heads.num_heads", c.heads.num_heads, "must be >= 1")
    p.need(c.heads.num_layers >= 0, "heads.num_layers", c.heads.num_layers, "must be >= 0")
    p.need(c.heads.vocab_size is None or c.heads.vocab_size >= 1, "heads.vocab_size", c.heads.vocab_size,
           "must be >= 1 (the draft vocabulary's size), or null for the whole vocabulary")
    p.need(not c.heads.next_token_input or c.heads.num_layers >= 1, "heads.next_token_input", True,
           "the next token enters the first ResBlock: needs heads.num_layers >= 1")
    p.need(not c.heads.path_input or c.heads.next_token_input, "heads.path_input", True,
           "the path starts with the next token: needs heads.next_token_input=true")
    p.need(c.data.max_length >= 8, "data.max_length", c.data.max_length, "must be >= 8")
    if problem := data_source_problem("data.source", c.data.source):
        p.append(problem)
    if problem := chat_template_problem("data.chat_template", c.data.chat_template):
        p.append(problem)
    p.need(c.data.num_proc is None or c.data.num_proc >= 1, "data.num_proc", c.data.num_proc, "must be >= 1 or null")
    p.need(c.data.max_samples is None or c.data.max_samples >= 1, "data.max_samples", c.data.max_samples,
           "must be >= 1 or null (all)")
    p.need(c.data.eval_size >= 0, "data.eval_size", c.data.eval_size, "must be >= 0")
    p.need(c.data.batch_size >= 1, "data.batch_size", c.data.batch_size, "must be >= 1")
    p.need(c.data.eval_batch_size is None or c.data.eval_batch_size >= 1, "data.eval_batch_size",
           c.data.eval_batch_size, "must be >= 1")
    p.need(not (c.data.cache_hidden_states and c.method == "medusa2" and c.stage != 1), "data.cache_hidden_states",
           True, "needs a frozen backbone: use it with +recipe=medusa1 (or medusa2 stage=1)")
    p.need(c.model.device_map in (None, "auto"), "model.device_map", c.model.device_map, "must be null or auto")
    p += fsdp_problems(c)
    p.need(c.data.shard_bytes >= 1, "data.shard_bytes", c.data.shard_bytes, "must be >= 1")
    p.need(0.0 < c.loss.head_decay <= 1.0, "loss.head_decay", c.loss.head_decay, "must be in (0, 1]")
    p.need(c.loss.chunk_size is None or c.loss.chunk_size >= 1, "loss.chunk_size", c.loss.chunk_size,
           "must be >= 1 or null")
    p.need(c.loss.targets in ("text", "greedy", "teacher"), "loss.targets", c.loss.targets,
           "must be text, greedy or teacher")
    p.need(c.loss.targets != "greedy" or c.method == "medusa1" or c.stage == 1, "loss.targets", c.loss.targets,
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
    p.need(c.trainer.mixed_precision in ("no", "bf16", "fp16"), "trainer.mixed_precision", c.trainer.mixed_precision,
           "must be no, bf16 or fp16")
    p.need(bool(c.trainer.output_dir), "trainer.output_dir", c.trainer.output_dir, "must be set")
    p.need(c.trainer.merge_into in ("original", "dequantized"), "trainer.merge_into", c.trainer.merge_into,
           "must be original or dequantized")
    p.need(c.peft.r >= 1, "peft.r", c.peft.r, "must be >= 1")
    p.need(0 <= c.peft.dropout < 1, "peft.dropout", c.peft.dropout, "must be in [0, 1)")
    p.need(c.heads.init_from is None or os.path.isdir(c.heads.init_from), "heads.init_from", c.heads.init_from,
           "must be an existing folder of exported heads")
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
