"""Conversations -> chat template -> assistant-only labels -> length-grouped, dynamically padded batches."""

from medusa_train.data.batching import (
    LengthGroupedBatchSampler,
    PaddingCollator,
    build_datasets,
    example_lengths,
    split_indices,
    tokenize_conversations,
)
from medusa_train.data.records import normalise_record
from medusa_train.data.sources import SkipStats, load_conversations
from medusa_train.data.tokenize import IGNORE_INDEX, assistant_spans, tokenize_conversation

__all__ = [
    "IGNORE_INDEX",
    "LengthGroupedBatchSampler",
    "PaddingCollator",
    "SkipStats",
    "assistant_spans",
    "build_datasets",
    "example_lengths",
    "load_conversations",
    "normalise_record",
    "split_indices",
    "tokenize_conversation",
    "tokenize_conversations",
]
