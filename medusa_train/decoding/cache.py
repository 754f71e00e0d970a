"""The decoder's KV cache: made here for every decoding path (``tree_generate``, the cost curve's steps, the graphed
steps' static cache), for a backbone whose cache is keys and values alone; others are refused before any work."""

from __future__ import annotations

from transformers import DynamicCache, StaticCache

from medusa_train.model.contract import check_tree_decodable

KV_CACHES = ("dynamic", "static")  #: the caches ``tree_generate`` decodes with (``kv_cache=``)


def new_cache(kind: str, backbone, max_len: int) -> DynamicCache | StaticCache:
    """An empty cache of ``kind`` (``KV_CACHES``) for ``backbone``; a static one holds ``max_len`` tokens. A backbone
    the decoder cannot verify a tree on is refused (``check_tree_decodable``)."""
    check_tree_decodable(backbone)
    if kind == "dynamic":
        return DynamicCache()
    if kind == "static":
        return StaticCache(config=backbone.config, max_cache_len=max_len)
    raise ValueError(f"kv_cache={kind!r}: must be one of {list(KV_CACHES)}")
