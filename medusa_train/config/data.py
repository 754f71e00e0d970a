"""The ``data`` section of the training config (``configs/data/``): where conversations come from, how they are cut,
split and batched, and whether the frozen backbone's states are captured once. Read by training and by the capture
stage (``config/capture.py``), which embed it."""

from __future__ import annotations

from dataclasses import dataclass, field

from medusa_train.config.chat_template import chat_template_problem
from medusa_train.config.check import Problems, data_source_problem
from medusa_train.config.validation import ValidationConfig, check_validation


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
    #: the validation set: prompts of the prompt source held out of training (every copy), whose greedy
    #: continuations training walks its draft along and build-tree calibrates on (config/validation.py)
    validation: ValidationConfig = field(default_factory=ValidationConfig)


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
    p += check_validation(d.validation, "data.validation")
    if d.validation.source and (problem := data_source_problem("data.validation.source", d.validation.source)):
        p.append(problem)
    return p
