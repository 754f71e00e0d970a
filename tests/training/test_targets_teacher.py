"""``loss.targets=teacher``: heads learn the backbone's whole next-token distribution (soft labels)."""

from __future__ import annotations

import pytest
import torch
from helpers.losses import (
    NUM_HEADS,
    assert_same,
    grads,
    make_batch,
    make_model,
    zero_grads,
)

from medusa_train.config.check import ConfigError
from medusa_train.config.train import build_config
from medusa_train.data.tokenize import IGNORE_INDEX
from medusa_train.training import losses
from medusa_train.training.losses import depthwise_loss_backward, depthwise_loss_naive
from medusa_train.training.targets import (
    Teacher,
    teacher_targets,
)


def teacher_of(model, hidden: torch.Tensor) -> Teacher:
    return Teacher(model.base_logits, hidden.detach())


def run_naive_teacher(model, input_ids, attention_mask, labels):
    hidden = model(input_ids, attention_mask).hidden_states
    loss, result = depthwise_loss_naive(model.head_logits, hidden, teacher_targets(labels, NUM_HEADS, teacher_of(model, hidden)))
    loss.backward()
    out = grads(model)
    zero_grads(model)
    return loss.detach(), result, out


def run_chunked_teacher(model, input_ids, attention_mask, labels, **kwargs):
    hidden = model(input_ids, attention_mask).hidden_states
    return run_head_by_head_on(model, hidden, labels, **kwargs)


def run_head_by_head_on(model, hidden, labels, **kwargs):
    result = depthwise_loss_backward(model.head_logits, hidden, teacher_targets(labels, NUM_HEADS, teacher_of(model, hidden)), **kwargs)
    out = grads(model)
    zero_grads(model)
    return result, out


@pytest.mark.parametrize("chunk_size", [None, 1, 5, 100])
@pytest.mark.parametrize("backbone", ["frozen", "trainable"])
def test_teacher_gradients_match_naive(chunk_size, backbone):
    model = make_model()
    if backbone == "trainable":  # the heads' gradient still reaches the backbone; the teacher's never does
        model.backbone.model.layers[-1].mlp.requires_grad_(True)
    batch = make_batch()
    naive_loss, naive_result, naive_grads = run_naive_teacher(model, *batch)
    result, got = run_chunked_teacher(model, *batch, chunk_size=chunk_size)
    assert_same(result, naive_loss, naive_result, got, naive_grads)


def test_teacher_blocks(monkeypatch):
    """Soft targets go through the blockwise cross-entropy too: ragged blocks change nothing."""
    model = make_model()
    batch = make_batch()
    naive_loss, naive_result, naive_grads = run_naive_teacher(model, *batch)
    monkeypatch.setattr(losses, "_BLOCK_ELEMENTS", 256 * 3)
    result, got = run_chunked_teacher(model, *batch, chunk_size=9)
    assert_same(result, naive_loss, naive_result, got, naive_grads)


def test_teacher_loss_by_hand():
    """Head k at t: cross-entropy to softmax(LM head at t + k + 1), over the text's trained targets only;
    top-1 counts agreement with that distribution's top token."""
    model = make_model()
    input_ids, attention_mask, labels = make_batch()
    with torch.no_grad():
        hidden = model(input_ids, attention_mask).hidden_states
        result = depthwise_loss_backward(model.head_logits, hidden, teacher_targets(labels, NUM_HEADS, teacher_of(model, hidden)), chunk_size=4, backward=None)
        seq = labels.shape[1]
        for k in range(NUM_HEADS):
            ce, hits, n = 0.0, 0, 0
            for b in range(labels.shape[0]):
                for t in range(seq - k - 2):
                    if labels[b, t + k + 2] == IGNORE_INDEX:
                        continue
                    p = torch.softmax(model.lm_head(hidden[b, t + k + 1]).double(), -1)
                    log_q = torch.log_softmax(model.head_logits(hidden[b, t], k).double(), -1)
                    ce -= float((p * log_q).sum())
                    hits += int(log_q.argmax() == p.argmax())
                    n += 1
            head = result.per_head[k]
            assert head.count == n > 0
            assert head.loss == pytest.approx(ce / n, rel=1e-5)
            assert head.top1 == hits / n


def test_config_accepts_teacher_for_both_recipes():
    """Unlike greedy targets, a teacher works with a training backbone too (medusa2 joint: the adapted model)."""
    assert build_config({"loss": {"targets": "teacher"}}).loss.targets == "teacher"
    joint = build_config({"method": "medusa2", "loss": {"targets": "teacher"}})
    assert joint.loss.targets == "teacher"
    with pytest.raises(ConfigError, match="text, greedy or teacher"):
        build_config({"loss": {"targets": "soft"}})


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_teacher_projects_each_position_once_for_every_head(chunk_size):
    """The heads read the same distributions one position apart: each position a head needs is projected
    once per chunk (plus the few a chunk's window shares with the next), not once per head."""
    model = make_model()
    input_ids, attention_mask, labels = make_batch()
    with torch.no_grad():
        hidden = model(input_ids, attention_mask).hidden_states
    projected = []

    def counting(rows):
        projected.append(rows.shape[0])
        return model.base_logits(rows)

    targets = teacher_targets(labels, NUM_HEADS, Teacher(counting, hidden))
    result = depthwise_loss_backward(model.head_logits, hidden, targets, chunk_size=chunk_size, backward=None)
    seq, step = labels.shape[1], chunk_size or labels.shape[1]
    want = []
    for start in range(0, seq, step):  # positions t + k + 1 of each chunk's targets, as a set
        needed = {(b, t + k + 1) for k in range(NUM_HEADS) for b in range(labels.shape[0])
                  for t in range(start, min(start + step, seq)) if t + k + 2 < seq and labels[b, t + k + 2] != IGNORE_INDEX}
        if needed:
            want.append(len(needed))
    assert projected == want
    assert sum(projected) < sum(head.count for head in result.per_head)  # once per head would project them all
