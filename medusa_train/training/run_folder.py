"""A training run's folder, ``trainer.output_dir``: the one owner of what a run writes there and of its names.

    <output_dir>/
      checkpoints/step-NNNNNNN/   resumable state, with the config that wrote it (``checkpoint.py``, ``resume.py``)
      metrics.jsonl               one JSON line per train and eval record (``loop.MetricsLog``)
      export/                     the trained draft in its family's native layout, its chat template and
                                  training_config.json (written by ``export/run.py`` at the end)
      .lock                       held (``flock``) by the run writing the folder: one run per folder at a time
      metrics.N.jsonl             an earlier run's metrics, set aside when a run starts afresh here

A finished recipe hands what its export writes as a ``TrainedRun`` (``export/run.py`` writes it). Training, resume,
the run's export, build-tree (which reads ``training_config.json`` to leave the training prompts
out) and the demo all find these paths here.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from medusa_train.backbone.chat_template import resolve_chat_template, tokenizer_template
from medusa_train.config.check import FileProblem
from medusa_train.model.folder import TRAINING_CONFIG_NAME, output_problem

OPTION = "trainer.output_dir"  #: the key that names a run's folder, for messages
LOCK_NAME = ".lock"


@dataclass(frozen=True)
class RunFolder:
    """The folder of one training run."""

    root: Path

    @classmethod
    def of(cls, cfg) -> RunFolder:
        """The folder a training config writes (``trainer.output_dir``)."""
        return cls(Path(cfg.trainer.output_dir))

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def export(self) -> Path:
        return self.root / "export"

    @property
    def training_config(self) -> Path:
        """The export's record of the config that trained it (written last: a finished run's mark)."""
        return self.export / TRAINING_CONFIG_NAME

    def export_problem(self) -> str | None:
        """Why the export at the end would be refused (its folder holds files we did not write), or None."""
        return output_problem(self.export, OPTION)

    @contextlib.contextmanager
    def lock(self, holder: bool = True):
        """Hold the folder for this run: a second run into it is refused (``FileProblem``) while this one lives.

        An OS lock (``flock``) on ``.lock``: released on every exit, a kill included, so a lock left by a dead run
        never blocks (the file stays; its pid line only says who held it last). ``holder=False``: the other
        processes of one run, which the main process holds it for."""
        if not holder:
            yield
            return
        import fcntl

        try:
            self.root.mkdir(parents=True, exist_ok=True)
            file = open(self.root / LOCK_NAME, "a+")
        except OSError as err:
            raise FileProblem(f"{OPTION}={self.root}: cannot be written ({err.strerror or err}); choose another "
                              f"{OPTION}=") from err
        try:
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as err:
                file.seek(0)
                held_by = file.read().strip() or "another process"
                raise FileProblem(f"{OPTION}={self.root}: another training run is writing it ({held_by}); wait for "
                                  f"it to end or choose another {OPTION}=") from err
            file.seek(0)
            file.truncate()  # the lock file is ours: it says who holds it
            file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
            file.flush()
            yield
        finally:
            file.close()  # releases the lock


def set_aside_metrics(root: Path, main_process: bool = True) -> Path | None:
    """A fresh start in a folder that holds an earlier run's ``metrics.jsonl``: move it to ``metrics.N.jsonl`` (the
    first free N), so the new run's record starts empty and the old one is kept; the new name, or None."""
    metrics = RunFolder(Path(root)).metrics
    if not main_process or not metrics.is_file() or metrics.stat().st_size == 0:
        return None
    number = 1
    while (kept := metrics.with_name(f"metrics.{number}.jsonl")).exists():
        number += 1
    os.replace(metrics, kept)
    print(f"[medusa_train] a fresh start: the earlier run's metrics are kept in {kept}", flush=True)
    return kept


def write_training_config(config: dict, folder: Path) -> None:
    """``training_config.json`` (the plain dict of a training config) into ``folder`` (an export being written)."""
    (folder / TRAINING_CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


def read_training_config(export: str | Path) -> dict | None:
    """The training config an export records, or None when it records none (heads converted from elsewhere)."""
    path = Path(export) / TRAINING_CONFIG_NAME
    return json.loads(path.read_text()) if path.is_file() else None


@dataclass
class AdaptedBackbone:
    """What rebuilds a backbone trained with the draft (Medusa-2's LoRA on a 4-bit backbone)."""

    joint: bool  #: the adapter trained (stage 1 trains the heads alone: no adapter)
    peft_model: object  #: the backbone with its LoRA (peft), when joint
    tokenizer: object  #: saved beside a merged backbone
    whole_adapter: Callable[[], dict | None]  #: a collective: the adapter's weights gathered whole (None: as they are)


@dataclass
class TrainedRun:
    """What a finished run writes into its export (each recipe's ``trained()``): nothing else of the recipe is read."""

    cfg: object  #: its ``TrainConfig`` (recorded as ``training_config.json``)
    accelerator: object
    model: object  #: the draft on its backbone (``model.contract.DraftModel``)
    chat_template: str | None  #: the template its data was rendered with
    adapted: AdaptedBackbone | None = None  #: when the backbone trained too
    #: the last validation walk's figures (``training/validation_walk.py``), recorded in the export as validation.json
    validation: dict | None = None


def run_chat_template(cfg, tokenizer) -> str | None:
    """The template a run's data was rendered with: ``data.chat_template`` when set, else the tokenizer's."""
    value = cfg.data.chat_template
    return resolve_chat_template(value) if value else tokenizer_template(tokenizer)
