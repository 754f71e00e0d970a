"""The decoder's KV cache: made here for every decoding path (``tree_generate``, the cost curve's steps, the graphed
steps' static cache), for a backbone whose cache is keys and values alone; others are refused before any work. The
dynamic one appends each step's keys and values in place (``backbone/appending_cache.py``), as HF ``generate``'s does
here (``plain_generate``)."""

from __future__ import annotations

from transformers import StaticCache

from medusa_train.backbone.appending_cache import AppendingCache
from medusa_train.model.contract import check_tree_decodable

KV_CACHES = ("dynamic", "static")  #: the caches ``tree_generate`` decodes with (``kv_cache=``)


def new_cache(kind: str, backbone, max_len: int) -> AppendingCache | StaticCache:
    """An empty cache of ``kind`` (``KV_CACHES``) for ``backbone``: a static one holds ``max_len`` tokens, a dynamic
    one keeps room for them (and grows past them). A backbone the decoder cannot verify a tree on is refused
    (``check_tree_decodable``)."""
    check_tree_decodable(backbone)
    if kind == "dynamic":
        return AppendingCache(room=max_len)
    if kind == "static":
        return StaticCache(config=backbone.config, max_cache_len=max_len)
    raise ValueError(f"kv_cache={kind!r}: must be one of {list(KV_CACHES)}")
