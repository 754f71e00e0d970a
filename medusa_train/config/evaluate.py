"""Typed configuration of ``medusa-train evaluate`` (``configs/commands/evaluate.yaml``) and its range checks.

The checks here need nothing but the values. Those that read the heads folder, resolve the tree or
look for the benchmark file live with the command (``medusa_train.cli.evaluate``), which runs both
sets together so every problem is reported at once, before anything heavy loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from medusa_train.config.check import Problems
from medusa_train.config.dtype import parse_dtype
from medusa_train.config.engine import ServedConfig, ServerConfig, check_server
from medusa_train.config.model import EvalModelConfig, check_decoder_attention
from medusa_train.config.paths import heads_name, take_draft_alias


@dataclass
class BenchConfig:
    source: str = "packaged:mt-bench"  #: packaged:mt-bench or a .jsonl of prompts (see data/benchmarks.py)
    limit: int | None = None  #: N prompts (null = all)
    pick: str = "spread"  #: which N: spread (round-robin over categories) | first (file order)
    turns: int = 2  #: turns asked per prompt (MT-Bench has 2; turn 2 follows the plain answer to turn 1)
    #: the evaluation sized to the machine: no prompt starts after this many minutes of it (the prompt-lookup sweep
    #: and the warm-up counted, loading the model not); the prompts decoded are the first of those picked, every
    #: method on each, and the report says how many (``prompts``). null: all
    max_minutes: float | None = None
    #: a tree with a lookup chain also decoded by each branch alone (its draft's nodes; the chain), on every prompt:
    #: what each buys. false: the tree alone, two decodes a prompt fewer (build-tree's guard compared the three on its
    #: calibration prompts; ``medusa-train demo`` turns them off where they would crowd out the prompts)
    branches: bool = True


@dataclass
class DecodeConfig:
    max_new_tokens: int = 256
    temperature: float = 0.0  #: 0 = greedy (lossless, mismatches counted)
    acceptance: str = "greedy"  #: greedy | typical | rejection
    top_p: float = 1.0
    typical_threshold: float = 0.09
    typical_alpha: float = 0.3
    seed: int = 0  #: sampling seed (temperature > 0)
    #: one static KV cache and the backbone's pass over each tree size captured once in a CUDA graph and replayed,
    #: as a server steps (decoding/graphs.py), with a "plain, graphed" row beside HF generate; null: on CUDA
    cuda_graphs: bool | None = None


@dataclass
class BaselinesConfig:
    """The free baselines decoded beside the heads, prompt by prompt in the same process."""

    prompt_lookup: bool = True  #: also decode with HF transformers' prompt lookup (no training at all)
    prompt_lookup_num_tokens: int | None = None  #: its prompt_lookup_num_tokens (null: chosen by the sweep)
    prompt_lookup_ngram_size: int | None = None  #: its max_matching_ngram_size (null: chosen by the sweep)
    sweep_num_tokens: list[int] = field(default_factory=lambda: [3, 5, 10])  #: prompt_lookup_num_tokens values swept
    sweep_ngram_sizes: list[int] = field(default_factory=lambda: [2, 3])  #: prompt_lookup_ngram_size values swept
    sweep_prompts: int = 3  #: first turns the sweep times each setting on (the evaluation's first prompts)
    sweep_max_new_tokens: int = 64  #: tokens per sweep reply


@dataclass
class DriftConfig:
    """How far the evaluated backbone is from an original one (Medusa-2), on the benchmark's first turns."""

    #: null (skip) | auto (Medusa-2 export: the original model, unquantized; for an export merged with
    #: trainer.merge_into=dequantized, the 4-bit base it started from, rebuilt without peft or bitsandbytes)
    #: | a model name or path
    original: str | None = None
    max_new_tokens: int = 64  #: length of the original's greedy answer to each prompt
    limit: int | None = None  #: prompts compared (null = every evaluated prompt)


@dataclass
class EvalConfig:
    draft: str | None = None  #: a draft folder: exported Medusa heads or an EAGLE-3 draft (``draft=`` also)
    heads: str | None = None  #: ``draft=``'s other name (config/paths.py ``DRAFT_ALIAS``)
    tree: str = "default"  #: default | chain | small | path to a tree YAML
    model: EvalModelConfig = field(default_factory=EvalModelConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    generation: DecodeConfig = field(default_factory=DecodeConfig)
    baselines: BaselinesConfig = field(default_factory=BaselinesConfig)
    drift: DriftConfig = field(default_factory=DriftConfig)
    output_dir: str | None = None  #: default: outputs/eval/<heads folder name>
    device: str | None = None  #: default: cuda when available, else cpu
    threads: int | None = None  #: torch CPU threads (null = torch's default)
    warmup: bool = True  #: one untimed generation of each method first
    progress: bool = True  #: tqdm bar over prompts
    engine: str | None = None  #: null | vllm: also serve the prompts in vLLM (with the vllm export, without, n-gram)
    server: ServerConfig = field(default_factory=ServerConfig)  #: how that engine is started
    served: ServedConfig = field(default_factory=ServedConfig)  #: what is measured in it


def default_output_dir(draft: str | None, heads: str | None = None) -> str:
    """``outputs/eval/<name>``: the draft folder's name, or its run's name for ``<run>/export`` (``heads``: the alias)."""
    heads = draft or heads
    if not heads:
        return "outputs/eval"
    return str(Path("outputs") / "eval" / heads_name(heads))


def check_eval_config(c: EvalConfig) -> list[str]:
    """Range checks of an ``EvalConfig`` that need only its values; returns every problem found."""
    p = Problems()
    p += take_draft_alias(c)
    if not c.draft:
        p.append("draft: required; pass draft=<a draft folder: exported heads or an EAGLE-3 draft>")
    p += check_decoder_attention(c.model)
    parse_dtype(p, c.model, "model.dtype")  # stored canonical: vLLM's --dtype takes bfloat16, not bf16
    p.need(c.model.form in ("merged", "adapter"), "model.form", c.model.form, "must be merged or adapter")
    p.need(c.drift.max_new_tokens >= 1, "drift.max_new_tokens", c.drift.max_new_tokens, "must be >= 1")
    p.need(c.drift.limit is None or c.drift.limit >= 1, "drift.limit", c.drift.limit, "must be >= 1 or null (all)")
    p.need(c.bench.limit is None or c.bench.limit >= 1, "bench.limit", c.bench.limit, "must be >= 1 or null (all)")
    p.need(c.bench.turns >= 1, "bench.turns", c.bench.turns, "must be >= 1")
    p.need(c.bench.max_minutes is None or c.bench.max_minutes > 0, "bench.max_minutes", c.bench.max_minutes,
           "must be > 0 or null (no limit)")
    b = c.baselines
    for key in ("prompt_lookup_num_tokens", "prompt_lookup_ngram_size"):
        value = getattr(b, key)
        p.need(value is None or value >= 1, f"baselines.{key}", value, "must be >= 1 or null (swept)")
    for key in ("sweep_num_tokens", "sweep_ngram_sizes"):
        values = getattr(b, key)
        p.need(bool(values) and all(v >= 1 for v in values), f"baselines.{key}", values, "must be values >= 1")
    p.need(b.sweep_prompts >= 1, "baselines.sweep_prompts", b.sweep_prompts, "must be >= 1")
    p.need(b.sweep_max_new_tokens >= 1, "baselines.sweep_max_new_tokens", b.sweep_max_new_tokens, "must be >= 1")
    g = c.generation
    p.need(g.max_new_tokens >= 1, "generation.max_new_tokens", g.max_new_tokens, "must be >= 1")
    p.need(g.temperature >= 0, "generation.temperature", g.temperature, "must be >= 0")
    p.need(0 < g.top_p <= 1, "generation.top_p", g.top_p, "must be in (0, 1]")
    p.need(c.threads is None or c.threads >= 1, "threads", c.threads, "must be >= 1 or null")
    p.need(c.engine in (None, "vllm"), "engine", c.engine, "must be null or vllm")
    p.need(c.engine is None or c.generation.temperature == 0, "engine", c.engine,
           "the served comparison runs greedy (generation.temperature=0); its sampled pass is served.sampled_temperature")
    p.extend(check_server(c.server))
    p.need(c.device is None or re.fullmatch(r"cpu|cuda(:\d+)?|mps", c.device) is not None, "device", c.device,
           "must be cpu, cuda, cuda:N, mps or null")
    return p
