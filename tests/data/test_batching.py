"""Collator padding invariants, length-grouped batches, and the deterministic train/eval split."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import DataLoader

from medusa_train.data import (
    IGNORE_INDEX,
    LengthGroupedBatchSampler,
    PaddingCollator,
    build_datasets,
    split_indices,
    tokenize_conversation,
)

PAD = 0


def test_collator_pads_right_to_the_longest():
    examples = [
        {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
        {"input_ids": [8], "labels": [8]},
        {"input_ids": [9, 10, 11, 12, 13], "labels": [-100, -100, 11, 12, 13]},
    ]
    batch = PaddingCollator(pad_token_id=PAD)(examples)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert all(t.dtype == torch.long and t.shape == (3, 5) for t in batch.values())
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0, 0], [8, 0, 0, 0, 0], [9, 10, 11, 12, 13]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, -100], [8, -100, -100, -100, -100], [-100, -100, 11, 12, 13]]


def test_collator_equal_lengths_needs_no_padding_and_checks_input():
    batch = PaddingCollator(pad_token_id=3)([{"input_ids": [1, 2], "labels": [1, 2]}] * 4)
    assert batch["input_ids"].shape == (4, 2) and bool(batch["attention_mask"].all())
    with pytest.raises(ValueError, match="pad token"):
        PaddingCollator(pad_token_id=None)
    with pytest.raises(ValueError, match="labels"):
        PaddingCollator(pad_token_id=0)([{"input_ids": [1, 2], "labels": [1]}])


def collect(sampler):
    return [list(batch) for batch in sampler]


def test_sampler_covers_every_index_once():
    lengths = [random.Random(1).randint(1, 500) for _ in range(1003)]
    sampler = LengthGroupedBatchSampler(lengths, batch_size=8, seed=0)
    batches = collect(sampler)
    assert len(batches) == len(sampler) == 126
    assert sorted(i for b in batches for i in b) == list(range(1003))
    assert sorted(len(b) for b in batches)[0] == 1003 % 8  # exactly one short batch
    assert sum(len(b) < 8 for b in batches) == 1

    dropped = LengthGroupedBatchSampler(lengths, batch_size=8, seed=0, drop_last=True)
    batches = collect(dropped)
    assert len(batches) == len(dropped) == 125 and all(len(b) == 8 for b in batches)
    assert len({i for b in batches for i in b}) == 1000


def test_sampler_is_deterministic_and_changes_with_epoch_and_seed():
    lengths = list(range(400))
    first = collect(LengthGroupedBatchSampler(lengths, batch_size=4, seed=3))
    assert first == collect(LengthGroupedBatchSampler(lengths, batch_size=4, seed=3))
    assert first != collect(LengthGroupedBatchSampler(lengths, batch_size=4, seed=4))
    sampler = LengthGroupedBatchSampler(lengths, batch_size=4, seed=3)
    sampler.set_epoch(1)
    epoch1 = collect(sampler)
    assert epoch1 != first and sorted(map(sorted, epoch1)) != sorted(map(sorted, first))
    sampler.set_epoch(0)
    assert collect(sampler) == first

    ordered = LengthGroupedBatchSampler(lengths, batch_size=4, seed=3, shuffle=False)
    fixed = collect(ordered)
    ordered.set_epoch(5)
    assert collect(ordered) == fixed
    assert fixed[0] == [199, 198, 197, 196]  # first mega-batch (200 items) sorted longest first


def test_sampler_groups_similar_lengths():
    rng = random.Random(0)
    lengths = [rng.randint(1, 2000) for _ in range(4000)]

    def mean_spread(batches):
        return sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)

    grouped = mean_spread(collect(LengthGroupedBatchSampler(lengths, batch_size=8, seed=0)))
    order = list(range(len(lengths)))
    rng.shuffle(order)
    unsorted = mean_spread([order[i : i + 8] for i in range(0, len(order), 8)])
    # Sorting mega-batches of 400 random lengths leaves about 8 * 2000 / 400 = 40 between the ends of a batch.
    assert grouped < 60 < 1000 < unsorted


def test_split_indices():
    train, evals = split_indices(100, 0.1, seed=0)
    assert len(evals) == 10 and len(train) == 90 and sorted(train + evals) == list(range(100))
    assert (train, evals) == split_indices(100, 0.1, seed=0)
    assert evals != split_indices(100, 0.1, seed=1)[1]
    assert len(split_indices(100, 7, seed=0)[1]) == 7
    assert len(split_indices(5, 0.01, seed=0)[1]) == 1  # a positive fraction keeps at least one
    assert split_indices(5, 0, seed=0) == ([0, 1, 2, 3, 4], [])
    with pytest.raises(ValueError, match="eval_size"):
        split_indices(5, 1.5, seed=0)


def words(i: int) -> str:
    """A distinct, tokenizable reply for conversation ``i`` (its length grows with i)."""
    vocab = ["one", "two", "three", "four", "five"]
    return " ".join(vocab[int(d) % 5] for d in str(i)) + " ok" * (i % 7)


@pytest.fixture
def records_file(tmp_path, write_jsonl):
    records = []
    for i in range(40):
        turns = [{"from": "human", "value": "Hi " * (30 if i % 10 == 0 else 1)}, {"from": "gpt", "value": words(i)}]
        records.append({"conversations": turns})
    records.insert(5, {"conversations": [{"from": "human", "value": "Hi"}]})  # no assistant
    records.insert(9, "{broken")
    return write_jsonl(tmp_path / "train.jsonl", records)


def test_build_datasets_split_and_counts(word_tokenizer, records_file):
    train, evals, stats = build_datasets(word_tokenizer, records_file, max_length=512, eval_size=0.25, seed=0)
    assert (len(train), len(evals)) == (30, 10)
    assert stats.kept == 40 and dict(stats.skipped) == {"no_assistant": 1, "malformed": 1}
    for example in train + evals:
        assert len(example["input_ids"]) == len(example["labels"])
        assert example["labels"][-2] == word_tokenizer.convert_tokens_to_ids("<|im_end|>")

    again = build_datasets(word_tokenizer, records_file, max_length=512, eval_size=0.25, seed=0)
    assert again[0] == train and again[1] == evals
    other = build_datasets(word_tokenizer, records_file, max_length=512, eval_size=0.25, seed=1)
    assert other[1] != evals


def test_split_is_made_before_tokenization_skips(word_tokenizer, records_file):
    _, evals_long, _ = build_datasets(word_tokenizer, records_file, max_length=512, eval_size=0.25, seed=0)
    # Conversations 0, 10, 20, 30 have a 30-word question: at 40 tokens their reply is cut off.
    train, evals, stats = build_datasets(word_tokenizer, records_file, max_length=40, eval_size=0.25, seed=0)
    assert stats.skipped["no_assistant_after_truncation"] == 4
    assert stats.kept == len(train) + len(evals) == 36
    # The eval set holds the same conversations, cut to 40 tokens, minus the ones that lost their reply.
    hi = word_tokenizer.convert_tokens_to_ids("Hi")
    long_question = [e["input_ids"].count(hi) >= 30 for e in evals_long]
    assert 0 < sum(long_question) < len(evals_long)  # the case this test is about does occur
    expected = [e["input_ids"][:40] for e, long in zip(evals_long, long_question) if not long]
    assert [e["input_ids"] for e in evals] == expected


def test_dataloader_end_to_end(word_tokenizer, records_file):
    train, _, _ = build_datasets(word_tokenizer, records_file, max_length=512, eval_size=0.25, seed=0)
    sampler = LengthGroupedBatchSampler([len(e["input_ids"]) for e in train], batch_size=4, seed=0)
    loader = DataLoader(train, batch_sampler=sampler, collate_fn=PaddingCollator(word_tokenizer.pad_token_id))
    seen_tokens = 0
    for batch in loader:
        lengths = batch["attention_mask"].sum(dim=1)
        assert batch["input_ids"].shape[1] == int(lengths.max())  # padded to the longest, not max_length
        pad = batch["attention_mask"] == 0
        assert bool((batch["labels"][pad] == IGNORE_INDEX).all())
        assert bool((batch["input_ids"][pad] == word_tokenizer.pad_token_id).all())
        seen_tokens += int(lengths.sum())
    assert seen_tokens == sum(len(e["input_ids"]) for e in train)


def test_collated_labels_match_single_tokenization(word_tokenizer):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    example = tokenize_conversation(word_tokenizer, messages, max_length=64)
    short = {"input_ids": example["input_ids"][:5], "labels": example["labels"][:5]}
    batch = PaddingCollator(word_tokenizer.pad_token_id)([example, short])
    n = len(example["input_ids"])
    assert batch["labels"][0].tolist() == example["labels"]
    assert batch["labels"][1].tolist() == short["labels"] + [IGNORE_INDEX] * (n - 5)
