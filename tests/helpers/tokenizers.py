"""Tiny in-process ChatML tokenizers (no hub): a word-level one with fixed ids, and a byte-level BPE."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# SmolLM2-135M-Instruct's template: ChatML with a default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIALS = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<unk>"]
# ids 0-3 special, then "\n" = 4, " " = 5, then these words (id = 6 + position).
WORDS = ["system", "user", "assistant", "You", "are", "a", "helpful", "AI", "Hi", "there", "Hello",
         "!", "How", "you", "?", "Fine", "thanks", "Bye", "ok", "one", "two", "three", "four", "five"]
VOCAB = {tok: i for i, tok in enumerate(SPECIALS + ["\n", " "] + WORDS)}


def make_word_tokenizer(chat_template: str | None = CHATML_TEMPLATE) -> PreTrainedTokenizerFast:
    """Word-level tokenizer: every word, punctuation mark, space and newline is one token."""
    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|[^\w\s]|\s"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<|pad|>", eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def make_bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style, like SmolLM2's) trained in-process on a few strings."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "Hello there! How are you today? I am fine, thanks for asking.",
        "The quick brown fox jumps over the lazy dog.\n\nNew paragraph: 1, 2, 3.",
        "def add(a, b):\n    return a + b\n",
        "Assistant replies end with an end-of-turn token; user turns are not trained on.",
    ] * 3
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>",
        unk_token="<|endoftext|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def write_jsonl(path: Path, records: list) -> Path:
    """One record per line; a ``str`` is written verbatim (to make broken lines)."""
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return path
