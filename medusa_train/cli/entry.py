"""The one Hydra entry helper every command goes through.

Training composes ``configs/train.yaml`` with its config groups; every other command has its own
config root (``configs/commands/``), so an option such as ``draft=`` or ``tree=`` is a plain key
there and never collides with training's groups. ``build`` parses and checks the composed config
(``config.check.parse_config``): a ``ConfigError`` prints every problem with its key and exits 2
before anything heavy loads (one the run finds later, e.g. a data source with no usable conversation, exits 2
the same way); so does a ``FileProblem``, a file that cannot be used, in one line naming it. A serving engine that fails (``engine.EngineError``) exits 3 with its
message and log, not a traceback.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from medusa_train.config.check import ConfigError, FileProblem
from medusa_train.config.compose import register_defaults
from medusa_train.config.paths import COMMANDS_DIR
from medusa_train.engine.client import EngineError


def run_command(config_name: str, build: Callable[[Any], Any], run: Callable[[Any], Any],
                config_dir: Path = COMMANDS_DIR, resolvers: dict[str, Callable] | None = None) -> None:
    """Run ``run(build(composed config))`` as a Hydra app on ``<config_dir>/<config_name>.yaml``.

    Args:
        config_name: The YAML's name without suffix.
        build: Raw Hydra config -> validated config; raises ``ConfigError`` listing every problem.
        run: Does the work.
        config_dir: The command's config root (training: ``CONFIG_DIR``; others: ``configs/commands``).
        resolvers: OmegaConf resolvers the YAML uses (e.g. a default output folder).
    """
    import hydra
    from omegaconf import OmegaConf

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>` prints every thread's stack: where a hung run waits
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    register_defaults()  # the dataclasses' defaults, which every command's YAML lists first
    for name, fn in (resolvers or {}).items():
        OmegaConf.register_new_resolver(name, fn, replace=True)

    @hydra.main(config_path=str(config_dir), config_name=config_name, version_base="1.3")
    def _main(raw) -> None:
        try:
            cfg = build(raw)
        except (ConfigError, FileProblem) as err:
            print(err, file=sys.stderr)
            sys.exit(2)
        try:
            run(cfg)
            report_gpu_memory(config_name)
        except (ConfigError, FileProblem) as err:  # found once the data is read (e.g. a source with no conversation)
            print(err, file=sys.stderr)
            sys.exit(2)
        except EngineError as err:  # a server stopped answering or never started: say so, no traceback
            print(f"{config_name}: the serving engine failed: {err}\nEverything written before it is kept; "
                  "run the same command again to continue.", file=sys.stderr)
            sys.exit(3)

    _main()


def report_gpu_memory(command: str) -> None:
    """On CUDA, say the command's peak GPU memory (this process): the figure a user sizes GPUs by, per stage."""
    torch = sys.modules.get("torch")  # a command that never imported torch used no GPU
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    rank = f" (rank {os.environ['RANK']})" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    device = torch.cuda.current_device()
    print(f"[medusa_train] {command}{rank}: peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB "
          f"allocated, {torch.cuda.max_memory_reserved(device) / 2**30:.2f} GiB reserved on "
          f"{torch.cuda.get_device_name(device)}", flush=True)
