"""Batches: a dynamic-padding collator, a length-grouped batch sampler, and the dataset builder."""

from __future__ import annotations

import math
import os
import random
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from medusa_train.data.records import Conversation
from medusa_train.data.sources import SkipStats, load_conversations
from medusa_train.data.tokenize import IGNORE_INDEX, template_support, tokenize_batch
from medusa_train.data.usable import check_selected, check_tokenized, eval_count

Example = dict[str, list[int]]


class PaddingCollator:
    """Pad a list of ``{"input_ids", "labels"}`` examples on the right to the longest one.

    Produces ``input_ids`` (padded with ``pad_token_id``), ``attention_mask`` (1 on real
    tokens, 0 on padding) and ``labels`` (``-100`` on padding), all ``torch.long`` of shape
    ``(batch, longest)``; never padded to ``max_length``.
    """

    def __init__(self, pad_token_id: int | None):
        """Args:
        pad_token_id: the tokenizer's pad token id (``tokenizer.pad_token_id``).
        """
        if pad_token_id is None:
            raise ValueError(
                "pad_token_id is None: the tokenizer has no pad token. Set tokenizer.pad_token "
                "(e.g. to its eos token) before building the collator."
            )
        self.pad_token_id = int(pad_token_id)

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Collate ``examples`` into padded tensors."""
        longest = max(len(e["input_ids"]) for e in examples)
        input_ids = torch.full((len(examples), longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(examples), longest), dtype=torch.long)
        labels = torch.full((len(examples), longest), IGNORE_INDEX, dtype=torch.long)
        for row, example in enumerate(examples):
            n = len(example["input_ids"])
            if len(example["labels"]) != n:
                raise ValueError(f"example {row}: {n} input_ids but {len(example['labels'])} labels")
            input_ids[row, :n] = torch.as_tensor(example["input_ids"], dtype=torch.long)
            labels[row, :n] = torch.as_tensor(example["labels"], dtype=torch.long)
            attention_mask[row, :n] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class LengthGroupedBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Batches of indices whose examples have similar lengths, so little padding is needed.

    With ``shuffle``: shuffle all indices, cut them into mega-batches of
    ``mega_batch_mult * batch_size``, sort each mega-batch by length (longest first), cut it
    into batches, then shuffle the batch order. Without ``shuffle`` the same is done in index
    order and the batch order is kept (for evaluation). The order depends only on ``seed`` and
    the epoch set with :meth:`set_epoch`.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        mega_batch_mult: int = 50,
    ):
        """Args:
        lengths: the length (in tokens) of each example.
        batch_size: examples per batch.
        seed: base seed of the shuffles.
        shuffle: shuffle examples and batches (training) or keep a fixed order (evaluation).
        drop_last: drop the one incomplete batch, if any.
        mega_batch_mult: mega-batch size in batches; larger groups lengths more tightly.
        """
        if batch_size < 1:
            raise ValueError(f"data.batch_size={batch_size}: must be >= 1")
        if mega_batch_mult < 1:
            raise ValueError(f"mega_batch_mult={mega_batch_mult}: must be >= 1")
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.mega_batch_mult = mega_batch_mult
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use a different (but reproducible) order for ``epoch``."""
        self.epoch = epoch

    def __len__(self) -> int:
        n = len(self.lengths)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        indices = list(range(len(self.lengths)))
        if self.shuffle:
            rng.shuffle(indices)
        mega = self.mega_batch_mult * self.batch_size  # a multiple of batch_size: only the last batch is short
        batches: list[list[int]] = []
        for begin in range(0, len(indices), mega):
            group = sorted(indices[begin : begin + mega], key=lambda i: -self.lengths[i])
            batches.extend(group[b : b + self.batch_size] for b in range(0, len(group), self.batch_size))
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        if self.shuffle:
            rng.shuffle(batches)
        return iter(batches)


def example_lengths(examples: Sequence[dict]) -> list[int]:
    """Tokens per example: a cached split's ``length`` column, or the lengths of in-memory examples."""
    if "length" in (getattr(examples, "column_names", None) or ()):
        return list(examples["length"])
    return [len(e["input_ids"]) for e in examples]


def split_indices(n: int, eval_size: int | float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic train/eval split of ``range(n)``.

    Args:
        n: number of items.
        eval_size: an int (number of eval items) or a float in [0, 1) (fraction, rounded up when > 0).
        seed: the same seed gives the same split.

    Returns:
        ``(train_indices, eval_indices)``, each in ascending order.
    """
    n_eval = eval_count(n, eval_size)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return sorted(order[n_eval:]), sorted(order[:n_eval])


def tokenize_conversations(
    tokenizer: Any,
    conversations: Sequence[Conversation],
    max_length: int,
    stats: SkipStats,
    desc: str = "tokenizing",
    chunk_size: int = 256,
) -> list[Example]:
    """Tokenize many conversations in memory with a progress bar, counting the ones that are skipped.

    ``chunk_size`` conversations per call of :func:`~medusa_train.data.tokenize.tokenize_batch`; each skip
    (``template_error``, ``no_assistant_after_truncation``, unsupported tool turns) lowers ``stats.kept`` by
    one and is counted by reason; examples cut at ``max_length`` are counted in ``stats.truncated``.
    Training reads the same examples through the on-disk cache (``cache.py``).
    """
    from tqdm.auto import tqdm

    support = template_support(tokenizer)
    examples: list[Example] = []
    with tqdm(total=len(conversations), desc=desc, unit="conv") as bar:
        for begin in range(0, len(conversations), chunk_size):
            chunk = list(conversations[begin : begin + chunk_size])
            for result in tokenize_batch(tokenizer, chunk, max_length, support):
                if isinstance(result, str):
                    stats.skip(result)
                    stats.kept -= 1
                else:
                    stats.truncated += result.pop("truncated")
                    examples.append(result)
            bar.update(len(chunk))
    return examples


def build_datasets(
    tokenizer: Any,
    source: str | os.PathLike,
    max_length: int,
    max_samples: int | None = None,
    eval_size: int | float = 0.01,
    seed: int = 0,
) -> tuple[list[Example], list[Example], SkipStats]:
    """Load conversations, split them into train/eval, and tokenize both with assistant-only labels.

    The split is made over the loaded conversations, before tokenization can drop any, so the
    same ``source``, ``max_samples`` and ``seed`` always put the same conversations in eval,
    whatever ``max_length`` or tokenizer is used.

    Args:
        tokenizer: a fast tokenizer with a chat template (and a pad token, for the collator).
        source: see :func:`~medusa_train.data.sources.load_conversations`.
        max_length: tokens per example at most.
        max_samples: use at most this many conversations (the first ones in the source).
        eval_size: eval conversations: an int count, or a float fraction in [0, 1).
        seed: seed of the split.

    Returns:
        ``(train_examples, eval_examples, stats)``: lists of ``{"input_ids", "labels"}`` that
        work with ``DataLoader(examples, batch_sampler=LengthGroupedBatchSampler(...),
        collate_fn=PaddingCollator(tokenizer.pad_token_id))``; ``stats`` counts every skip,
        and ``stats.kept == len(train) + len(eval)``.

    Raises:
        ConfigError: no usable conversation, or none left to train on by ``eval_size`` (see ``usable.py``);
            ``eval_size=0`` trains on every conversation with an empty eval list.
    """
    if max_length < 1:
        raise ValueError(f"data.max_length={max_length}: must be >= 1")
    conversations, stats = load_conversations(source, max_samples=max_samples)
    check_selected(str(source), stats, len(conversations), eval_size, max_samples)
    train_idx, eval_idx = split_indices(len(conversations), eval_size, seed)
    train = tokenize_conversations(tokenizer, [conversations[i] for i in train_idx], max_length, stats, "tokenizing train")
    evals = tokenize_conversations(tokenizer, [conversations[i] for i in eval_idx], max_length, stats, "tokenizing eval")
    check_tokenized(str(source), stats, len(train), len(evals), eval_size)
    return train, evals, stats
