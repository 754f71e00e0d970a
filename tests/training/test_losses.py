"""Losses: head-by-head (and chunked) loss and gradients equal the naive all-heads loss."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from helpers.losses import (
    BATCH,
    NUM_HEADS,
    SEQ,
    assert_close_grad,
    assert_same,
    grads,
    make_batch,
    make_model,
    zero_grads,
)

from medusa_train.data.tokenize import IGNORE_INDEX
from medusa_train.training import losses
from medusa_train.training.losses import (
    depthwise_loss_backward,
    depthwise_loss_naive,
    head_weights,
)
from medusa_train.training.targets import (
    greedy_targets,
    shift_labels_for_head,
    text_targets,
)


def run_naive(model, input_ids, attention_mask, labels, scale: float = 1.0):
    hidden = model(input_ids, attention_mask).hidden_states
    loss, result = depthwise_loss_naive(model.head_logits, hidden, text_targets(labels, NUM_HEADS))
    (loss * scale).backward()
    out = grads(model)
    zero_grads(model)
    return loss.detach(), result, out


def run_head_by_head(model, input_ids, attention_mask, labels, predictions=None, **kwargs):
    hidden = model(input_ids, attention_mask).hidden_states
    targets = text_targets(labels, NUM_HEADS) if predictions is None else greedy_targets(labels, NUM_HEADS, predictions)
    result = depthwise_loss_backward(model.head_logits, hidden, targets, **kwargs)
    out = grads(model)
    zero_grads(model)
    return result, out


# ----------------------------------------------------------------------------- parity with naive
@pytest.mark.parametrize("chunk_size", [None, 1, 5, 8, 100])
@pytest.mark.parametrize("backbone", ["frozen", "trainable"])
def test_gradients_match_naive(chunk_size, backbone):
    model = make_model()
    if backbone == "trainable":  # gradient must flow through hidden.backward(leaf.grad)
        model.backbone.model.norm.weight.requires_grad_(True)
        model.backbone.model.layers[-1].mlp.requires_grad_(True)
    batch = make_batch()
    naive_loss, naive_result, naive_grads = run_naive(model, *batch)
    result, got = run_head_by_head(model, *batch, chunk_size=chunk_size)
    assert any(name.startswith("backbone.") for name in got) == (backbone == "trainable")
    assert_same(result, naive_loss, naive_result, got, naive_grads)


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_greedy_targets_match_naive(chunk_size):
    """With ``predictions`` each head keeps its own subset of positions; head-by-head still equals naive."""
    model = make_model()
    input_ids, attention_mask, labels = make_batch()
    predictions = torch.roll(input_ids, -1, dims=1)  # the text agrees with "greedy" ...
    predictions[0, 9] += 1  # ... except at a few positions, which cut different runs per head
    predictions[1, 6] += 1
    hidden = model(input_ids, attention_mask).hidden_states
    loss, naive = depthwise_loss_naive(model.head_logits, hidden, greedy_targets(labels, NUM_HEADS, predictions))
    loss.backward()
    naive_grads = grads(model)
    zero_grads(model)
    result, got = run_head_by_head(model, input_ids, attention_mask, labels, chunk_size=chunk_size,
                                   predictions=predictions)
    assert_same(result, loss.detach(), naive, got, naive_grads)
    text_counts = [m.count for m in run_head_by_head(model, input_ids, attention_mask, labels)[0].per_head]
    counts = [m.count for m in result.per_head]
    assert all(0 < c < t for c, t in zip(counts, text_counts)) and counts == sorted(counts, reverse=True)


def test_loss_scale_scales_gradients_not_loss():
    model = make_model()
    batch = make_batch()
    model.backbone.model.norm.weight.requires_grad_(True)
    naive_loss, naive_result, naive_grads = run_naive(model, *batch, scale=0.25)
    result, got = run_head_by_head(model, *batch, chunk_size=7, loss_scale=0.25)
    assert_same(result, naive_loss, naive_result, got, naive_grads)


def test_cached_hidden_states_leaf_without_grad():
    """Cached states (plain tensor, no graph): only the heads get gradients."""
    model = make_model()
    input_ids, attention_mask, labels = make_batch()
    with torch.no_grad():
        hidden = model(input_ids, attention_mask).hidden_states
    loss, _ = depthwise_loss_naive(model.head_logits, hidden, text_targets(labels, NUM_HEADS))
    loss.backward()
    ref = grads(model)
    zero_grads(model)
    depthwise_loss_backward(model.head_logits, hidden, text_targets(labels, NUM_HEADS), chunk_size=6)
    got = grads(model)
    for name in ref:
        assert_close_grad(got[name], ref[name], name)
    assert hidden.grad is None


def test_cross_entropy_blocks(monkeypatch):
    """The float32 upcast inside the cross-entropy goes block by block; blocks must not change anything."""
    model = make_model()
    batch = make_batch()
    naive_loss, naive_result, naive_grads = run_naive(model, *batch)
    monkeypatch.setattr(losses, "_BLOCK_ELEMENTS", 256 * 3)  # 3 rows per block, a ragged last block
    result, got = run_head_by_head(model, *batch)
    assert_same(result, naive_loss, naive_result, got, naive_grads)


def test_backward_callable_receives_the_weighted_scaled_parts():
    """What goes to ``backward`` (e.g. accelerator.backward) sums to loss * loss_scale."""
    model = make_model()
    input_ids, attention_mask, labels = make_batch()
    hidden = model(input_ids, attention_mask).hidden_states
    parts = []

    def backward(t):
        parts.append(t.detach())
        t.backward()

    result = depthwise_loss_backward(model.head_logits, hidden, text_targets(labels, NUM_HEADS), chunk_size=10, backward=backward, loss_scale=0.5)
    # 3 chunks per head, but head 3's last chunk (positions 20-23 -> targets 24-27) has none: skipped
    assert len(parts) == NUM_HEADS * 3 - 1
    assert all(p.dim() == 0 for p in parts)
    torch.testing.assert_close(torch.stack(parts).sum(), result.loss * 0.5)


def test_eval_mode_metrics_only():
    model = make_model()
    model.backbone.model.norm.weight.requires_grad_(True)
    input_ids, attention_mask, labels = make_batch()
    hidden = model(input_ids, attention_mask).hidden_states
    _, ref = depthwise_loss_naive(model.head_logits, hidden.detach(), text_targets(labels, NUM_HEADS))
    result = depthwise_loss_backward(model.head_logits, hidden, text_targets(labels, NUM_HEADS), chunk_size=5, backward=None)
    assert all(p.grad is None for p in model.parameters())
    torch.testing.assert_close(result.loss, ref.loss)
    assert [(m.count, m.top1, m.top5) for m in result.per_head] == [(m.count, m.top1, m.top5) for m in ref.per_head]


def test_autocast_bf16_cpu():
    """Mixed precision: bf16 logits, float32 cross-entropy; close to the naive loss under the same autocast."""
    model = make_model()
    batch = make_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.head_logits(model(*batch[:2]).hidden_states, 0).dtype == torch.bfloat16
        naive_loss, _, naive_grads = run_naive(model, *batch)
        result, got = run_head_by_head(model, *batch, chunk_size=5)
    assert result.loss.dtype == torch.float32 and torch.isfinite(result.loss)
    torch.testing.assert_close(result.loss, naive_loss, rtol=1e-3, atol=0)
    for name in naive_grads:  # both round a float32 gradient to bf16; a bf16 ulp is 0.4%
        scale = naive_grads[name].abs().max().item()
        torch.testing.assert_close(got[name], naive_grads[name], rtol=2e-2, atol=1e-2 * scale, msg=name)


# ----------------------------------------------------------------------------- labels, weights, metrics
def test_shift_labels_for_head_exact():
    labels = torch.tensor([[10, 11, 12, 13, -100, 15],
                           [20, -100, 22, 23, 24, 25]])
    assert shift_labels_for_head(labels, 0).tolist() == [[12, 13, -100, 15, -100, -100],
                                                         [22, 23, 24, 25, -100, -100]]
    assert shift_labels_for_head(labels, 1).tolist() == [[13, -100, 15, -100, -100, -100],
                                                         [23, 24, 25, -100, -100, -100]]
    assert shift_labels_for_head(labels[:, :2], 0).tolist() == [[-100, -100], [-100, -100]]
    assert labels[0, 0] == 10  # input untouched


def test_head_weights_exact():
    w = head_weights(3, 0.8)
    assert w == pytest.approx([1 / 2.44, 0.8 / 2.44, 0.64 / 2.44], rel=1e-12, abs=0)
    assert math.isclose(sum(w), 1.0, rel_tol=1e-12)
    assert head_weights(1, 0.8) == [1.0]
    assert head_weights(4, 0.0) == [1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="num_heads=0"):
        head_weights(0, 0.8)
    with pytest.raises(ValueError, match="head_decay=-0.5"):
        head_weights(2, -0.5)


def position_logits_fn(tables: list[torch.Tensor]):
    """A head whose logits at a position are looked up from ``tables[k]`` by the position's flat index.

    The hidden state carries the index in channel 0, so this works however positions are packed/chunked.
    """
    def fn(hidden, k):
        return tables[k][hidden[..., 0].round().long()]
    return fn


def position_hidden(batch: int, seq: int) -> torch.Tensor:
    hidden = torch.zeros(batch, seq, 4)
    hidden[..., 0] = torch.arange(batch * seq, dtype=torch.float32).view(batch, seq)
    return hidden


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_topk_accuracy_exact(chunk_size):
    batch, seq, vocab, num_heads = 2, 12, 16, 2
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[0, :3] = IGNORE_INDEX
    labels[1, 7] = IGNORE_INDEX
    tables, expected = [], []
    for k in range(num_heads):
        targets = shift_labels_for_head(labels, k).flatten()
        table = torch.rand(batch * seq, vocab, generator=g)  # noise in [0, 1)
        top1 = top5 = count = 0
        for i, t in enumerate(targets.tolist()):
            if t == IGNORE_INDEX:
                continue
            count += 1
            kind = i % 4
            others = [v for v in range(vocab) if v != t]
            if kind in (0, 1):  # right: top-1
                table[i, t] = 10.0
                top1 += 1
                top5 += 1
            elif kind == 2:  # third: in the top 5, not top-1
                table[i, others[0]], table[i, others[1]], table[i, t] = 10.0, 9.0, 8.0
                top5 += 1
            else:  # last
                table[i, t] = -10.0
        tables.append(table)
        expected.append((count, top1 / count, top5 / count))
    hidden = position_hidden(batch, seq)
    result = depthwise_loss_backward(position_logits_fn(tables), hidden, text_targets(labels, num_heads), chunk_size=chunk_size, backward=None)
    assert [(m.count, m.top1, m.top5) for m in result.per_head] == expected
    assert 0 < expected[0][1] < expected[0][2] < 1  # all three kinds occur
    _, naive = depthwise_loss_naive(position_logits_fn(tables), hidden, text_targets(labels, num_heads))
    assert [(m.count, m.top1, m.top5) for m in naive.per_head] == expected


def test_top5_capped_at_vocab():
    vocab = 3
    labels = torch.randint(0, vocab, (1, 8))
    tables = [torch.randn(8, vocab)]
    result = depthwise_loss_backward(position_logits_fn(tables), position_hidden(1, 8), text_targets(labels, 1), backward=None)
    assert result.per_head[0].top5 == 1.0 and result.per_head[0].count == 6


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_head_without_targets_contributes_zero(chunk_size):
    model = make_model()
    input_ids, attention_mask, _ = make_batch()
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, 2] = input_ids[:, 2]  # only head 0 (t=0 -> t+2) has a target; head 1 and 2 none
    hidden = model(input_ids, attention_mask).hidden_states
    result = depthwise_loss_backward(model.head_logits, hidden, text_targets(labels, NUM_HEADS), chunk_size=chunk_size)
    assert [m.count for m in result.per_head] == [2, 0, 0]
    for m in result.per_head[1:]:
        assert (m.loss, m.top1, m.top5) == (0.0, 0.0, 0.0)
    w0 = head_weights(NUM_HEADS, 0.8)[0]
    assert result.loss.item() == pytest.approx(w0 * result.per_head[0].loss, rel=1e-6)
    assert all(torch.isfinite(p.grad).all() for p in model.heads[0].parameters())
    assert all(p.grad is None for p in model.heads[1].parameters())

    _, naive = depthwise_loss_naive(model.head_logits, hidden.detach(), text_targets(labels, NUM_HEADS))
    assert [m.loss for m in naive.per_head[1:]] == [0.0, 0.0]

    nothing = torch.full_like(labels, IGNORE_INDEX)
    result = depthwise_loss_backward(model.head_logits, hidden.detach(), text_targets(nothing, NUM_HEADS), chunk_size=chunk_size)
    assert result.loss.item() == 0.0 and [m.count for m in result.per_head] == [0] * NUM_HEADS


def test_rejects_mismatched_shapes_and_bad_chunk():
    hidden = torch.zeros(2, 5, 4)
    with pytest.raises(ValueError, match="differ"):
        depthwise_loss_backward(lambda h, k: h, hidden, text_targets(torch.zeros(2, 6, dtype=torch.long), 1))
    with pytest.raises(ValueError, match="chunk_size=0"):
        depthwise_loss_backward(lambda h, k: h, hidden, text_targets(torch.zeros(2, 5, dtype=torch.long), 1), chunk_size=0)


# ----------------------------------------------------------------------------- memory property
class LiveLogits:
    """Wraps ``head_logits``: records each call's logits shape and how many earlier logits were still alive."""

    def __init__(self, fn):
        self.fn = fn
        self.alive: list[weakref.ref] = []
        self.max_alive_before_call = 0
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, hidden, k):
        alive = [r for r in self.alive if r() is not None]
        self.max_alive_before_call = max(self.max_alive_before_call, len(alive))
        logits = self.fn(hidden, k)
        self.alive = alive + [weakref.ref(logits)]
        self.shapes.append(tuple(logits.shape))
        return logits


@pytest.mark.parametrize("mode", ["frozen", "trainable", "eval"])
@pytest.mark.parametrize("chunk_size", [None, 5])
def test_one_logits_tensor_alive_at_a_time(mode, chunk_size):
    model = make_model()
    if mode == "trainable":
        model.backbone.model.norm.weight.requires_grad_(True)
    input_ids, attention_mask, labels = make_batch()
    hidden = model(input_ids, attention_mask).hidden_states
    live = LiveLogits(model.head_logits)
    depthwise_loss_backward(live, hidden, text_targets(labels, NUM_HEADS), chunk_size=chunk_size, backward=None if mode == "eval" else torch.Tensor.backward)
    assert live.max_alive_before_call == 0
    assert all(r() is None for r in live.alive)  # nothing kept after the call either
    vocab = model.config.vocab_size
    per_call = BATCH * (chunk_size or SEQ) * vocab
    assert max(math.prod(s) for s in live.shapes) <= per_call
    # chunks without a valid target are skipped: with 5, head 3's last chunk (20-23 -> 24-27) is empty
    assert len(live.shapes) == (NUM_HEADS * 5 - 1 if chunk_size else NUM_HEADS)


def test_naive_keeps_all_heads_alive():
    """The counter can see the difference: the naive loss holds every head's logits at once."""
    model = make_model()
    input_ids, attention_mask, labels = make_batch()
    hidden = model(input_ids, attention_mask).hidden_states
    live = LiveLogits(model.head_logits)
    depthwise_loss_naive(live, hidden, text_targets(labels, NUM_HEADS))
    assert live.max_alive_before_call == NUM_HEADS - 1


def test_logits_saved_by_their_own_op_fail_loudly():
    """The gradient is written over the logits: a head whose last op saves its output must raise, not mislead."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 16)
    hidden, labels = torch.randn(2, 6, 8), torch.randint(16, (2, 6))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        depthwise_loss_backward(lambda h, k: torch.exp(linear(h)), hidden, text_targets(labels, 2))
