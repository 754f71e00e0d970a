"""Runs never mix: a checkpoint carries the settings it was trained with, and ``trainer.resume=auto`` continues
only a run whose settings equal this one's (apart from the keys that may change on resume).

Without this, a second run into the same ``trainer.output_dir`` silently continued the first one's weights,
optimizer and schedule, and dropped its own ``optim.lr``. ``resume_problems`` runs with the config check,
before anything loads, and names each differing key with both values.
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
                        "trainer.merge_into", "trainer.resume", "trainer.output_dir", "logger", "data.num_proc",
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
    return json.loads(file.read_text()) if file.is_file() else None


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


def resume_problems(cfg: TrainConfig) -> list[str]:
    """Why ``trainer.resume=auto`` must not continue the checkpoint in ``trainer.output_dir`` (empty when it may:
    no checkpoint there, or one written with these settings). ``never`` and an explicit path are the user's call."""
    if cfg.trainer.resume != "auto":
        return []
    latest = checkpoint.latest_checkpoint(cfg.trainer.output_dir)
    if latest is None:
        return []
    how = (f"start fresh with another trainer.output_dir (or delete {checkpoint.checkpoints_dir(cfg.trainer.output_dir)}),"
           f" or continue that run with this run's settings on purpose: trainer.resume={latest}")
    stored = stored_config(latest)
    if stored is None:
        return [f"trainer.output_dir={cfg.trainer.output_dir}: its checkpoint {latest} does not say which settings "
                f"wrote it, so it may be another run's: {how}"]
    differ = differences(stored, to_dict(cfg))
    if not differ:
        return []
    return [f"{key}={_show(now)}: the run in trainer.output_dir={cfg.trainer.output_dir} ({latest.name}) was trained "
            f"with {key}={_show(then)}" for key, then, now in differ] + [f"trainer.resume=auto would mix two runs: {how}"]
