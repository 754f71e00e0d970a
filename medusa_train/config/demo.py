"""Typed configuration of the demo (``medusa_train/pipeline/demo.py``, ``make demo``; ``configs/commands/demo.yaml``) and its checks.

Each section holds the settings of one pipeline stage; these dataclasses are the defaults (the YAML only lists
them, ``config/compose.py``). The training settings are not here: the demo trains the train command's preset
(``train.experiment``). The demo keys its output folders by hashing whole sections (``pipeline/demo.py: _key``) and the
composed training config, so adding, renaming or retyping a field moves every finished run's folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from medusa_train.config.check import Problems, parse_config
from medusa_train.config.dtype import parse_dtype
from medusa_train.config.methods import METHODS, method_choices
from medusa_train.config.paths import CONFIG_DIR


@dataclass
class DistillStage:
    #: ShareGPT conversations (MT-Bench prompts excluded; null = all): through vLLM 2,400 take what 1,200 took
    #: in-process (docs/log/2026-11-28-results-moved-off-the-page.md#distilling-through-the-engine)
    num_prompts: int | None = 2400
    max_prompt_tokens: int = 256
    keep_truncated: bool = True  #: replies cut at max_new_tokens are still the model's own text
    trim_loops: bool = True  #: a reply stuck in a loop is kept up to where the loop began
    max_turns: int = 1
    #: as long as the evaluation's answers: more prompts, fewer replies lost to loops
    #: (docs/results.md#the-demos-data-epochs-and-targets)
    max_new_tokens: int = 128
    #: vllm: through a vLLM server from .venv-vllm (make setup makes it), 2.6x the in-process rate on the BF16 CPU;
    #: the demo distils in-process instead, saying why, when there is none or it fails; null: in-process
    engine: str | None = "vllm"
    concurrency: int = 64  #: engine=vllm: conversations in flight
    batch_size: int = 32  #: in-process: faster than 16 or 64 in bf16 here (docs/log/2026-11-28-results-moved-off-the-page.md#distilling-through-the-engine)
    dtype: str = "auto"  #: auto: bfloat16 where it runs natively (GPU, AVX512-BF16/AMX CPU), else float32
    #: the data sized to the machine: no conversation starts after this many minutes of the stage, the server's
    #: start-up in them, and the log says how many prompts were done. 2,400 prompts take 9-10 min through vLLM on the
    #: BF16 CPU (25-27 s of start-up); on the AVX2 CPU in float32 they took 40 after 2.7 min of start-up: there the
    #: demo's other stages leave it ~7 min of distilling for ~35 in all (docs/results.md#the-demo-time-and-result).
    #: null: all num_prompts
    max_minutes: float | None = 10


@dataclass
class TrainStage:
    #: the training preset the train command composes (configs/experiment/<name>.yaml): the demo trains exactly
    #: ``medusa-train train +recipe=<recipe> experiment=<name>``, on its distilled data, plus ``overrides``
    experiment: str = "demo"
    dtype: str = "auto"  #: auto | float32 | bfloat16 (backbone weights and autocast; auto as distill.dtype)
    #: more training settings, as the train command takes them: '["trainer.epochs=2","loss.targets=text"]'
    overrides: list[str] = field(default_factory=list)


@dataclass
class JointStage:
    stage1_epochs: int = 3  #: heads first on the frozen 4-bit backbone; 0 = joint throughout
    lr: float = 1.0e-4  #: LoRA learning rate in the joint epochs
    head_lr: float = 1.0e-3  #: heads' learning rate in the joint epochs
    head_weight: float = 0.2  #: lambda: L = KL(original || adapted) + lambda * heads' loss
    head_warmup_steps: int = 0
    lora_r: int = 16  #: LoRA rank (alpha = 2 r)


@dataclass
class TreeStage:
    nodes: int | str = "auto"  #: auto: the size with the most expected tokens/s on this machine (medusa-train build-tree)
    num_prompts: int | None = None  #: validation prompts calibrated on (null: the whole validation set)
    #: nodes of the tree's lookup chain (guesses copied from the text so far, beside the heads'); auto: as many as
    #: pay by the walk over the validation prompts, kept only if decoding 16 of them beats the draft alone and the
    #: lookup chain alone (build-tree's guard); 0: the draft alone. With a chain, the report adds the heads-only and
    #: lookup-only rows
    lookup_depth: int | str = "auto"
    #: the guard's decoding sized to the machine (build-tree's guard_max_minutes): none of its 16 prompts starts after
    #: this many minutes (the BF16 CPU decodes all 16 in ~1.6). null: all 16
    guard_max_minutes: float | None = 2


@dataclass
class EvalStage:
    limit: int | None = 24  #: MT-Bench questions (null = all 80)
    #: the evaluation sized to the machine (evaluate's bench.max_minutes): no question starts after this many minutes
    #: of it, every decoder on each one started (the BF16 CPU decodes all 24 in ~5). null: all ``limit``
    max_minutes: float | None = 6
    turns: int = 1
    max_new_tokens: int = 128
    #: a lookup-chain tree's branches alone decoded beside it (evaluate's bench.branches). null: where the guard's
    #: measured rates say every question fits the evaluation's time with them (``branches_fit``), else not: on a slow
    #: machine two decodes a question fewer, so more questions (the guard compared the three already)
    branches: bool | None = None
    dtype: str = "auto"  #: auto | float32 | bfloat16 (tree timing and decoding; auto as distill.dtype)


@dataclass
class DemoConfig:
    output_dir: str = "outputs/demo"
    model: str = "packaged:smollm2-135m-instruct"
    threads: int | None = None  #: torch threads per stage (null = all cores)
    #: the whole demo's time from its start, downloads included: the evaluation gets what the stages before it left
    #: (at most eval.max_minutes, at least ``EVAL_FLOOR_MINUTES``), less ``EVAL_RESERVE_MINUTES`` for its start-up and
    #: its last question; the log says so when it cut. On the BF16 CPU the demo takes ~28 (no cut); on one core of the
    #: AVX2 code paths distill, train and tree took 29.0 of 35.5 in a slow hour (docs/results.md#the-demo-time-and-result).
    #: Does not key any folder. null: no limit
    max_minutes: float | None = 35
    #: medusa1 | medusa2 | eagle3 (an EAGLE-3 draft, with train.experiment=eagle3: the same data, compared with the
    #: heads in our decoder; served in vLLM by ``medusa-train evaluate draft=<its export> engine=vllm``)
    recipe: str = "medusa1"
    distill: DistillStage = field(default_factory=DistillStage)
    train: TrainStage = field(default_factory=TrainStage)
    medusa2: JointStage = field(default_factory=JointStage)
    tree: TreeStage = field(default_factory=TreeStage)
    eval: EvalStage = field(default_factory=EvalStage)


#: the evaluation's start-up and its last question past its budget: 0.2-0.5 min measured on the slowest machine
EVAL_RESERVE_MINUTES = 1.0
#: the least the evaluation is given however late it starts: every decoder on a question or two
EVAL_FLOOR_MINUTES = 1.0


def branches_fit(c: DemoConfig, tree: dict, budget: float | None) -> tuple[bool, str | None]:
    """Whether the evaluation decodes the tree's branches alone (``eval.branches``; null: decided here), and, where
    it does not by this rule, why. ``tree``: the tree YAML's keys (its guard's measured tokens/s, its cost curve's HF
    ``generate`` step). A question costs HF ``generate``, HF prompt lookup (counted at our lookup chain's rate) and the
    tree, plus each branch alone: on when ``eval.limit`` questions fit ``budget`` minutes with them."""
    if c.eval.branches is not None:
        return c.eval.branches, None
    measured = (tree.get("guard") or {}).get("measured") or {}
    rates = [(measured.get(k) or {}).get("tokens_per_s") for k in ("hybrid", "draft alone", "lookup chain alone")]
    generate_ms = (tree.get("cost_curve") or {}).get("generate_ms")
    if budget is None or c.eval.limit is None or not tree.get("chosen_lookup_nodes") or not all(rates) \
            or not generate_ms:
        return True, None
    hybrid, draft, lookup = rates
    tokens = c.eval.max_new_tokens
    without = tokens * (generate_ms / 1000 + 1 / hybrid + 1 / lookup)  # seconds a question
    with_them = without + tokens * (1 / draft + 1 / lookup)
    fit = budget * 60 / with_them
    if fit >= c.eval.limit:
        return True, None
    return False, (f"the tree's branches alone not decoded: with them a question takes ~{with_them:.0f} s, "
                   f"{fit:.0f} of {c.eval.limit} in {budget:.1f} min; without, ~{without:.0f} s (build-tree's guard "
                   f"compared them: the hybrid {hybrid:.1f} tokens/s, the draft alone {draft:.1f}, the lookup chain "
                   f"alone {lookup:.1f}; eval.branches=true decodes them)")


def evaluation_minutes(c: DemoConfig, elapsed_s: float) -> float | None:
    """The evaluation's time budget (``bench.max_minutes``) after ``elapsed_s`` seconds of the demo: ``eval.max_minutes``
    or what ``max_minutes`` leaves (less ``EVAL_RESERVE_MINUTES``), whichever is less, never under ``EVAL_FLOOR_MINUTES``
    (None: no limit)."""
    if c.max_minutes is None:
        return c.eval.max_minutes
    left = max(c.max_minutes - elapsed_s / 60 - EVAL_RESERVE_MINUTES, EVAL_FLOOR_MINUTES)
    return left if c.eval.max_minutes is None else min(c.eval.max_minutes, left)


#: what the demo runs in (auto: one of them, chosen for this machine); its training sets bf16 autocast or none
DEMO_DTYPES = ("float32", "bfloat16")


def check_demo_config(c: DemoConfig) -> list[str]:
    """What the demo cannot run; every problem names its key."""
    p = Problems()
    p.need(c.recipe in METHODS, "recipe", c.recipe, method_choices())
    wanted = METHODS[c.recipe].experiment if c.recipe in METHODS else None
    p.need(wanted is None or c.train.experiment == wanted, "train.experiment", c.train.experiment,
           f"recipe={c.recipe} trains with its own preset: add train.experiment={wanted}")
    for key, section in (("distill.dtype", c.distill), ("train.dtype", c.train), ("eval.dtype", c.eval)):
        parse_dtype(p, section, key, auto=True, allowed=DEMO_DTYPES)
    p.need((CONFIG_DIR / "experiment" / f"{c.train.experiment}.yaml").is_file(), "train.experiment", c.train.experiment,
           "must name a preset in configs/experiment/ (" + ", ".join(sorted(
               f.stem for f in (CONFIG_DIR / "experiment").glob("*.yaml"))) + ")")
    p.need(c.threads is None or c.threads >= 1, "threads", c.threads, "must be >= 1 or null (all cores)")
    p.need(c.max_minutes is None or c.max_minutes > 0, "max_minutes", c.max_minutes, "must be > 0 or null (no limit)")
    p.need(c.distill.engine in (None, "vllm"), "distill.engine", c.distill.engine, "must be vllm or null (in-process)")
    p.need(c.distill.concurrency >= 1, "distill.concurrency", c.distill.concurrency, "must be >= 1")
    return p


def build_demo_config(raw) -> DemoConfig:
    """A validated ``DemoConfig`` from a Hydra ``DictConfig`` or a dict; every problem reported at once.

    Raises:
        ConfigError: listing each problem with the key to change.
    """
    return parse_config(DemoConfig, raw, check_demo_config)


def resolve_dtypes(c: DemoConfig, bf16: bool) -> DemoConfig:
    """Replace ``auto`` dtypes by what runs fast here (``bf16``: whether bfloat16 is native, e.g.
    ``backbone.load.native_bf16()``), in place; the demo does it before folders are keyed, so an auto run
    on a bf16 machine finds the folders of a bfloat16 run."""
    fast = "bfloat16" if bf16 else "float32"
    for section in (c.distill, c.train, c.eval):
        if section.dtype == "auto":
            section.dtype = fast
    return c
