"""The capture stage's orchestration: where a config's states go, capturing both splits over the launched processes,
and ``medusa-train capture`` whole (``run_capture``). Which states are stored per token is the draft family's
(``captured``: a ``model.contract.CapturedStates``, from ``model.family.captured_for``), handed in by the caller, so
nothing here knows a family. Training with ``data.cache_hidden_states=true`` runs the same functions with its
config's capture view (``config.capture.capture_view``), so both find the same folders."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from medusa_train.backbone.processes import autocast_precision, check_processes, say, under_fsdp
from medusa_train.config.capture import CaptureConfig
from medusa_train.data.cache import cache_key as examples_key
from medusa_train.data.capture import store


def captured_already(cfg: CaptureConfig, captured, tokenizer, accelerator, train: list[dict], evals: list[dict]) -> bool:
    """Whether both splits' hidden states are captured for these settings (training then never runs the backbone)."""
    from accelerate.utils import broadcast_object_list

    folders = capture_folders(cfg, capture_settings(cfg, captured, tokenizer, len(train), len(evals)))
    return broadcast_object_list([all(store.read_index(f, key) is not None for f, key in folders.values())])[0]



def capture_settings(cfg: CaptureConfig, captured, tokenizer, n_train: int, n_eval: int) -> dict:
    """Everything that changes the captured hidden states (the model section but its placement: quantization
    and its settings change them as much as the weights do; what the family stores, ``captured.key``), and the
    examples' identity as the tokenised cache keys it (tokenizer and chat template, the source files' size and time,
    lengths and split)."""
    d, m = cfg.data, cfg.model
    model_section = {k: v for k, v in asdict(m).items() if k not in ("device_map", "fsdp")}
    return {"examples": examples_key(tokenizer, d.source, d.max_length, d.max_samples, d.eval_size, d.seed),
            "model": m.name_or_path, "model_section": json.dumps(model_section, sort_keys=True), "source": d.source,
            "max_samples": d.max_samples, "max_length": d.max_length, "eval_size": d.eval_size, "seed": d.seed,
            "tokenizer": tokenizer.name_or_path, "n_train": n_train, "n_eval": n_eval, **captured.key}


def capture_folders(cfg: CaptureConfig, settings: dict) -> dict[str, tuple[Path, str]]:
    """``{split: (folder, settings key)}`` of the captured hidden states for ``settings``."""
    key = store.cache_key(**settings)
    root = Path(cfg.data.cache_dir) if cfg.data.cache_dir else store.default_cache_root()
    return {split: (root / f"{key}-{split}", key) for split in ("train", "eval")}


def capture_hidden_states(cfg: CaptureConfig, captured, tokenizer, hidden_fn, accelerator, train: list[dict],
                          evals: list[dict]):
    """Capture the frozen backbone's states (``hidden_fn(input_ids, attention_mask) -> hidden``) of both splits,
    each process its share of the shards (finished shards are kept), then read them lazily: later epochs
    (and runs) never run the backbone. Returns ``(train, evals, collator)``."""
    from accelerate.utils import broadcast_object_list

    settings = capture_settings(cfg, captured, tokenizer, len(train), len(evals))
    loaded = []
    for split, examples in (("train", train), ("eval", evals)):
        folder, key = capture_folders(cfg, settings)[split]
        need = broadcast_object_list([store.read_index(folder, key) is None])[0]  # every rank decides alike
        if need:
            with accelerator.autocast():
                done = store.capture_split(
                    hidden_fn, examples, folder, key,
                    cfg.data.batch_size * 2, accelerator.device, accelerator.process_index,
                    accelerator.num_processes, cfg.data.shard_bytes, desc=f"capture {split}",
                    keep_tokens=captured.keep_tokens)
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                store.write_index(folder, examples, key, {**settings, "split": split}, done["shard_tokens"])
            accelerator.wait_for_everyone()
            say(accelerator, f"captured {split} hidden states: {done['shards']} shard(s) written, {done['kept']} kept "
                             f"(process 0), {done['tokens']:,} tokens, of them {done['shared_tokens']:,} run once for "
                             f"a batch (the start its examples share), in {folder}")
        loaded.append(store.load_captured(folder, key))
        say(accelerator, f"hidden states of {len(examples)} {split} examples read from {folder}")
    return loaded[0], loaded[1], store.HiddenCollator()


def run_capture(cfg: CaptureConfig, captured) -> dict:
    """Capture both splits (each process its share of the shards; finished ones kept) of what ``captured`` says the
    draft reads; returns the train index."""
    from accelerate import Accelerator

    from medusa_train.backbone.load import load_backbone_for
    from medusa_train.data.examples import load_examples

    accelerator = Accelerator(mixed_precision=autocast_precision(cfg.mixed_precision))
    check_processes(accelerator)
    if cfg.model.fsdp or under_fsdp(accelerator):
        raise ValueError("capture does not shard the backbone (model.fsdp, accelerate's FSDP): capture a backbone "
                         "larger than one device with one process and model.device_map=auto, or launch with "
                         "configs/accelerate/ddp.yaml (each process a whole backbone)")
    if cfg.model.device_map == "auto" and accelerator.num_processes > 1:
        raise ValueError("model.device_map=auto spreads one backbone over every device: capture with one process "
                         "(medusa-train capture ...), or drop model.device_map to give each process a copy")
    started = time.perf_counter()
    backbone, tokenizer = load_backbone_for(cfg.model, accelerator.device)
    backbone.eval()
    train, evals = load_examples(cfg.data, tokenizer, accelerator)
    capture_hidden_states(cfg, captured, tokenizer, captured.states(backbone), accelerator, train, evals)
    folders = capture_folders(cfg, capture_settings(cfg, captured, tokenizer, len(train), len(evals)))
    indexes = {split: store.read_index(folder, key) for split, (folder, key) in folders.items()}
    if accelerator.is_main_process:
        seconds = time.perf_counter() - started
        for split, index in indexes.items():
            print(f"[medusa_train] {split}: {index['examples']} examples, {index['tokens']:,} tokens, "
                  f"{len(index['shards'])} shard(s), {index['bytes'] / 2**20:,.1f} MiB "
                  f"({index['bytes_per_token']:.0f} bytes per token) in {folders[split][0]}", flush=True)
        print(f"[medusa_train] capture done in {seconds:.0f} s; train on it with the same keys and "
              "data.cache_hidden_states=true", flush=True)
    accelerator.end_training()
    return indexes["train"]
