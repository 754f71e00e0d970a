"""Typed configuration of the demo (``medusa_train/cli/demo.py``, ``make demo``; ``configs/commands/demo.yaml``) and its checks.

Each section holds the settings of one pipeline stage. The demo keys its output folders by hashing
whole sections (``cli/demo.py: _key``), so a section's fields must stay exactly the YAML's keys,
with the YAML's types: adding, renaming or retyping one moves every finished run's folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from medusa_train.config.check import Problems, parse_config


@dataclass
class DistillStage:
    num_prompts: int | None = 1200  #: ShareGPT conversations (MT-Bench prompts excluded; null = all)
    max_prompt_tokens: int = 256
    keep_truncated: bool = True  #: replies cut at max_new_tokens are still the model's own text
    trim_loops: bool = True  #: a reply stuck in a loop is kept up to where the loop began
    max_turns: int = 1
    max_new_tokens: int = 128
    batch_size: int = 32
    dtype: str = "auto"  #: auto: bfloat16 where it runs natively (GPU, AVX512-BF16/AMX CPU), else float32


@dataclass
class TrainStage:
    num_heads: int = 4
    num_layers: int = 1
    share_lm_head: bool = True
    next_token_input: bool = True
    path_input: bool = True
    prefix_attention: bool = True
    epochs: int = 4
    lr: float = 2.0e-3
    max_length: int = 512
    batch_size: int = 8
    head_decay: float = 0.8
    targets: str = "teacher"  #: text | greedy | teacher (the backbone's distribution; the default since issue 21)
    eval_size: int = 8  #: held-out conversations for the training-time eval
    dtype: str = "auto"  #: auto | bfloat16 | float32 (backbone weights and autocast; auto as distill.dtype)
    vocab_size: int | None = 4096  #: heads score only the K most frequent training targets (heads.vocab_size; null = all)


# train section key -> the training key it sets (epochs and lr go to the recipes' own stages)
TRAINING_KEYS = {"max_length": "data.max_length", "batch_size": "data.batch_size", "eval_size": "data.eval_size",
                 "num_heads": "heads.num_heads", "num_layers": "heads.num_layers",
                 "share_lm_head": "heads.share_lm_head", "next_token_input": "heads.next_token_input",
                 "path_input": "heads.path_input", "prefix_attention": "heads.prefix_attention",
                 "head_decay": "loss.head_decay", "targets": "loss.targets", "dtype": "model.dtype",
                 "vocab_size": "heads.vocab_size"}


def training_flags(t: TrainStage) -> list[str]:
    """The training command's overrides for the demo's train section (a resolved ``dtype``)."""
    def yaml(value) -> str:
        return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)

    return [f"{key}={yaml(getattr(t, name))}" for name, key in TRAINING_KEYS.items()] + [
        f"trainer.mixed_precision={'bf16' if t.dtype == 'bfloat16' else 'no'}"]


@dataclass
class Medusa2Stage:
    stage1_epochs: int = 3  #: heads first on the frozen 4-bit backbone; 0 = joint throughout
    lr: float = 1.0e-4  #: LoRA learning rate in the joint epochs
    head_lr: float = 1.0e-3  #: heads' learning rate in the joint epochs
    head_weight: float = 0.2  #: lambda: L = KL(original || adapted) + lambda * heads' loss
    head_warmup_steps: int = 0
    lora_r: int = 16  #: LoRA rank (alpha = 2 r)


@dataclass
class TreeStage:
    nodes: int | str = "auto"  #: auto: the size with the most expected tokens/s on this machine (scripts/build_tree.py)
    num_prompts: int = 16


@dataclass
class EvalStage:
    limit: int | None = 24  #: MT-Bench questions (null = all 80)
    turns: int = 1
    max_new_tokens: int = 128
    dtype: str = "auto"  #: auto | bfloat16 | float32 (tree timing and decoding; auto as distill.dtype)


@dataclass
class DemoConfig:
    output_dir: str = "outputs/demo"
    model: str = "packaged:smollm2-135m-instruct"
    threads: int | None = None  #: torch threads per stage (null = all cores)
    recipe: str = "medusa1"  #: medusa1 | medusa2
    distill: DistillStage = field(default_factory=DistillStage)
    train: TrainStage = field(default_factory=TrainStage)
    medusa2: Medusa2Stage = field(default_factory=Medusa2Stage)
    tree: TreeStage = field(default_factory=TreeStage)
    eval: EvalStage = field(default_factory=EvalStage)


def check_demo_config(c: DemoConfig) -> list[str]:
    """What the demo cannot run; every problem names its key."""
    p = Problems()
    p.need(c.recipe in ("medusa1", "medusa2"), "recipe", c.recipe, "must be medusa1 or medusa2")
    p.need(c.train.dtype in ("auto", "bfloat16", "float32"), "train.dtype", c.train.dtype,
           "must be auto, bfloat16 or float32")
    for key, value in (("distill.dtype", c.distill.dtype), ("eval.dtype", c.eval.dtype)):
        p.need(value in ("auto", "bfloat16", "float32"), key, value, "must be auto, bfloat16 or float32")
    p.need(c.train.vocab_size is None or c.train.vocab_size >= 1, "train.vocab_size", c.train.vocab_size,
           "must be >= 1 or null (the whole vocabulary)")
    p.need(c.train.epochs >= 1, "train.epochs", c.train.epochs, "must be >= 1")
    p.need(c.recipe != "medusa2" or 0 <= c.medusa2.stage1_epochs < c.train.epochs, "medusa2.stage1_epochs",
           c.medusa2.stage1_epochs, f"must be in [0, train.epochs={c.train.epochs}) so that at least one epoch "
           "trains jointly")
    p.need(c.threads is None or c.threads >= 1, "threads", c.threads, "must be >= 1 or null (all cores)")
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
