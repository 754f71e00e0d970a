"""Typed configuration of the demo (``medusa_train/cli/demo.py``, ``make demo``; ``configs/commands/demo.yaml``) and its checks.

Each section holds the settings of one pipeline stage. The demo keys its output folders by hashing
whole sections (``cli/demo.py: _key``), so a section's fields must stay exactly the YAML's keys,
with the YAML's types: adding, renaming or retyping one moves every finished run's folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from medusa_train.config.check import ConfigError, Problems, parse_config
from medusa_train.config.compose import compose_training
from medusa_train.config.paths import CONFIG_DIR


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
    #: the training preset the train command composes (configs/experiment/<name>.yaml): the demo trains exactly
    #: ``medusa-train train +recipe=<recipe> experiment=<name>``, on its distilled data, plus ``overrides``
    experiment: str = "demo"
    dtype: str = "auto"  #: auto | bfloat16 | float32 (backbone weights and autocast; auto as distill.dtype)
    #: more training settings, as the train command takes them: '["trainer.epochs=2","loss.targets=text"]'
    overrides: list[str] = field(default_factory=list)


def training_overrides(c: DemoConfig, recipe: str | None = None) -> list[str]:
    """The train command's overrides for the demo's heads, before each stage adds its data and folder.

    ``recipe`` defaults to ``c.recipe``; a resolved ``train.dtype`` (see ``resolve_dtypes``) is expected."""
    t = c.train
    return [f"+recipe={recipe or c.recipe}", f"experiment={t.experiment}", f"model.name_or_path={c.model}",
            f"model.dtype={t.dtype}", f"trainer.mixed_precision={'bf16' if t.dtype == 'bfloat16' else 'no'}",
            "trainer.save_every=20",  # ~10 min of a CPU's joint (medusa2) steps: a killed demo resumes there
            "trainer.eval_every=100", *t.overrides]


def training_settings(c: DemoConfig) -> dict:
    """The heads' training settings as the train command composes them (Medusa-1 over ``train.experiment``): what
    the run folder is keyed by, and the epochs and learning rate Medusa-2's stages split. ``data.source`` and
    ``trainer.output_dir`` are left out: the distilled data has a key of its own and the folder is what is keyed."""
    settings = compose_training(training_overrides(c, "medusa1"))
    settings["data"].pop("source")
    settings["trainer"].pop("output_dir")
    return settings


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
    p.need((CONFIG_DIR / "experiment" / f"{c.train.experiment}.yaml").is_file(), "train.experiment", c.train.experiment,
           "must name a preset in configs/experiment/ (" + ", ".join(sorted(
               f.stem for f in (CONFIG_DIR / "experiment").glob("*.yaml"))) + ")")
    p.need(c.threads is None or c.threads >= 1, "threads", c.threads, "must be >= 1 or null (all cores)")
    if not p:  # the training settings the preset and overrides compose, checked as the train command will
        p += training_problems(c)
    return p


def training_problems(c: DemoConfig) -> list[str]:
    """What the train command would refuse in the demo's training settings (``train.experiment`` + ``train.overrides``),
    said now rather than after distilling; and whether Medusa-2's stage 1 leaves epochs to train jointly."""
    from medusa_train.config.train import DataConfig, build_config

    probe = replace(c, train=replace(c.train, dtype="float32" if c.train.dtype == "auto" else c.train.dtype))
    try:
        settings = training_settings(probe)
        settings["data"]["source"] = DataConfig.source  # the distilled data is not there yet
        epochs = build_config(settings).trainer.epochs
    except ConfigError as err:
        return [f"train (experiment={c.train.experiment}, overrides {c.train.overrides}): {problem}"
                for problem in err.problems]
    p = Problems()
    p.need(c.recipe != "medusa2" or 0 <= c.medusa2.stage1_epochs < epochs, "medusa2.stage1_epochs",
           c.medusa2.stage1_epochs, f"must be in [0, trainer.epochs={epochs}) (the training's epochs: stage 1's "
           "and the joint ones) so that at least one epoch trains jointly")
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
