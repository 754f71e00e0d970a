"""Typed configuration of the capture stage (``medusa-train capture``): the sections of the training config it
reads, so ``medusa-train train`` with the same keys and ``data.cache_hidden_states=true`` finds what it wrote.

The command takes the training command's config (``configs/train.yaml`` and a recipe) and reads ``method``,
``model``, ``data``, ``eagle3`` and ``trainer.mixed_precision`` of it; the rest is training's. The ``data`` section
and the draft's settings are defined here, where the pipeline first reads them; the training config embeds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from medusa_train.config.chat_template import chat_template_problem
from medusa_train.config.check import Problems, data_source_problem, parse_config
from medusa_train.config.model import ModelConfig, check_model


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
class Eagle3Settings:
    """The EAGLE-3 draft of ``+recipe=eagle3`` (one decoder layer on three of the backbone's hidden states)."""

    ttt_steps: int = 7  #: chained draft steps trained (training-time test); step s weighs loss.head_decay**s
    #: the draft scores only the K tokens most often trained on (d2t maps them back); null: every token
    vocab_size: int | None = None
    #: the three backbone layers whose entering hidden state the draft reads (vLLM's count); null: (2, L//2, L-3)
    aux_layer_ids: list[int] | None = None
    intermediate_size: int | None = None  #: the draft MLP's width; null: the backbone's


@dataclass
class CaptureConfig:
    """What the capture stage reads of the training config."""

    method: str = "medusa1"  #: medusa1 / medusa2: the final hidden states; eagle3: the draft's three and the final
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eagle3: Eagle3Settings = field(default_factory=Eagle3Settings)
    mixed_precision: str = "bf16"  #: the training config's trainer.mixed_precision (autocast while capturing)


#: the training config's keys the capture stage reads (``trainer.mixed_precision`` becomes ``mixed_precision``)
CAPTURE_SECTIONS = ("method", "model", "data", "eagle3")


def capture_view(train: Any) -> CaptureConfig:
    """The capture stage's view of a parsed training config (any object with its sections)."""
    return CaptureConfig(method=train.method, model=train.model, data=train.data, eagle3=train.eagle3,
                         mixed_precision=train.trainer.mixed_precision)


def build_capture_config(raw: Any) -> CaptureConfig:
    """A validated ``CaptureConfig`` from the composed training config (a ``DictConfig`` or a plain dict)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(raw, DictConfig):
        raw = OmegaConf.to_container(raw, resolve=True)
    raw = dict(raw or {})
    picked = {key: raw[key] for key in CAPTURE_SECTIONS if key in raw}
    if "mixed_precision" in (raw.get("trainer") or {}):
        picked["mixed_precision"] = raw["trainer"]["mixed_precision"]
    return parse_config(CaptureConfig, picked, check_capture)


def check_capture(c: CaptureConfig) -> list[str]:
    """Problems of the sections capture reads, each naming its key."""
    p = Problems()
    p.need(c.method in ("medusa1", "medusa2", "eagle3"), "method", c.method, "must be medusa1, medusa2 or eagle3")
    p += check_model(c.model)
    p += check_placement(c.model)
    p += check_data(c.data)
    p += check_aux_layers(c.eagle3)
    p += check_mixed_precision(c.mixed_precision)
    return p


def check_placement(m: ModelConfig) -> list[str]:
    p = Problems()
    p.need(m.device_map in (None, "auto"), "model.device_map", m.device_map, "must be null or auto")
    return p


def check_data(d: DataConfig) -> list[str]:
    """Problems of a ``data`` section."""
    p = Problems()
    p.need(d.max_length >= 8, "data.max_length", d.max_length, "must be >= 8")
    if problem := data_source_problem("data.source", d.source):
        p.append(problem)
    if problem := chat_template_problem("data.chat_template", d.chat_template):
        p.append(problem)
    p.need(d.num_proc is None or d.num_proc >= 1, "data.num_proc", d.num_proc, "must be >= 1 or null")
    p.need(d.max_samples is None or d.max_samples >= 1, "data.max_samples", d.max_samples,
           "must be >= 1 or null (all)")
    p.need(d.eval_size >= 0, "data.eval_size", d.eval_size, "must be >= 0")
    p.need(d.batch_size >= 1, "data.batch_size", d.batch_size, "must be >= 1")
    p.need(d.eval_batch_size is None or d.eval_batch_size >= 1, "data.eval_batch_size", d.eval_batch_size,
           "must be >= 1")
    p.need(d.shard_bytes >= 1, "data.shard_bytes", d.shard_bytes, "must be >= 1")
    return p


def check_aux_layers(e: Eagle3Settings) -> list[str]:
    p = Problems()
    p.need(e.aux_layer_ids is None or (len(e.aux_layer_ids) == 3 and len(set(e.aux_layer_ids)) == 3
                                       and min(e.aux_layer_ids) >= 0), "eagle3.aux_layer_ids", e.aux_layer_ids,
           "must be three distinct layer indices >= 0, or null for vLLM's (2, L//2, L-3)")
    return p


def check_mixed_precision(value: str) -> list[str]:
    p = Problems()
    p.need(value in ("no", "bf16", "fp16"), "trainer.mixed_precision", value, "must be no, bf16 or fp16")
    return p
