"""Training checkpoints: trainable weights, optimizer, scheduler, RNG and data position.

Only parameters that train are saved (the frozen backbone is reloaded from its source), so a
checkpoint of the packaged model's heads is tens of MB, not the whole model. Each checkpoint is
written to a temporary folder and renamed into ``<output_dir>/checkpoints/step-NNNNNNN``, so a
crash (even ``kill -9``) leaves either the previous checkpoints or the new one, never half of one.

Parameters sharded over the processes (Medusa-2's LoRA under FSDP, ``shard.py``) are saved whole, gathered
from every process, and so is their optimizer state (``full_state``): a sharded run's checkpoint has the
same files and names as an unsharded one's. On resume every process reads the (small) trainable weights and
optimizer state and keeps its own shard of each (``load_checkpoint``).

No pickles: weights are safetensors, the data position and the RNG states JSON (``rng.json``), and the optimizer's
state safetensors (``optimizer.safetensors``: its tensors, with its hyperparameters, its other values and the schedule
as JSON in the file's metadata). A checkpoint written before these holds ``optimizer.pt`` and ``rng.pt``, read with
``torch.load(weights_only=True)`` (NumPy's array types allowed for the RNG): nothing read back runs code. A file that
cannot be read is named in one line (``FileProblem``).
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from medusa_train.backbone import assets
from medusa_train.config.check import FileProblem
from medusa_train.training.run_folder import RunFolder
from medusa_train.training.shard import full, is_sharded

STEP_DIR = re.compile(r"^step-(\d+)$")
WEIGHTS_FILE, OPTIMIZER_FILE, RNG_FILE, STATE_FILE = ("trainable.safetensors", "optimizer.safetensors", "rng.json",
                                                       "state.json")
LEGACY_OPTIMIZER_FILE, LEGACY_RNG_FILE = "optimizer.pt", "rng.pt"  #: what checkpoints held before (pickles)


def checkpoints_dir(output_dir: str | Path) -> Path:
    return RunFolder(Path(output_dir)).checkpoints


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and (p / "state.json").is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def rng_to_json(state: dict) -> dict:
    """One process's ``rng_state()`` as plain JSON values (lists of ints)."""
    version, key, gauss = state["python"]
    name, keys, pos, has_gauss, cached = state["numpy"]
    return {"python": [version, list(key), gauss], "numpy": [name, np.asarray(keys).tolist(), int(pos), int(has_gauss),
                                                             float(cached)],
            "torch": state["torch"].tolist(),
            "cuda": None if state.get("cuda") is None else [s.tolist() for s in state["cuda"]]}


def rng_from_json(saved: dict) -> dict:
    """``rng_to_json``'s inverse: a state ``set_rng_state`` takes."""
    version, key, gauss = saved["python"]
    name, keys, pos, has_gauss, cached = saved["numpy"]
    return {"python": (version, tuple(key), gauss),
            "numpy": (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached),
            "torch": torch.tensor(saved["torch"], dtype=torch.uint8),
            "cuda": None if saved.get("cuda") is None else [torch.tensor(s, dtype=torch.uint8) for s in saved["cuda"]]}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(output_dir: str | Path, step: int, trainable: dict[str, torch.Tensor], optimizer, scheduler,
                    position: dict, rng_by_rank: list[dict], keep_last: int, config: dict | None = None,
                    optimizer_state: dict | None = None) -> Path:
    """Write one checkpoint atomically and prune all but the newest ``keep_last``; ``config``: the training config
    that wrote it (``config.json``, read by ``resume.py`` so that runs never mix); ``optimizer_state``: what to
    save for ``optimizer`` (default its ``state_dict()``; gathered whole when it is sharded: ``full_state``)."""
    final = checkpoints_dir(output_dir) / f"step-{step:07d}"
    tmp = assets.atomic_dir(final)
    save_file({k: v.detach().contiguous().cpu() for k, v in trainable.items()}, str(tmp / WEIGHTS_FILE))
    optimizer_state = optimizer.state_dict() if optimizer_state is None else optimizer_state
    save_optimizer(tmp / OPTIMIZER_FILE, optimizer_state, scheduler.state_dict())
    (tmp / RNG_FILE).write_text(json.dumps([rng_to_json(r) for r in rng_by_rank]) + "\n")
    (tmp / STATE_FILE).write_text(json.dumps({"step": step, **position}, indent=2) + "\n")
    if config is not None:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    assets.replace_dir(tmp, final)
    for old in list_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def parameter_device(optimizer) -> torch.device:
    """The device of the parameters ``optimizer`` updates (this process's), where their state belongs."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            return param.device
    return torch.device("cpu")


def onto(device: torch.device):
    """A ``torch.load`` ``map_location`` putting what was saved from an accelerator on ``device`` (unmapped, every
    rank would put the saving rank's state on that rank's device, cuda:0); what was saved from the CPU (AdamW's
    ``step`` counters) stays there."""
    def restore(storage, location: str):
        return torch.serialization.default_restore_location(storage, "cpu" if location == "cpu" else str(device))
    return restore


def full_state(parameters: dict[str, torch.nn.Parameter], optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """``(trainable weights, optimizer state dict)`` whole, on the CPU: sharded parameters and their optimizer
    state gathered from every process, one tensor at a time. A collective: every process calls it."""
    def whole(tensor: torch.Tensor) -> torch.Tensor:
        return full(tensor).detach().cpu()

    weights = {name: whole(param) for name, param in parameters.items()}
    state = optimizer.state_dict()
    state["state"] = {index: {k: whole(v) if isinstance(v, torch.Tensor) else v for k, v in values.items()}
                      for index, values in sorted(state["state"].items())}
    return weights, state


def _shard_like(full: torch.Tensor, param) -> torch.Tensor:
    """This process's shard of ``full`` as ``param`` (a DTensor) is sharded; every process holds ``full``."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)


def load_checkpoint(path: str | Path, parameters: dict[str, torch.nn.Parameter], optimizer, scheduler) -> tuple[dict, list]:
    """Restore weights, optimizer and scheduler in place; return ``(state, rng_by_rank)``.

    The optimizer state is read straight onto the device of this process's parameters, whichever device
    the saving process had. Sharded parameters (DTensors) and their optimizer state keep this process's shard of
    the whole tensors saved.
    """
    path = Path(path)
    tensors = _read(path / WEIGHTS_FILE, lambda f: load_file(str(f)))
    missing, unexpected = sorted(set(parameters) - set(tensors)), sorted(set(tensors) - set(parameters))
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match this run's trainable parameters "
                         f"(missing: {missing[:5]}, unexpected: {unexpected[:5]}); use trainer.resume=never "
                         "or another trainer.output_dir to start afresh")
    with torch.no_grad():
        for name, param in parameters.items():
            param.copy_(_shard_like(tensors[name], param) if is_sharded(param) else tensors[name])
    states = read_optimizer(path, parameter_device(optimizer))
    ordered = [p for group in optimizer.param_groups for p in group["params"]]  # the state dict's indices
    for index, values in states["optimizer"]["state"].items():
        param = ordered[index] if index < len(ordered) else None
        if param is not None and is_sharded(param):
            for key, value in values.items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape:  # (AdamW's step is a scalar)
                    values[key] = _shard_like(value, param)
    settings = [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in optimizer.param_groups]
    base_lrs = list(scheduler.base_lrs)
    optimizer.load_state_dict(states["optimizer"])
    scheduler.load_state_dict(states["scheduler"])
    # this run's hyperparameters and schedule (equal to the stored ones unless trainer.resume_new_settings), and the
    # learning rate they give at the checkpoint's step
    scheduler.base_lrs = base_lrs
    for group, own, base, factor in zip(optimizer.param_groups, settings, base_lrs, scheduler.lr_lambdas, strict=True):
        group.update(own)
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    return read_state(path), read_rng(path)


def _read(file: Path, read):
    """``read(file)``, or a ``FileProblem`` naming ``file`` when it is missing or cannot be read."""
    try:
        return read(file)
    except Exception as err:  # safetensors, pickle (weights_only refusals included), JSON and OS errors alike
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FileProblem(f"{file}: cannot be read ({reason[:300]}); resume from another checkpoint "
                          "(trainer.resume=<its folder>) or start afresh in another trainer.output_dir") from err


def read_json(file: Path):
    """A JSON file of a checkpoint (``FileProblem`` naming it when it cannot be read)."""
    return _read(Path(file), lambda f: json.loads(f.read_text()))


def check_readable(path: Path) -> None:
    """Raise ``FileProblem`` naming the first file of the checkpoint ``path`` that cannot be read: its JSON files
    whole, its safetensors files' headers (cheap: before anything loads, the tensors themselves when they are read)."""
    from safetensors import safe_open

    path = Path(path)
    read_state(path)
    legacy = {RNG_FILE: LEGACY_RNG_FILE, OPTIMIZER_FILE: LEGACY_OPTIMIZER_FILE}  # stands in for it in older ones
    for name in (RNG_FILE, "config.json", WEIGHTS_FILE, OPTIMIZER_FILE):
        older = legacy.get(name)
        if not (path / name).is_file() and (name == "config.json" or older and (path / older).is_file()):
            continue  # no stored settings (resume.py says so), or the older layout's file instead
        if name.endswith(".json"):
            read_json(path / name)
        else:
            _read(path / name, lambda f: safe_open(str(f), framework="pt").keys())


def read_state(path: Path) -> dict:
    """A checkpoint's ``state.json`` (its step and data position)."""
    state = read_json(Path(path) / STATE_FILE)
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise FileProblem(f"{Path(path) / STATE_FILE}: holds no step; resume from another checkpoint "
                          "(trainer.resume=<its folder>) or start afresh in another trainer.output_dir")
    return state


def save_optimizer(file: Path, optimizer_state: dict, scheduler_state: dict) -> None:
    """An optimizer's and its schedule's state dicts as one safetensors file: the state's tensors by
    ``state.<index>.<name>``, everything else (hyperparameters, other values, which tensors were on the CPU) as JSON
    in its metadata."""
    tensors, values, on_cpu = {}, {}, []
    for index, entries in optimizer_state["state"].items():
        for name, value in entries.items():
            key = f"state.{index}.{name}"
            if isinstance(value, torch.Tensor):
                tensors[key] = value.detach().contiguous().cpu()
                if value.device.type == "cpu":  # (AdamW's step counters): they stay there
                    on_cpu.append(key)
            else:
                values[key] = value
    save_file(tensors, str(file), metadata={"param_groups": json.dumps(optimizer_state["param_groups"]),
                                            "scheduler": json.dumps(scheduler_state), "values": json.dumps(values),
                                            "on_cpu": json.dumps(on_cpu)})


def read_optimizer(path: Path, device: torch.device) -> dict:
    """``{"optimizer": state dict, "scheduler": state dict}`` of the checkpoint ``path``, tensors on ``device`` but
    those saved from the CPU; an older checkpoint's ``optimizer.pt`` read with ``weights_only=True``."""
    from safetensors import safe_open

    path = Path(path)
    if not (path / OPTIMIZER_FILE).is_file() and (path / LEGACY_OPTIMIZER_FILE).is_file():
        return _read(path / LEGACY_OPTIMIZER_FILE,
                     lambda f: torch.load(f, map_location=onto(device), weights_only=True))

    def read(file: Path) -> dict:
        with safe_open(str(file), framework="pt") as f:
            meta = {k: json.loads(v) for k, v in f.metadata().items()}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        state: dict[int, dict] = {}
        for key, value in [*tensors.items(), *meta["values"].items()]:
            _, index, name = key.split(".", 2)
            if isinstance(value, torch.Tensor) and key not in meta["on_cpu"]:
                value = value.to(device)
            state.setdefault(int(index), {})[name] = value
        return {"optimizer": {"state": dict(sorted(state.items())), "param_groups": meta["param_groups"]},
                "scheduler": meta["scheduler"]}

    return _read(path / OPTIMIZER_FILE, read)


def read_rng(path: Path) -> list[dict]:
    """Every process's RNG states saved in the checkpoint ``path`` (``rng.json``, or an older one's ``rng.pt``)."""
    path = Path(path)
    if (path / RNG_FILE).is_file() or not (path / LEGACY_RNG_FILE).is_file():
        return [rng_from_json(r) for r in read_json(path / RNG_FILE)]
    core = np._core if hasattr(np, "_core") else np.core  # NumPy 2 / 1
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(allowed):  # NumPy's state is an array of uint32; nothing else is allowed
        return _read(path / LEGACY_RNG_FILE, lambda f: torch.load(f, map_location="cpu", weights_only=True))
