"""``medusa-train train +recipe=medusa1|medusa2|eagle3 ...`` (= ``accelerate launch train.py +recipe=...``): compose
configs/train.yaml, check it, run the method's recipe (``config/methods.py``)."""

from __future__ import annotations

from medusa_train.config.methods import METHODS
from medusa_train.config.paths import CONFIG_DIR
from medusa_train.config.train import TrainConfig, build_config


def build(raw) -> TrainConfig:
    """The checked config (the run folder is checked in ``run``, under its lock)."""
    return build_config(raw)


def folder_problems(cfg: TrainConfig) -> list[str]:
    """What the run folder forbids, found before anything loads: a checkpoint there of another run (it would be
    resumed and mixed with this one: ``resume.resume_problems``), and an ``export`` folder holding files we did not
    write (the export at the end would be refused)."""
    from medusa_train.training.resume import resume_problems
    from medusa_train.training.run_folder import RunFolder

    problems = resume_problems(cfg)
    if cfg.trainer.export and (problem := RunFolder.of(cfg).export_problem()):
        problems.append(problem)
    return problems


def run(cfg: TrainConfig) -> dict:
    """Under the run folder's lock (one run per folder): its checks, then setup -> train -> export
    (``export/run.py``) -> cleanup of the recipe ``cfg.method`` names; the last eval record."""
    import os

    from medusa_train.config.check import ConfigError
    from medusa_train.export.run import save_run_export
    from medusa_train.training.run_folder import RunFolder

    with RunFolder.of(cfg).lock(holder=int(os.environ.get("RANK", "0")) == 0):  # the main process holds it
        if problems := folder_problems(cfg):
            raise ConfigError(problems)
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
