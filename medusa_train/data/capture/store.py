"""Hidden-state capture: the frozen backbone's final hidden states, stored once, read by every epoch and rank.

With a frozen backbone (Medusa-1, or Medusa-2's stage 1) every epoch would recompute the same hidden
states; on the packaged model the backbone is a third of a step, on a 70B model nearly all of it.
``capture_split`` runs the backbone once over a split's examples and stores, per example, its
final-norm hidden states (in the backbone's dtype: exactly what the uncached path feeds the heads)
and labels. ``medusa-train capture`` is this stage on its own; ``data.cache_hidden_states=true`` runs it
before training.

One folder per split, named by the settings key (a hash of everything that changes the states:
model section, data, max_length, tokenizer, split)::

    <root>/<key>-<split>/shard-00000.safetensors   {"<i>.hidden": (T, H), "<i>.labels": (T,)}
                                                   (+ "<i>.input_ids": (T,) for an EAGLE-3 draft, whose
                                                   "hidden" is its three states and the final one, T x 4H)
                         shard-00000.json          its manifest: key, example ids, tokens, bytes
                         index.json                written last: key, settings, shards, bytes per token

Shards are sized in bytes (``data.shard_bytes``): a shard holds ``shard_bytes // (hidden x bytes per
element + 8)`` tokens of states and labels, so a 4096-wide backbone's shards are as large on disk and in
host memory (a shard is held whole before it is written) as a 576-wide one's. The shard plan is fixed
by the examples and that size alone (length-sorted), not by the number of processes: process ``r`` of ``n`` writes shards ``r, r + n, ...``, and a run resumed
with another ``n`` keeps every finished shard. A shard is written to a ``.partial`` name and renamed,
then its manifest; a shard without its manifest, or whose size differs from it, is torn: it is redone,
never read. A manifest or index with another settings key is refused with both keys.

The tokens a batch's examples share at their start (a chat template's system prompt, a data set's own) run through
the backbone once, their cache then read by every example's remaining tokens (``shared_prefix``): the same states, up
to float rounding, for less work.

Training reads the shards lazily (``load_captured``: memory-mapped safetensors), so each process
reads from disk only the examples of its own batches.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from medusa_train.backbone import assets
from medusa_train.data.tokenize import IGNORE_INDEX
from medusa_train.model.contract import SharedStart

CAPTURE_FORMAT = 2
SHARD_BYTES = 1 << 30  # 1 GiB of states and labels per shard: each process holds one whole shard before writing it
LABEL_BYTES = 8  # int64 label per token

# (input_ids, attention_mask, start=None) -> (B, T, H): the states of input_ids, after the positions a ``SharedStart``
# holds when one is given (the call adds them; attention_mask then covers those positions too)
HiddenFn = Callable[..., torch.Tensor]
# Tokens a batch's examples must share at their start for the capture to run them once (a chat template's system
# prompt: 24 tokens on the packaged model, 13% of its demo's tokens; hundreds where the data carries its own)
MIN_SHARED_PREFIX = 8


class CaptureMismatch(ValueError):
    """A stored shard or index was captured with other settings than the ones asked for."""


def cache_key(**parts) -> str:
    """A short stable hash of what determines the hidden states (files by size and mtime)."""
    normalised = {}
    for name, value in sorted(parts.items()):
        path = Path(str(value)) if value is not None else None
        if path is not None and path.is_file():
            stat = path.stat()
            value = f"{path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}"
        normalised[name] = str(value)
    normalised["format"] = CAPTURE_FORMAT
    return hashlib.sha256(json.dumps(normalised, sort_keys=True).encode()).hexdigest()[:16]


def default_cache_root() -> Path:
    return assets.cache_dir() / "hidden"


def bytes_per_token(hidden_size: int, dtype: torch.dtype) -> int:
    """What one captured token stores: its hidden state in ``dtype`` and its int64 label."""
    return hidden_size * torch.empty((), dtype=dtype).element_size() + LABEL_BYTES


def tokens_per_shard(shard_bytes: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Tokens a shard of ``shard_bytes`` holds (at least 1; safetensors' header comes on top)."""
    if shard_bytes < 1:
        raise ValueError(f"data.shard_bytes={shard_bytes}: must be >= 1")
    return max(1, shard_bytes // bytes_per_token(hidden_size, dtype))


@torch.no_grad()
def probe_tokens_per_shard(hidden_fn: HiddenFn, shard_bytes: int, device: torch.device | str = "cpu",
                           extra_bytes: int = 0) -> int:
    """``tokens_per_shard`` for the states ``hidden_fn`` returns (its width and dtype, autocast included),
    from a one-token forward; ``extra_bytes``: what else a token stores (its id, for an EAGLE-3 draft)."""
    one = torch.ones(1, 1, dtype=torch.long, device=device)
    hidden = hidden_fn(one, one)
    if shard_bytes < 1:
        raise ValueError(f"data.shard_bytes={shard_bytes}: must be >= 1")
    return max(1, shard_bytes // (bytes_per_token(hidden.shape[-1], hidden.dtype) + extra_bytes))


def plan_shards(lengths: Sequence[int], shard_tokens: int) -> list[list[int]]:
    """Example ids per shard: length-sorted (little padding), at most ``shard_tokens`` tokens per shard
    (an example longer than that is a shard of its own)."""
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens={shard_tokens}: must be >= 1 (raise data.shard_bytes)")
    shards, current, tokens = [], [], 0
    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        if current and tokens + lengths[i] > shard_tokens:
            shards.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += lengths[i]
    return shards + ([current] if current else [])


def shard_name(number: int) -> str:
    return f"shard-{number:05d}.safetensors"


@torch.no_grad()
def capture_split(hidden_fn: HiddenFn, examples: Sequence[dict], folder: str | os.PathLike, key: str,
                  batch_size: int = 8, device: torch.device | str = "cpu", rank: int = 0, world: int = 1,
                  shard_bytes: int = SHARD_BYTES, desc: str = "capture", keep_tokens: bool = False) -> dict:
    """Write this process's shards of ``examples`` into ``folder`` (finished ones are kept).

    Args:
        hidden_fn: ``(input_ids, attention_mask) -> hidden`` of the frozen backbone.
        examples: ``{"input_ids", "labels"}`` token lists.
        folder: The split's folder.
        key: The settings key; stored in every manifest, and a stored one that differs is refused.
        rank, world: This process writes shards ``rank, rank + world, ...``.
        shard_bytes: Bytes of states and labels per shard (``data.shard_bytes``).
        keep_tokens: Also store each example's token ids (``<i>.input_ids``): an EAGLE-3 draft reads the tokens'
            embeddings beside the states (Medusa heads do not: their captures stay as they were).

    Returns:
        ``{"shards": written here, "kept": found finished, "tokens": captured here, "seconds": ...,
        "shard_tokens": tokens per shard, the plan's unit (pass it to ``write_index``)}``.
    """
    from tqdm.auto import tqdm

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shard_tokens = probe_tokens_per_shard(hidden_fn, shard_bytes, device, LABEL_BYTES if keep_tokens else 0)
    plan = plan_shards([len(e["input_ids"]) for e in examples], shard_tokens)
    mine = [s for s in range(len(plan)) if s % world == rank]
    todo = [s for s in mine if not shard_finished(folder, s, plan[s], key)]
    tokens = sum(len(examples[i]["input_ids"]) for s in todo for i in plan[s])
    bar = tqdm(total=tokens, desc=f"{desc} (rank {rank})" if world > 1 else desc, unit="tok", dynamic_ncols=True,
               disable=not todo)
    started, written, shared = time.perf_counter(), 0, 0
    for s in todo:
        size, saved = _capture_shard(hidden_fn, examples, plan[s], folder, s, key, batch_size, device, bar, keep_tokens)
        written, shared = written + size, shared + saved
        bar.set_postfix(bytes_per_tok=f"{written / max(bar.n, 1):.0f}")
    bar.close()
    return {"shards": len(todo), "kept": len(mine) - len(todo), "tokens": tokens, "shared_tokens": shared,
            "seconds": time.perf_counter() - started, "shard_tokens": shard_tokens}


def shared_prefix(input_ids: torch.Tensor, lengths: Sequence[int]) -> int:
    """How many tokens every row of ``input_ids`` (a right-padded batch) starts with, leaving each row at least one
    of its own: 0 for one row, or when fewer than ``MIN_SHARED_PREFIX`` are shared."""
    if input_ids.shape[0] < 2:
        return 0
    same = (input_ids[:, :min(lengths) - 1] == input_ids[:1, :min(lengths) - 1]).all(dim=0)
    shared = int(same.long().cumprod(0).sum())
    return shared if shared >= MIN_SHARED_PREFIX else 0


@torch.no_grad()
def batch_states(hidden_fn: HiddenFn, input_ids: torch.Tensor, mask: torch.Tensor, shared: int) -> torch.Tensor:
    """``hidden_fn``'s states of a right-padded batch whose rows share their first ``shared`` tokens: those run once
    (one row), every row's rest reads their cache."""
    if not shared:
        return hidden_fn(input_ids, mask)
    start = SharedStart()
    head = hidden_fn(input_ids[:1, :shared], mask[:1, :shared], start)
    if not start.repeat(input_ids.shape[0]):  # a cache with more than keys and values (hybrid): the batch runs whole
        return hidden_fn(input_ids, mask)
    tail = hidden_fn(input_ids[:, shared:], mask, start)
    return torch.cat([head.expand(input_ids.shape[0], -1, -1).to(tail.device), tail], dim=1)


def _capture_shard(hidden_fn: HiddenFn, examples: Sequence[dict], ids: list[int], folder: Path, number: int,
                   key: str, batch_size: int, device, bar, keep_tokens: bool = False) -> tuple[int, int]:
    """Write one shard; ``(its bytes, the tokens its batches ran once for all their rows)``."""
    tensors, tokens, saved = {}, 0, 0
    for begin in range(0, len(ids), batch_size):
        batch_ids = ids[begin:begin + batch_size]
        lengths = [len(examples[i]["input_ids"]) for i in batch_ids]
        input_ids = torch.zeros(len(batch_ids), max(lengths), dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, (i, n) in enumerate(zip(batch_ids, lengths)):
            input_ids[row, :n] = torch.tensor(examples[i]["input_ids"])
            mask[row, :n] = 1
        shared = shared_prefix(input_ids, lengths)
        hidden = batch_states(hidden_fn, input_ids.to(device), mask.to(device), shared).cpu()
        saved += shared * (len(batch_ids) - 1)
        for row, (i, n) in enumerate(zip(batch_ids, lengths)):
            tensors[f"{i}.hidden"] = hidden[row, :n].clone()
            tensors[f"{i}.labels"] = torch.tensor(examples[i]["labels"], dtype=torch.long)
            if keep_tokens:
                tensors[f"{i}.input_ids"] = input_ids[row, :n].clone()
        tokens += sum(lengths)
        bar.update(sum(lengths))
    path = folder / shard_name(number)
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, str(partial))
    partial.replace(path)
    size = path.stat().st_size
    _write_json(path.with_suffix(".json"), {"format": CAPTURE_FORMAT, "key": key, "examples": ids, "tokens": tokens,
                                            "bytes": size})
    return size, saved


def shard_finished(folder: Path, number: int, ids: list[int], key: str) -> bool:
    """Whether shard ``number`` is complete for these example ids and settings; a torn one is removed.

    Raises:
        CaptureMismatch: its manifest names another settings key.
    """
    path = folder / shard_name(number)
    manifest = _read_json(path.with_suffix(".json"))
    if manifest is not None and manifest.get("key") != key:
        raise CaptureMismatch(f"{path.with_suffix('.json')} holds hidden states captured with settings key "
                              f"{manifest.get('key')}, not {key} (another backbone, dtype, tokenizer or data): "
                              f"use another data.cache_dir, or delete {folder}")
    if manifest is not None and manifest.get("examples") == ids and path.is_file() \
            and path.stat().st_size == manifest.get("bytes"):
        return True
    for torn in (path, path.with_suffix(".json"), path.with_name(path.name + ".partial")):
        torn.unlink(missing_ok=True)
    return False


def write_index(folder: str | os.PathLike, examples: Sequence[dict], key: str, settings: dict,
                shard_tokens: int) -> dict:
    """Check every shard of the plan (``shard_tokens``: ``capture_split``'s) is finished, then write
    ``index.json`` (call once, after every process's ``capture_split``). Returns the index."""
    folder = Path(folder)
    plan = plan_shards([len(e["input_ids"]) for e in examples], shard_tokens)
    missing = [s for s in range(len(plan)) if not shard_finished(folder, s, plan[s], key)]
    if missing:
        raise RuntimeError(f"{folder}: shards {missing[:5]} of {len(plan)} are not finished; run the capture again")
    manifests = [_read_json((folder / shard_name(s)).with_suffix(".json")) for s in range(len(plan))]
    tokens = sum(m["tokens"] for m in manifests)
    index = {"format": CAPTURE_FORMAT, "key": key, "settings": settings, "examples": len(examples), "tokens": tokens,
             "bytes": sum(m["bytes"] for m in manifests), "bytes_per_token": sum(m["bytes"] for m in manifests) / max(tokens, 1),
             "shards": [{"file": shard_name(s), "examples": len(plan[s]), "tokens": m["tokens"], "bytes": m["bytes"]}
                        for s, m in enumerate(manifests)]}
    _write_json(folder / "index.json", index)
    return index


def read_index(folder: str | os.PathLike, key: str) -> dict | None:
    """The split's index if the capture is complete and intact (``None`` otherwise: capture it again).

    Raises:
        CaptureMismatch: the index names another settings key.
    """
    folder = Path(folder)
    index = _read_json(folder / "index.json")
    if index is None:
        return None
    if index.get("key") != key:
        raise CaptureMismatch(f"{folder / 'index.json'} holds hidden states captured with settings key "
                              f"{index.get('key')}, not {key} (another backbone, dtype, tokenizer or data): "
                              f"use another data.cache_dir, or delete {folder}")
    for shard in index["shards"]:
        path = folder / shard["file"]
        if not path.is_file() or path.stat().st_size != shard["bytes"]:
            (folder / "index.json").unlink(missing_ok=True)  # a torn shard: the capture redoes it
            return None
    return index


def load_captured(folder: str | os.PathLike, key: str) -> list[dict]:
    """Examples ``{"hidden": (shard path, name), "labels": (shard path, name), "input_ids": range(T)}`` (and
    ``"tokens": (shard path, name)`` where the capture kept the token ids) in
    the split's original order. States and labels stay on disk until ``HiddenCollator`` reads a batch
    (the lengths come from the shards' headers); ``input_ids`` holds only the length so length-grouped
    samplers work unchanged.

    Raises:
        FileNotFoundError: the capture is missing, unfinished or has a torn shard (capture it again).
        CaptureMismatch: it was captured with other settings.
    """
    folder = Path(folder)
    index = read_index(folder, key)
    if index is None:
        raise FileNotFoundError(f"{folder}: no complete hidden-state capture; run medusa-train capture (or train "
                                "with data.cache_hidden_states=true) with the same settings")
    examples: list[dict | None] = [None] * index["examples"]
    for shard in index["shards"]:
        path = str(folder / shard["file"])
        with safe_open(path, framework="pt") as f:
            names = set(f.keys())
            for name in names:
                i, kind = name.split(".")
                if kind == "labels":
                    length = f.get_slice(name).get_shape()[0]
                    examples[int(i)] = {"hidden": (path, f"{i}.hidden"), "labels": (path, name),
                                        "input_ids": range(length)}
                    if f"{i}.input_ids" in names:  # kept for an EAGLE-3 draft
                        examples[int(i)]["tokens"] = (path, f"{i}.input_ids")
    missing = [i for i, e in enumerate(examples) if e is None]
    if missing:
        raise FileNotFoundError(f"{folder}: examples {missing[:5]} are in no shard; delete the folder and capture again")
    return examples


class HiddenCollator:
    """Reads a batch's hidden states from their shards (memory-mapped) and pads them (zeros) and the labels
    (``IGNORE_INDEX``) to the longest example."""

    def __init__(self):
        self._open: dict[str, object] = {}

    def read(self, source: tuple[str, str] | torch.Tensor) -> torch.Tensor:
        if isinstance(source, torch.Tensor):
            return source
        path, name = source
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path].get_tensor(name)

    def __call__(self, examples: Sequence[dict]) -> dict[str, torch.Tensor]:
        states = [self.read(e["hidden"]) for e in examples]
        targets = [self.read(e["labels"]) for e in examples]
        longest = max(len(t) for t in targets)
        hidden = torch.zeros(len(examples), longest, states[0].shape[-1], dtype=states[0].dtype)
        labels = torch.full((len(examples), longest), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros(len(examples), longest, dtype=torch.long)
        for row, (state, target) in enumerate(zip(states, targets)):
            n = len(target)
            hidden[row, :n] = state
            labels[row, :n] = target
            mask[row, :n] = 1
        batch = {"hidden": hidden, "labels": labels, "attention_mask": mask}
        if "tokens" in examples[0]:  # the token ids, where the capture kept them
            batch["input_ids"] = torch.zeros(len(examples), longest, dtype=torch.long)
            for row, e in enumerate(examples):
                tokens = self.read(e["tokens"])
                batch["input_ids"][row, :len(tokens)] = tokens
        return batch


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, value: dict) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(value, indent=1) + "\n")
    partial.replace(path)
