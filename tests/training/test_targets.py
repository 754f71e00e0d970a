"""``loss.targets=greedy``: each head's target is exactly what greedy decoding would emit, and only
where one forward pass over the text can know it."""

from __future__ import annotations

import pytest
import torch
from helpers.backbones import make_tiny_backbone

from medusa_train.config.check import ConfigError
from medusa_train.config.train import build_config
from medusa_train.data.tokenize import IGNORE_INDEX
from medusa_train.training.targets import greedy_tokens, text_tokens

NUM_HEADS = 3


def greedy_after(backbone, prefix: list[int], steps: int) -> list[int]:
    """``steps`` tokens of plain greedy decoding after ``prefix``, one full forward per token."""
    out = list(prefix)
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(backbone(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(prefix):]


def text_that_partly_follows_greedy(backbone, vocab: int, prompt_len: int = 6, reply_len: int = 30) -> list[int]:
    """A prompt, then a reply that is the model's greedy continuation with a token replaced now and
    then, so the text agrees with greedy in runs of different lengths."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
    for i in range(reply_len):
        nxt = greedy_after(backbone, ids, 1)[0]
        if i in (2, 3, 9, 17, 18, 19, 26):  # off the greedy path here
            nxt = (nxt + 1 + i) % vocab
        ids.append(nxt)
    return ids


def check_targets_are_greedy_decoding(backbone, ids: list[int], prompt_len: int, user_turn: range) -> None:
    labels = torch.tensor([ids])
    labels[0, :prompt_len] = IGNORE_INDEX
    labels[0, list(user_turn)] = IGNORE_INDEX  # a stretch the model did not write (a later user turn)
    with torch.no_grad():
        predictions = backbone(torch.tensor([ids])).logits.argmax(-1)
    targets = greedy_tokens(labels, NUM_HEADS, predictions)[:, 0]

    seq = len(ids)
    expected = torch.full((NUM_HEADS, seq), IGNORE_INDEX)
    for t in range(seq - 1):
        decoded = greedy_after(backbone, ids[:t + 1], min(NUM_HEADS + 1, seq - 1 - t))
        for k in range(NUM_HEADS):
            if t + k + 2 >= seq or labels[0, t + k + 2] == IGNORE_INDEX:
                continue
            # greedy from position t emits the text's next k+1 tokens (all of them written by the
            # model, i.e. trained), so its (k+2)-th token is known and is the target
            if decoded[:k + 1] == ids[t + 1:t + k + 2] and all(labels[0, t + 1:t + k + 2] != IGNORE_INDEX):
                expected[k, t] = decoded[k + 1]
    assert torch.equal(targets, expected)
    # the text leaves the greedy path, so some positions must be dropped while others stay
    text = text_tokens(labels, NUM_HEADS)[:, 0]
    for k in range(NUM_HEADS):
        kept = int((targets[k] != IGNORE_INDEX).sum())
        assert 0 < kept < int((text[k] != IGNORE_INDEX).sum()), k


def test_targets_are_what_greedy_decoding_emits_tiny_model():
    backbone = make_tiny_backbone("llama", attn_implementation="eager")
    ids = text_that_partly_follows_greedy(backbone, backbone.config.vocab_size)
    check_targets_are_greedy_decoding(backbone, ids, prompt_len=6, user_turn=range(30, 32))


@pytest.mark.slow
def test_targets_are_what_greedy_decoding_emits_packaged_model(packaged_backbone):
    backbone, tokenizer = packaged_backbone
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Name three uses of copper."}],
                                         add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    reply = tokenizer("Copper is used in electrical wiring, in plumbing pipes and in coins because it "
                      "conducts well.", add_special_tokens=False)["input_ids"]
    ids = prompt + reply  # a human-written reply: it agrees with the model's greedy choices only in places
    check_targets_are_greedy_decoding(backbone, ids, prompt_len=len(prompt), user_turn=range(0))


def test_text_targets_are_the_shifted_labels():
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 5, 6, 7, 8, 9]])
    assert text_tokens(labels, 2).tolist() == [[[5, 6, 7, 8, 9, IGNORE_INDEX, IGNORE_INDEX]],
                                               [[6, 7, 8, 9, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]]]


def test_predictions_must_match_the_labels_shape():
    with pytest.raises(ValueError, match="predictions"):
        greedy_tokens(torch.zeros(2, 6, dtype=torch.long), 2, torch.zeros(2, 5, dtype=torch.long))


def test_config_accepts_greedy_targets_only_with_a_frozen_backbone():
    assert build_config({"loss": {"targets": "greedy"}}).loss.targets == "greedy"
    assert build_config({"method": "medusa2", "stage": 1, "loss": {"targets": "greedy"}}).loss.targets == "greedy"
    with pytest.raises(ConfigError, match=r"loss.targets='greedy': greedy targets come from a frozen backbone"):
        build_config({"method": "medusa2", "loss": {"targets": "greedy"}})
    with pytest.raises(ConfigError, match=r"loss.targets='next': must be text, greedy or teacher"):
        build_config({"loss": {"targets": "next"}})
