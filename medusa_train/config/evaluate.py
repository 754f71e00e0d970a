"""Configuration of ``scripts/evaluate.py`` (and the command-line plumbing shared with ``scripts/build_tree.py``).

Hydra composes ``configs/eval.yaml``; ``build_eval_config`` turns it into these dataclasses and
reports every problem at once, each with the key to change, before anything heavy loads.
"""

from __future__ import annotations

import json
import os
import re
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from medusa_train.data.benchmarks import BENCH_PICKS, BENCHMARK_PACKAGES, DEFAULT_BENCHMARK
from medusa_train.decoding import ACCEPTANCE_METHODS, MedusaTree, tree_from_config
from medusa_train.config.paths import CONFIG_DIR, TREE_DIR
from medusa_train.model.layouts import resolve_base_model



# ------------------------------------------------------------------------------------------- config
@dataclass
class EvalModelConfig:
    name_or_path: str | None = None  #: backbone; default: the one named in the heads' config.json
    dtype: str = "float32"  #: float32 | bfloat16 | float16 (float32: greedy parity without near-ties)
    attn_implementation: str | None = "sdpa"  #: sdpa | eager | null (transformers' default)
    trust_remote_code: bool = False
    form: str = "merged"  #: Medusa-2 exports: merged (plain transformers) | adapter (4-bit base + LoRA; peft, bitsandbytes)


@dataclass
class BenchConfig:
    source: str = DEFAULT_BENCHMARK  #: packaged:mt-bench or a .jsonl of prompts (see data/benchmarks.py)
    limit: int | None = None  #: N prompts (null = all)
    pick: str = "spread"  #: which N: spread (round-robin over categories) | first (file order)
    turns: int = 2  #: turns asked per prompt (MT-Bench has 2; turn 2 follows the plain answer to turn 1)


@dataclass
class DecodeConfig:
    max_new_tokens: int = 256
    temperature: float = 0.0  #: 0 = greedy (lossless, mismatches counted)
    acceptance: str = "greedy"  #: greedy | typical | rejection
    top_p: float = 1.0
    typical_threshold: float = 0.09
    typical_alpha: float = 0.3
    seed: int = 0  #: sampling seed (temperature > 0)


@dataclass
class DriftConfig:
    """How far the evaluated backbone is from an original one (Medusa-2), on the benchmark's first turns."""

    #: null (skip) | auto (Medusa-2 export: the 4-bit base it started from, rebuilt without peft or
    #: bitsandbytes) | a model name or path (e.g. packaged:smollm2-135m-instruct, the unquantized original)
    original: str | None = None
    max_new_tokens: int = 64  #: length of the original's greedy answer to each prompt
    limit: int | None = None  #: prompts compared (null = every evaluated prompt)


@dataclass
class EvalConfig:
    heads_dir: str | None = None  #: exported heads folder (``heads=`` on the command line)
    tree_name: str = "default"  #: default | chain | small | path to a tree YAML (``tree=`` on the command line)
    model: EvalModelConfig = field(default_factory=EvalModelConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    generation: DecodeConfig = field(default_factory=DecodeConfig)
    drift: DriftConfig = field(default_factory=DriftConfig)
    output_dir: str | None = None  #: default: outputs/eval/<heads folder name>
    device: str | None = None  #: default: cuda when available, else cpu
    threads: int | None = None  #: torch CPU threads (null = torch's default)
    warmup: bool = True  #: one untimed generation of each method first
    progress: bool = True  #: tqdm bar over prompts


def default_output_dir(heads_dir: str | None) -> str:
    """``outputs/eval/<name>``: the heads folder's name, or its run's name for ``<run>/export``."""
    if not heads_dir:
        return "outputs/eval"
    path = Path(heads_dir).expanduser().resolve()
    name = path.parent.name if path.name == "export" and path.parent.name else path.name
    return str(Path("outputs") / "eval" / name)


def heads_metadata(heads_dir: str | os.PathLike) -> tuple[int, str | None]:
    """``(num_heads, base model)`` from a heads folder's ``config.json`` (any supported layout); a base
    model stored relative to the heads (Medusa-2's ``merged``) comes back as its path."""
    raw = json.loads((Path(heads_dir) / "config.json").read_text())
    num_heads = raw.get("num_heads", raw.get("medusa_num_heads"))
    if not isinstance(num_heads, int):
        raise ValueError(f"heads={heads_dir}: config.json does not say how many heads there are")
    return num_heads, resolve_base_model(heads_dir, raw.get("base_model_name_or_path"))


def build_eval_config(raw) -> EvalConfig:
    """A validated ``EvalConfig`` from a Hydra ``DictConfig`` or a dict; every problem reported at once.

    Raises:
        ConfigError: listing each invalid value with the key to change.
    """
    from medusa_train.backbone.load import DTYPES
    from medusa_train.config.train import parse_config

    return parse_config(EvalConfig, raw, lambda cfg: check_eval_config(cfg, DTYPES))


def check_eval_config(c: EvalConfig, dtypes) -> list[str]:
    """Range checks of an ``EvalConfig`` (files and tree included); returns every problem found."""
    p: list[str] = []

    def need(ok: bool, key: str, value, rule: str):
        if not ok:
            p.append(f"{key}={value}: {rule}")

    num_heads = None
    if not c.heads_dir:
        p.append("heads: required; pass heads=<folder of exported heads>")
    elif not (Path(c.heads_dir).expanduser() / "config.json").is_file():
        p.append(f"heads={c.heads_dir}: not a folder of exported heads (no config.json)")
    else:
        try:
            num_heads, base = heads_metadata(Path(c.heads_dir).expanduser())
            need(bool(base or c.model.name_or_path), "model.name_or_path", None,
                 "the heads' config.json names no base model; set model.name_or_path")
        except ValueError as err:
            p.append(str(err))
    need(c.model.dtype in dtypes, "model.dtype", c.model.dtype, "must be float32, bfloat16 or float16")
    need(c.model.attn_implementation in (None, "sdpa", "eager"), "model.attn_implementation",
         c.model.attn_implementation, "must be sdpa, eager or null")
    medusa2 = bool(c.heads_dir) and (Path(c.heads_dir).expanduser() / "backbone.json").is_file()
    need(c.model.form in ("merged", "adapter"), "model.form", c.model.form, "must be merged or adapter")
    need(c.model.form == "merged" or medusa2, "model.form", c.model.form,
         "adapter needs a Medusa-2 export (no backbone.json in heads=)")
    need(c.drift.original != "auto" or medusa2, "drift.original", c.drift.original,
         "auto needs a Medusa-2 export (no backbone.json in heads=); name the original model instead")
    need(c.drift.max_new_tokens >= 1, "drift.max_new_tokens", c.drift.max_new_tokens, "must be >= 1")
    need(c.drift.limit is None or c.drift.limit >= 1, "drift.limit", c.drift.limit, "must be >= 1 or null (all)")
    src = c.bench.source
    need(src in BENCHMARK_PACKAGES or (not src.startswith("packaged:") and Path(src).expanduser().is_file()),
         "bench.source", src, f"must be one of {', '.join(BENCHMARK_PACKAGES)} or an existing .jsonl file")
    need(c.bench.limit is None or c.bench.limit >= 1, "bench.limit", c.bench.limit, "must be >= 1 or null (all)")
    need(c.bench.pick in BENCH_PICKS, "bench.pick", c.bench.pick, f"must be one of {', '.join(BENCH_PICKS)}")
    need(c.bench.turns >= 1, "bench.turns", c.bench.turns, "must be >= 1")
    g = c.generation
    need(g.max_new_tokens >= 1, "generation.max_new_tokens", g.max_new_tokens, "must be >= 1")
    need(g.temperature >= 0, "generation.temperature", g.temperature, "must be >= 0")
    need(g.acceptance in ACCEPTANCE_METHODS, "generation.acceptance", g.acceptance,
         f"must be one of {', '.join(ACCEPTANCE_METHODS)}")
    need(0 < g.top_p <= 1, "generation.top_p", g.top_p, "must be in (0, 1]")
    need(c.threads is None or c.threads >= 1, "threads", c.threads, "must be >= 1 or null")
    need(c.device is None or re.fullmatch(r"cpu|cuda(:\d+)?|mps", c.device) is not None, "device", c.device,
         "must be cpu, cuda, cuda:N, mps or null")
    need(not (c.device or "").startswith("cuda") or torch.cuda.is_available(), "device", c.device,
         "CUDA is not available here")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a built-in tree cut to the heads' depth is said once, at run time
            resolve_tree(c.tree_name, num_heads)
    except (ValueError, FileNotFoundError) as err:
        p.append(str(err) if str(err).startswith("tree") else f"tree={c.tree_name}: {err}")
    return p


def resolve_tree(spec, num_heads: int | None) -> MedusaTree:
    """A ``MedusaTree`` for ``spec`` that fits ``num_heads`` heads.

    Built-in names adapt: ``chain`` is built for ``num_heads`` heads, and a built-in tree deeper than
    the model is cut to its first ``num_heads`` depths (with a warning). A YAML path, a list of
    choices or a ``MedusaTree`` is used as given; one that needs more heads is an error.
    """
    if isinstance(spec, str) and Path(spec).suffix not in (".yaml", ".yml") and (TREE_DIR / f"{spec}.yaml").is_file():
        if spec == "chain" and num_heads is not None:
            return MedusaTree.chain(num_heads)
        tree = MedusaTree.from_name(spec)
        if num_heads is not None and tree.depth > num_heads:
            warnings.warn(f"tree={spec} is {tree.depth} deep but the heads are {num_heads}: "
                          f"using its paths of depth <= {num_heads}", stacklevel=2)
            tree = tree.truncated(max_depth=num_heads)
        return tree
    return tree_from_config(spec, num_heads=num_heads)


# Training's config groups configs/heads/ and configs/tree/ make Hydra read ``heads=X`` and ``tree=X``
# as group choices; the evaluation keys they stand for are renamed before Hydra parses the line.
CLI_RENAMES = {"heads": "heads_dir", "tree": "tree_name"}


def rename_overrides(args: Sequence[str], renames: dict[str, str]) -> list[str]:
    """``heads=X`` -> ``heads_dir=X`` (etc.) for each key of ``renames``; other arguments unchanged."""
    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        out.append(f"{renames[key]}={value}" if sep and key in renames else arg)
    return out


def hydra_entry(config_name: str, build, run_fn, renames: dict[str, str]) -> None:
    """Run ``run_fn(build(cfg))`` as a Hydra app on ``configs/<config_name>.yaml``; config errors exit 2."""
    import hydra
    from omegaconf import OmegaConf

    from medusa_train.config.train import ConfigError

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    OmegaConf.register_new_resolver("default_output_dir", default_output_dir, replace=True)
    sys.argv = [sys.argv[0], *rename_overrides(sys.argv[1:], renames)]

    @hydra.main(config_path=str(CONFIG_DIR), config_name=config_name, version_base="1.3")
    def _main(raw) -> None:
        try:
            cfg = build(raw)
        except ConfigError as err:
            print(err, file=sys.stderr)
            sys.exit(2)
        run_fn(cfg)

    _main()
