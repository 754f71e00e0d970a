"""Cache of a frozen backbone's final hidden states, so heads train for many epochs without it.

With a frozen backbone (Medusa-1) every epoch would recompute the same hidden states; on the
packaged model the backbone is a third of a step. ``build_hidden_cache`` runs the backbone once
over the examples and stores, per example, its final-norm hidden states (in the backbone's
dtype, bf16 by default: exactly what the uncached path feeds the heads) and labels, in
safetensors shards. The folder is keyed by everything that changes the states (model, dtype,
data, max_length, tokenizer; the whole model section, so a 4-bit backbone never reads states cached
for the unquantized one) and is written to a temporary name and renamed when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from medusa_train.backbone import assets
from medusa_train.data.tokenize import IGNORE_INDEX

CACHE_FORMAT = 1
SHARD_TOKENS = 1 << 20  # ~1.1 GiB of bf16 states at hidden 576; keeps shards a manageable size


def cache_key(**parts) -> str:
    """A short stable hash of what determines the hidden states (files by size and mtime)."""
    normalised = {}
    for name, value in sorted(parts.items()):
        path = Path(str(value)) if value is not None else None
        if path is not None and path.is_file():
            stat = path.stat()
            value = f"{path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}"
        normalised[name] = str(value)
    normalised["format"] = CACHE_FORMAT
    return hashlib.sha256(json.dumps(normalised, sort_keys=True).encode()).hexdigest()[:16]


def default_cache_root() -> Path:
    return assets.cache_dir() / "hidden"


@torch.no_grad()
def build_hidden_cache(model, examples: Sequence[dict], directory: str | os.PathLike, batch_size: int = 8,
                       device: torch.device | str = "cpu", desc: str = "caching hidden states") -> Path:
    """Run ``model`` (a ``MedusaModel``) once over ``examples`` and store hidden states + labels.

    Returns the cache folder; if it is already complete, nothing is recomputed.
    """
    from tqdm.auto import tqdm

    final = Path(directory)
    if (final / "index.json").is_file():
        return final
    tmp = assets.atomic_dir(final)
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["input_ids"]))  # little padding
    shards, shard, shard_tokens = [], {}, 0
    bar = tqdm(total=sum(len(e["input_ids"]) for e in examples), desc=desc, unit="tok", dynamic_ncols=True)
    for begin in range(0, len(order), batch_size):
        batch_ids = order[begin:begin + batch_size]
        lengths = [len(examples[i]["input_ids"]) for i in batch_ids]
        input_ids = torch.zeros(len(batch_ids), max(lengths), dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, (i, n) in enumerate(zip(batch_ids, lengths)):
            input_ids[row, :n] = torch.tensor(examples[i]["input_ids"])
            mask[row, :n] = 1
        hidden = model(input_ids.to(device), attention_mask=mask.to(device)).hidden_states.cpu()
        for row, (i, n) in enumerate(zip(batch_ids, lengths)):
            shard[f"{i}.hidden"] = hidden[row, :n].clone()
            shard[f"{i}.labels"] = torch.tensor(examples[i]["labels"], dtype=torch.long)
            shard_tokens += n
        bar.update(sum(lengths))
        if shard_tokens >= SHARD_TOKENS:
            shards.append(_write_shard(tmp, len(shards), shard))
            shard, shard_tokens = {}, 0
    if shard:
        shards.append(_write_shard(tmp, len(shards), shard))
    bar.close()
    (tmp / "index.json").write_text(json.dumps({"format": CACHE_FORMAT, "examples": len(examples),
                                                 "shards": shards}) + "\n")
    assets.publish_dir(tmp, final)
    return final


def _write_shard(folder: Path, number: int, tensors: dict[str, torch.Tensor]) -> str:
    name = f"shard-{number:05d}.safetensors"
    save_file(tensors, str(folder / name))
    return name


def load_hidden_cache(directory: str | os.PathLike) -> list[dict]:
    """Examples ``{"hidden": (T, H) tensor, "labels": list[int], "input_ids": placeholder}`` in original order.

    ``input_ids`` holds only the length (a range) so length-grouped samplers work unchanged.
    """
    directory = Path(directory)
    index = json.loads((directory / "index.json").read_text())
    examples: list[dict | None] = [None] * index["examples"]
    for shard in index["shards"]:
        tensors = load_file(str(directory / shard))
        for key, tensor in tensors.items():
            i, kind = key.split(".")
            slot = examples[int(i)] or {}
            slot[kind] = tensor
            examples[int(i)] = slot
    missing = [i for i, e in enumerate(examples) if e is None]
    if missing:
        raise ValueError(f"hidden-state cache {directory} is incomplete (examples {missing[:5]} missing); delete it")
    return [{"hidden": e["hidden"], "labels": e["labels"], "input_ids": range(len(e["labels"]))} for e in examples]


class HiddenCollator:
    """Pads cached hidden states (zeros) and labels (``IGNORE_INDEX``) to the longest example in the batch."""

    def __call__(self, examples: Sequence[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(e["labels"]) for e in examples)
        hidden_size = examples[0]["hidden"].shape[-1]
        hidden = torch.zeros(len(examples), longest, hidden_size, dtype=examples[0]["hidden"].dtype)
        labels = torch.full((len(examples), longest), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros(len(examples), longest, dtype=torch.long)
        for row, e in enumerate(examples):
            n = len(e["labels"])
            hidden[row, :n] = e["hidden"]
            labels[row, :n] = e["labels"]
            mask[row, :n] = 1
        return {"hidden": hidden, "labels": labels, "attention_mask": mask}
