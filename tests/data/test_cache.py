"""Tokenised once: a user's whole file, cached on disk by everything that makes the examples, reused."""

from __future__ import annotations

import json
import os

import pytest
from helpers.backbones import PACKAGED_MODEL

from medusa_train.data import build_datasets, load_conversations
from medusa_train.data.cache import cache_key, tokenized_splits


@pytest.fixture(scope="module")
def packaged_tokenizer():
    from medusa_train.backbone import load_tokenizer

    return load_tokenizer(PACKAGED_MODEL)


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    """3,000 real conversations (the packaged ShareGPT's first ones) as a user's messages jsonl."""
    conversations, _ = load_conversations("packaged:sharegpt-v3", max_samples=3000)
    path = tmp_path_factory.mktemp("user") / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


@pytest.mark.slow
def test_whole_file_tokenised_once_and_read_back(packaged_tokenizer, user_file, tmp_path):
    first = tokenized_splits(packaged_tokenizer, str(user_file), 256, None, 64, 0, num_proc=2, cache_root=tmp_path)
    st = first.stats
    assert not first.from_cache and st.capped == 0
    # every conversation of the file is accounted for: used, or skipped with its reason
    assert st.kept + st.total_skipped == 3000 and set(st.skipped) <= {"no_assistant_after_truncation"}
    assert len(first.train) + len(first.evals) == st.kept and 0 < len(first.evals) <= 64  # 64 held out, less skips
    assert st.truncated > 0  # 256 tokens cut many of them, and that is counted
    assert first.selected == 3000  # all read and selected; tokenising then skipped some, each with its reason

    second = tokenized_splits(packaged_tokenizer, str(user_file), 256, None, 64, 0, num_proc=2, cache_root=tmp_path)
    assert second.from_cache and second.folder == first.folder and second.stats == first.stats
    assert second.selected == first.selected
    for a, b in ((first.train, second.train), (first.evals, second.evals)):
        assert a["input_ids"][:] == b["input_ids"][:] and a["labels"][:] == b["labels"][:]

    # the same examples as tokenising in memory (several processes change nothing)
    train, evals, stats = build_datasets(packaged_tokenizer, str(user_file), 256, None, 64, 0)
    assert [e["input_ids"] for e in train] == list(first.train["input_ids"])
    assert [e["labels"] for e in evals] == list(first.evals["labels"])
    assert stats.kept == st.kept and stats.truncated == st.truncated
    assert list(first.train["length"]) == [len(e["input_ids"]) for e in train]


@pytest.mark.slow
def test_capped_read_counts_what_was_left_out(packaged_tokenizer, user_file, tmp_path):
    data = tokenized_splits(packaged_tokenizer, str(user_file), 256, 500, 10, 0, num_proc=1, cache_root=tmp_path)
    assert data.stats.capped == 2500 and data.selected == 500
    assert data.stats.kept + data.stats.total_skipped == 500


@pytest.mark.slow
def test_key_changes_with_what_makes_the_examples(packaged_tokenizer, user_file, tmp_path):
    base = dict(source=str(user_file), max_length=256, max_samples=None, eval_size=64, seed=0)
    key = cache_key(packaged_tokenizer, **base)
    assert cache_key(packaged_tokenizer, **base) == key
    for change in ({"max_length": 512}, {"max_samples": 10}, {"eval_size": 32}, {"seed": 1}):
        assert cache_key(packaged_tokenizer, **{**base, **change}) != key, change
    template = packaged_tokenizer.chat_template
    try:
        packaged_tokenizer.chat_template = template.replace("<|im_start|>", "<|im_start|> ")
        assert cache_key(packaged_tokenizer, **base) != key
    finally:
        packaged_tokenizer.chat_template = template
    stat = user_file.stat()
    os.utime(user_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # the user edited the file
    assert cache_key(packaged_tokenizer, **base) != key
