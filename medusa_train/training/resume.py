"""Runs never mix: a checkpoint carries the settings it was trained with and a digest of its examples, and a run
continues it (``trainer.resume=auto`` or an explicit checkpoint) only when its settings equal this run's (apart from
the keys that may change on resume), its examples are the same, and ``max_steps`` is not below its step.

Without this, a second run into the same ``trainer.output_dir`` silently continued the first one's weights,
optimizer and schedule, and dropped its own ``optim.lr``. ``resume_problems`` runs twice: under the run folder's
lock before anything loads (``cli/train.py``), and when the checkpoint is read (``restore``), where the examples
are known; each time it names each differing key with both values. ``trainer.resume_new_settings=true`` continues
a checkpoint with this run's settings on purpose: they take effect (the optimizer's hyperparameters and the
schedule are this run's) and ``metrics.jsonl`` records the keys that changed.
"""

from __future__ import annotations

import json
from pathlib import Path

from medusa_train.config.train import TrainConfig, to_dict
from medusa_train.training import checkpoint

CONFIG_FILE = "config.json"  # in each checkpoint folder: the training config that wrote it

# Keys a resumed run may change: how long it runs, how often it logs, evaluates and saves, what it writes at the
# end, where it logs, how its data is tokenised or where its captured states live (the examples are the same), and
# whether activations are recomputed (the same gradients).
MAY_CHANGE_ON_RESUME = ("trainer.max_steps", "trainer.epochs", "trainer.save_every", "trainer.keep_last",
                        "trainer.eval_every", "trainer.log_every", "trainer.export", "trainer.merge_export",
                        "trainer.merge_into", "trainer.resume", "trainer.resume_new_settings", "trainer.output_dir",
                        "logger", "data.num_proc",
                        "data.cache_dir", "model.device_map", "peft.gradient_checkpointing")


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    flat: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# Keys renamed since a checkpoint may have been written (stored name -> current name), and values respelled: a run
# started before the rename resumes as it was.
RENAMED = {"heads.vocab_size": "heads.draft_vocab_size", "eagle3.vocab_size": "eagle3.draft_vocab_size"}
RESPELLED = {"trainer.mixed_precision": {"bf16": "bfloat16", "fp16": "float16"}}


def _current_names(stored: dict[str, object]) -> dict[str, object]:
    """A stored config's flat keys and values as today's config names and spells them."""
    renamed = {RENAMED.get(k, k): v for k, v in stored.items()}
    return {k: RESPELLED.get(k, {}).get(v, v) if isinstance(v, str) else v for k, v in renamed.items()}


def _may_change(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in MAY_CHANGE_ON_RESUME)


def stored_config(path: Path) -> dict | None:
    """The training config a checkpoint was written with, or ``None`` when it holds none."""
    file = Path(path) / CONFIG_FILE
    return checkpoint.read_json(file) if file.is_file() else None


def differences(stored: dict, current: dict) -> list[tuple[str, object, object]]:
    """``(key, stored value, current value)`` of every key that differs and may not change on resume. A key the
    stored config lacks (written before that setting existed) counts as its default, which that run trained with."""
    a, b = _current_names(flatten(stored)), flatten(current)
    a = {**{k: v for k, v in flatten(to_dict(TrainConfig())).items() if k not in a and k in b}, **a}
    missing = object()
    return [(k, a.get(k, missing), b.get(k, missing)) for k in sorted(set(a) | set(b))
            if not _may_change(k) and a.get(k, missing) != b.get(k, missing)]


def _show(value) -> str:
    return "(absent)" if not isinstance(value, (str, int, float, bool, list, type(None))) else json.dumps(value)


def checkpoint_to_resume(cfg: TrainConfig) -> Path | None:
    """The checkpoint this run continues: the latest in ``trainer.output_dir`` (``auto``), the one named, or none."""
    resume = cfg.trainer.resume
    if resume == "never":
        return None
    return checkpoint.latest_checkpoint(cfg.trainer.output_dir) if resume == "auto" else Path(resume)


def resume_problems(cfg: TrainConfig, data_digest: str | None = None, total_steps: int | None = None) -> list[str]:
    """Why this run must not continue the checkpoint it would resume (empty when it may: none, or one written with
    these settings and, where known, these examples (``data_digest``) and no fewer steps in all than its step
    (``total_steps``, else ``trainer.max_steps`` when set)).

    ``trainer.resume=never`` into a folder that holds checkpoints is refused too: its checkpoints would sit beside
    the old run's, and the next ``auto`` would continue whichever step is higher."""
    t = cfg.trainer
    folder = checkpoint.checkpoints_dir(t.output_dir)
    if t.resume == "never":
        found = checkpoint.latest_checkpoint(t.output_dir)
        return [] if found is None else [
            f"trainer.resume=never: trainer.output_dir={t.output_dir} holds another run's checkpoints ({found.name}); "
            f"start afresh in another trainer.output_dir (or move {folder} away)"]
    path = checkpoint_to_resume(cfg)
    if path is None:
        return []
    how = (f"start fresh with another trainer.output_dir (or move {folder} away), or continue that checkpoint with "
           f"this run's settings on purpose: trainer.resume={path} trainer.resume_new_settings=true")
    stored = stored_config(path)
    if stored is None and not t.resume_new_settings:
        return [f"trainer.output_dir={t.output_dir}: its checkpoint {path} does not say which settings "
                f"wrote it, so it may be another run's: {how}"]
    problems = [] if t.resume_new_settings else [
        f"{key}={_show(now)}: the run in trainer.output_dir={t.output_dir} ({path.name}) was trained "
        f"with {key}={_show(then)}" for key, then, now in differences(stored, to_dict(cfg))]
    if not problems:
        checkpoint.check_readable(path)  # a corrupt file named now, before anything loads
    state = checkpoint.read_state(path)
    total_steps = t.max_steps if total_steps is None else total_steps  # known before the data when max_steps is set
    if total_steps is not None and total_steps < state["step"]:
        problems.append(f"trainer.max_steps={t.max_steps}: this run has {total_steps} steps in all, fewer than the "
                        f"{state['step']} of {path}; raise it, or resume an earlier checkpoint (trainer.resume=<its "
                        "folder>)")
    if data_digest is not None and state.get("data") not in (None, data_digest) and not t.resume_new_settings:
        problems.append(f"data.source={cfg.data.source}: its examples differ from those {path} was trained on "
                        "(the data changed since)")
    if problems:
        problems.append(f"resuming {path} would mix two runs: {how}")
    return problems


def restore(cfg: TrainConfig, parameters: dict, optimizer, scheduler, data_digest: str, total_steps: int,
            num_processes: int) -> tuple[Path, dict, list] | None:
    """Load the checkpoint this run continues into ``parameters``, ``optimizer`` and ``scheduler``; ``(path, state,
    RNG states)``, or ``None`` for a fresh start. Checked first against this run (``resume_problems``)."""
    from medusa_train.config.check import ConfigError

    path = checkpoint_to_resume(cfg)
    if path is None:
        return None
    problems = resume_problems(cfg, data_digest, total_steps)
    if problems:
        raise ConfigError(problems)
    state, rng = checkpoint.load_checkpoint(path, parameters, optimizer, scheduler)
    saved_by = state.get("num_processes", num_processes)
    if saved_by != num_processes:  # its data position counts batches per process
        raise ValueError(f"{path} was written by {saved_by} process(es), this run has "
                         f"{num_processes}: resume with --num_processes {saved_by}, or start afresh "
                         "with another trainer.output_dir")
    return path, state, rng


def changed_settings(cfg: TrainConfig, path: Path) -> dict[str, list]:
    """``{key: [stored, now]}`` of the settings this run changed from the checkpoint ``path`` (the record of a
    ``trainer.resume_new_settings`` resume)."""
    stored = stored_config(path)
    return {} if stored is None else {k: [then if _show(then) != "(absent)" else None, now]
                                      for k, then, now in differences(stored, to_dict(cfg))}
