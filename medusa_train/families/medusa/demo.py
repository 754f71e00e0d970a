"""Medusa-2's stages in ``medusa-train demo`` (``Method.demo_stages``): on the demo's data and step budget, the heads
on the frozen 4-bit backbone first, then LoRA and heads jointly from them, each a ``medusa-train train`` command.

What the pipeline (``pipeline/demo.py``) asks of a method's own stages: ``key_parts`` (what keys its run folder
besides the data and training settings), ``paths`` (where its extra stages write), ``problems`` (what its stages need
of the training settings) and ``train`` (run them; their wall time)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from medusa_train.pipeline.demo import newer
from medusa_train.training.run_folder import RunFolder


def key_parts(cfg) -> list:
    """The demo config's ``medusa2`` section: its split of the epochs keys the run."""
    return [cfg.medusa2]


def paths(cfg, out: Path, key: Callable[..., str]) -> dict[str, Path]:
    """Stage 1's run folder, keyed by the data, the training settings and its epochs."""
    return {"stage1": out / f"medusa2-stage1-{key(cfg.medusa2.stage1_epochs)}"}


def problems(cfg, epochs: int) -> list[str]:
    """Stage 1 must leave at least one of the training's ``epochs`` to train jointly."""
    stage1 = cfg.medusa2.stage1_epochs
    if 0 <= stage1 < epochs:
        return []
    return [f"medusa2.stage1_epochs={stage1}: must be in [0, trainer.epochs={epochs}) (the training's epochs: stage "
            "1's and the joint ones) so that at least one epoch trains jointly"]


def train(cfg, train_cmd: list[str], settings: dict, data: Path, where: dict[str, Path],
          stage: Callable[..., float]) -> float:
    """Medusa-2 on the demo's data and step budget: the preset's ``trainer.epochs`` in all, two stages by default.

    Stage 1 trains the heads on the frozen 4-bit backbone from cached hidden states (as medusa1 does on the bf16
    one) for ``medusa2.stage1_epochs`` at the preset's learning rate; stage 2 trains LoRA and heads jointly, from
    stage 1's heads, for the remaining epochs. ``medusa2.stage1_epochs=0`` trains jointly from the start.
    ``train_cmd``: the train command with the demo's training overrides and data; ``settings``: the composed training
    settings; ``where``: the demo's paths (``run``, ``stage1``); ``stage``: the demo's stage runner.
    """
    m = cfg.medusa2
    run_dir, first = where["run"], RunFolder(where["stage1"])
    joint_epochs = settings["trainer"]["epochs"] - m.stage1_epochs
    spent, inputs = 0.0, [data]
    from_stage1 = ["stage=2", f"heads.init_from={first.export}"] if m.stage1_epochs else []
    joint = [*train_cmd, *from_stage1, f"trainer.epochs={joint_epochs}", "data.cache_hidden_states=false",
             f"optim.lr={m.lr}", f"optim.head_lr_multiplier={m.head_lr / m.lr}", f"loss.head_weight={m.head_weight}",
             f"loss.head_warmup_steps={m.head_warmup_steps}", f"peft.r={m.lora_r}", f"peft.alpha={2 * m.lora_r}",
             "peft.gradient_checkpointing=false",  # 135M on a CPU: the activations fit, recomputing them costs ~1/3
             f"trainer.output_dir={run_dir}"]
    if m.stage1_epochs:
        spent += stage("2/4 train heads on the frozen 4-bit backbone (medusa2 stage 1)", [
            *train_cmd, "stage=1", "data.cache_hidden_states=true", f"trainer.epochs={m.stage1_epochs}",
            f"optim.lr={settings['optim']['lr']}", "optim.head_lr_multiplier=1", "trainer.merge_export=false",
            f"trainer.output_dir={first.root}"],
            done=newer(first.training_config, data))
        inputs.append(first.training_config)  # new stage-1 heads: stage 2 runs again
    spent += stage("2/4 train LoRA and heads jointly (medusa2)", joint,
                   done=newer(RunFolder(run_dir).training_config, *inputs))
    return spent
