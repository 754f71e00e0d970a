"""``medusa-train capture +recipe=medusa1|eagle3 ...``: the hidden-state capture stage on its own (several processes:
``accelerate launch [--num_processes N] -m medusa_train capture ...``), with the training command's own config
(so training with the same keys and ``data.cache_hidden_states=true`` finds what it wrote); it reads the sections
the capture stage needs (``config/capture.py``)."""

from __future__ import annotations

from medusa_train.config.capture import CaptureConfig, build_capture_config
from medusa_train.config.paths import CONFIG_DIR


def run(cfg: CaptureConfig) -> dict:
    """Capture both splits (each process its share of the shards; finished ones kept); returns the train index."""
    from medusa_train.data.capture.run import run_capture
    from medusa_train.model.family import captured_for

    return run_capture(cfg, captured_for(cfg))


def main() -> None:
    """Entry point of ``medusa-train capture``."""
    from medusa_train.cli.entry import run_command
    from medusa_train.cli.launch import relaunch_cpu_processes_if_asked

    relaunch_cpu_processes_if_asked()
    run_command("train", build_capture_config, run, config_dir=CONFIG_DIR)
