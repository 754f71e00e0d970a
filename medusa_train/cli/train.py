"""``medusa-train train +recipe=medusa1|medusa2|eagle3 ...`` (= ``accelerate launch train.py +recipe=...``): compose
configs/train.yaml, check it, run the method's recipe (``config/methods.py``)."""

from __future__ import annotations

from medusa_train.config.methods import METHODS
from medusa_train.config.paths import CONFIG_DIR
from medusa_train.config.train import TrainConfig, build_config


def build(raw) -> TrainConfig:
    """The checked config; a run in ``trainer.output_dir`` with other settings is a config problem too (it would
    be resumed and mixed with this one), and so is an ``export`` folder there holding files we did not write
    (the export at the end would be refused), reported before anything loads."""
    from medusa_train.config.check import ConfigError
    from medusa_train.training.resume import resume_problems
    from medusa_train.training.run_folder import RunFolder

    cfg = build_config(raw)
    problems = resume_problems(cfg)
    if cfg.trainer.export and (problem := RunFolder.of(cfg).export_problem()):
        problems.append(problem)
    if problems:
        raise ConfigError(problems)
    return cfg


def run(cfg: TrainConfig) -> dict:
    """setup -> train -> export (``export/run.py``) -> cleanup of the recipe ``cfg.method`` names; the last
    eval record."""
    from medusa_train.export.run import save_run_export

    recipe = METHODS[cfg.method].recipe_class()(cfg)
    recipe.setup()
    try:
        metrics = recipe.train()
        save_run_export(recipe.trained())
    finally:
        recipe.cleanup()
    return metrics


def main() -> None:
    """Entry point of the root ``train.py`` (so ``accelerate launch train.py`` works from the checkout)."""
    from medusa_train.cli.entry import run_command
    from medusa_train.cli.launch import relaunch_cpu_processes_if_asked

    relaunch_cpu_processes_if_asked()
    run_command("train", build, run, config_dir=CONFIG_DIR)
