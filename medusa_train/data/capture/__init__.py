"""The capture stage: the frozen backbone's hidden states stored once (``store``: shards, index, lazy reading) and
captured over the launched processes for a config (``run``: ``medusa-train capture``, and training with
``data.cache_hidden_states=true``). The store's names are importable from here."""

from medusa_train.data.capture.store import (
    CAPTURE_FORMAT,
    SHARD_BYTES,
    CaptureMismatch,
    HiddenCollator,
    HiddenFn,
    bytes_per_token,
    cache_key,
    capture_split,
    default_cache_root,
    load_captured,
    plan_shards,
    probe_tokens_per_shard,
    read_index,
    shard_finished,
    shard_name,
    tokens_per_shard,
    write_index,
)

__all__ = ["CAPTURE_FORMAT", "SHARD_BYTES", "CaptureMismatch", "HiddenCollator", "HiddenFn", "bytes_per_token", "cache_key", "capture_split", "default_cache_root", "load_captured", "plan_shards", "probe_tokens_per_shard", "read_index", "shard_finished", "shard_name", "tokens_per_shard", "write_index"]
