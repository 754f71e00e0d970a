"""Capture shards are sized in bytes (``data.shard_bytes``), so a wide backbone's shards are no larger on disk
or in host memory than a narrow one's (tokens per shard would make a 4096-wide shard 7x a 576-wide one)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from helpers.backbones import PACKAGED_MODEL

from medusa_train import load_backbone
from medusa_train.config.data import DataConfig
from medusa_train.data.capture import capture_split, load_captured, tokens_per_shard, write_index


def test_a_shard_holds_what_fits_its_bytes_at_any_width():
    default = DataConfig().shard_bytes
    assert default == 2**30
    assert tokens_per_shard(default, 4096, torch.bfloat16) == 2**30 // (4096 * 2 + 8) == 130_944
    assert tokens_per_shard(default, 576, torch.bfloat16) == 2**30 // (576 * 2 + 8)
    assert tokens_per_shard(default, 8192, torch.float32) == 2**30 // (8192 * 4 + 8)
    assert tokens_per_shard(100, 4096, torch.bfloat16) == 1  # an example still gets a shard
    with pytest.raises(ValueError, match="data.shard_bytes=0"):
        tokens_per_shard(0, 4096, torch.bfloat16)


def _data_bytes(path) -> int:
    """A safetensors file's tensor bytes: its size less the 8-byte length and the JSON header."""
    raw = path.read_bytes()
    (header,) = struct.unpack("<Q", raw[:8])
    return len(raw) - 8 - header


@pytest.mark.slow
def test_shards_of_the_packaged_model_stay_within_shard_bytes(tmp_path):
    backbone, _ = load_backbone(PACKAGED_MODEL, dtype="bfloat16")
    decoder = backbone.get_decoder()
    per_token = backbone.config.hidden_size * 2 + 8  # bf16 states + int64 label: 1,160 bytes at hidden 576
    shard_bytes = 60 * per_token + per_token // 2  # 60 tokens and a half
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 9, 13, 17, 21, 25, 29, 33, 12, 7]
    examples = [{"input_ids": torch.randint(0, 1000, (n,), generator=generator).tolist(), "labels": list(range(n))}
                for n in lengths]

    def hidden_fn(ids, mask):
        return decoder(input_ids=ids, attention_mask=mask).last_hidden_state

    done = capture_split(hidden_fn, examples, tmp_path, "k", batch_size=4, shard_bytes=shard_bytes)
    assert done["shard_tokens"] == 60
    index = write_index(tmp_path, examples, "k", {}, done["shard_tokens"])
    assert index["tokens"] == sum(lengths) and len(index["shards"]) == 4
    for shard in index["shards"]:
        path = tmp_path / shard["file"]
        assert _data_bytes(path) == shard["tokens"] * per_token <= shard_bytes
        assert path.stat().st_size == shard["bytes"]
        manifest = json.loads(path.with_suffix(".json").read_text())
        assert shard["tokens"] == sum(lengths[i] for i in manifest["examples"])
    assert max(s["examples"] for s in index["shards"]) > 1  # shards are filled, not one example each
    assert len(load_captured(tmp_path, "k")) == len(examples)
