"""Chat template rendering and assistant-only labels."""

from __future__ import annotations

import pytest

from medusa_train.data import IGNORE_INDEX, assistant_spans, tokenize_conversation
from medusa_train.data import tokenize as tokenize_module

X = IGNORE_INDEX
TWO_TURNS = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello !"},
    {"role": "user", "content": "How are you ?"},
    {"role": "assistant", "content": "Fine thanks"},
]


def label_runs(example: dict) -> list[list[int]]:
    """The maximal runs of labelled token ids, one per assistant reply."""
    runs, current = [], []
    for token, label in zip(example["input_ids"], example["labels"]):
        if label != IGNORE_INDEX:
            assert label == token  # labels are aligned with input_ids, not shifted
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_exact_label_mask_two_turns(word_tokenizer):
    example = tokenize_conversation(word_tokenizer, TWO_TURNS, max_length=512)
    # <|im_start|>=1 <|im_end|>=2 "\n"=4 " "=5; system=6 user=7 assistant=8 ... (see helpers/tokenizers.py: VOCAB)
    assert example["input_ids"] == [
        1, 6, 4, 9, 5, 10, 5, 11, 5, 12, 5, 13, 5, 8, 2, 4,  # default system prompt
        1, 7, 4, 14, 5, 15, 2, 4,  # <|im_start|>user\nHi there<|im_end|>\n
        1, 8, 4, 16, 5, 17, 2, 4,  # <|im_start|>assistant\nHello !<|im_end|>\n
        1, 7, 4, 18, 5, 10, 5, 19, 5, 20, 2, 4,  # <|im_start|>user\nHow are you ?<|im_end|>\n
        1, 8, 4, 21, 5, 22, 2, 4,  # <|im_start|>assistant\nFine thanks<|im_end|>\n
    ]
    assert example["labels"] == [
        X, X, X, X, X, X, X, X, X, X, X, X, X, X, X, X,
        X, X, X, X, X, X, X, X,
        X, X, X, 16, 5, 17, 2, X,  # reply + <|im_end|>; not the scaffolding, not the "\n" after
        X, X, X, X, X, X, X, X, X, X, X, X,
        X, X, X, 21, 5, 22, 2, X,
    ]


def test_spans_cover_reply_and_end_of_turn_only(word_tokenizer):
    text, spans = assistant_spans(word_tokenizer, TWO_TURNS)
    assert [text[a:b] for a, b in spans] == ["Hello !<|im_end|>", "Fine thanks<|im_end|>"]


def test_system_turn_and_consecutive_assistant_turns(word_tokenizer):
    messages = [
        {"role": "system", "content": "You are a helpful AI"},
        {"role": "assistant", "content": "Hello"},  # the reply comes first (split ShareGPT chunks do this)
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "one"},
        {"role": "assistant", "content": "two"},
    ]
    example = tokenize_conversation(word_tokenizer, messages, max_length=512)
    decoded = [word_tokenizer.decode(run) for run in label_runs(example)]
    assert decoded == ["Hello<|im_end|>", "one<|im_end|>", "two<|im_end|>"]


def test_byte_level_bpe_labels_decode_to_each_reply(bpe_tokenizer):
    messages = [
        {"role": "user", "content": "Hello there! How are you today?"},
        {"role": "assistant", "content": " I am fine, thanks for asking.\n\nNew paragraph: 1, 2, 3."},
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b\n"},
    ]
    example = tokenize_conversation(bpe_tokenizer, messages, max_length=4096)
    decoded = [bpe_tokenizer.decode(run) for run in label_runs(example)]
    assert decoded == [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]


def test_token_straddling_the_reply_start_is_not_labelled(bpe_tokenizer):
    # Byte-level BPE joins the template's "\n" with the reply's leading spaces into one token.
    # That token starts in the scaffolding, so it stays unlabelled: the scaffolding is never
    # trained on, at the cost of the reply's leading whitespace.
    content = "    return a + b"
    messages = [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": content}]
    example = tokenize_conversation(bpe_tokenizer, messages, max_length=4096)
    text, [(start, end)] = assistant_spans(bpe_tokenizer, messages)
    assert text[start:end] == content + "<|im_end|>"
    tokens = bpe_tokenizer.convert_ids_to_tokens(example["input_ids"])
    straddling = tokens.index("ĊĠĠĠ")  # "\n" of the scaffolding + 3 of the 4 leading spaces
    assert example["labels"][straddling] == IGNORE_INDEX
    [run] = label_runs(example)
    assert bpe_tokenizer.decode(run) == " return a + b<|im_end|>"


def test_truncation(word_tokenizer):
    full = tokenize_conversation(word_tokenizer, TWO_TURNS, max_length=512)
    assert len(full["input_ids"]) == 52

    cut = tokenize_conversation(word_tokenizer, TWO_TURNS, max_length=29)  # inside the first reply
    assert cut["input_ids"] == full["input_ids"][:29]
    assert cut["labels"] == full["labels"][:29]
    assert [t for t in cut["labels"] if t != X] == [16, 5]

    # Everything up to the first reply's scaffolding fits, but no reply token does.
    assert tokenize_conversation(word_tokenizer, TWO_TURNS, max_length=27) is None
    assert tokenize_conversation(word_tokenizer, TWO_TURNS, max_length=28)["labels"][-1] == 16


@pytest.mark.parametrize("chars_per_token", [8, 1])  # 1: the cut holds too few tokens, so it is redone whole
def test_truncated_is_a_prefix_of_the_whole(bpe_tokenizer, monkeypatch, chars_per_token):
    # Long texts are cut after a special token before tokenizing; the result must equal
    # tokenizing everything and truncating, at every length.
    monkeypatch.setattr(tokenize_module, "CHARS_PER_TOKEN_BOUND", chars_per_token)
    long_reply = "The quick brown fox jumps over the lazy dog. " * 12
    messages = [
        {"role": "user", "content": "Hello there!"},
        {"role": "assistant", "content": long_reply},
        {"role": "user", "content": "How are you today?"},
        {"role": "assistant", "content": "I am fine, thanks for asking."},
    ]
    whole = tokenize_conversation(bpe_tokenizer, messages, max_length=10**6)
    for max_length in [1, 5, 9, 10, 11, 20, 47, 80, 81, 150, len(whole["input_ids"]) - 1]:
        cut = tokenize_conversation(bpe_tokenizer, messages, max_length=max_length)
        expected_labels = whole["labels"][:max_length]
        if all(label == IGNORE_INDEX for label in expected_labels):
            assert cut is None, max_length
        else:
            assert cut == {"input_ids": whole["input_ids"][:max_length], "labels": expected_labels}, max_length


def test_no_chat_template_is_a_clear_error(untemplated_tokenizer):
    with pytest.raises(ValueError, match=r"no chat template.*chat_template"):
        tokenize_conversation(untemplated_tokenizer, TWO_TURNS, max_length=64)


def test_max_length_must_be_positive(word_tokenizer):
    with pytest.raises(ValueError, match="max_length"):
        tokenize_conversation(word_tokenizer, TWO_TURNS, max_length=0)


@pytest.mark.slow
def test_smollm2_labels_decode_to_each_reply_and_im_end():
    from medusa_train.backbone.load import load_tokenizer
    from medusa_train.data import load_conversations

    tokenizer = load_tokenizer("packaged:smollm2-135m-instruct")
    handmade = [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And in words?"},
        {"role": "assistant", "content": "Four.\n\n```python\nprint('four')\n```"},
    ]
    conversations, _ = load_conversations("packaged:sharegpt-v3", max_samples=150)
    for messages in [handmade, *conversations]:
        example = tokenize_conversation(tokenizer, messages, max_length=10**7)
        decoded = [tokenizer.decode(run) for run in label_runs(example)]
        assert decoded == [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        # Never labelled: the scaffolding that opens a reply.
        start_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
        assert start_id not in [t for run in label_runs(example) for t in run]
