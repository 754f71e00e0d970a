"""Fixtures for the data tests: the tiny ChatML tokenizers of ``helpers.tokenizers`` and a record writer."""

from __future__ import annotations

import pytest
from helpers.tokenizers import make_bpe_tokenizer, make_word_tokenizer, write_jsonl
from transformers import PreTrainedTokenizerFast


@pytest.fixture(scope="session")
def word_tokenizer() -> PreTrainedTokenizerFast:
    return make_word_tokenizer()


@pytest.fixture(scope="session")
def bpe_tokenizer() -> PreTrainedTokenizerFast:
    return make_bpe_tokenizer()


@pytest.fixture(scope="session")
def untemplated_tokenizer() -> PreTrainedTokenizerFast:
    return make_word_tokenizer(chat_template=None)


@pytest.fixture(name="write_jsonl")
def write_jsonl_fixture():
    """``write_jsonl(path, records)``: one record per line; a ``str`` is written verbatim (broken lines)."""
    return write_jsonl
