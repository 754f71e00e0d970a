"""A tiny model with random heads and a batch with untrained spans, and the checks that a loss's result and
gradients equal a reference's (the head-by-head loss against the naive all-heads loss)."""

from __future__ import annotations

import pytest
import torch

from helpers.backbones import make_tiny_backbone
from medusa_train import MedusaModel
from medusa_train.data.tokenize import IGNORE_INDEX

NUM_HEADS = 3
BATCH, SEQ = 2, 24


def make_model(seed: int = 0) -> MedusaModel:
    """Tiny Llama + 3 heads with random weights, so every head (and its ResBlock) differs."""
    model = MedusaModel.from_backbone(make_tiny_backbone("llama", seed=seed), num_heads=NUM_HEADS, num_layers=1)
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.normal_(0.0, 0.2)
    return model


def make_batch(seed: int = 0, vocab: int = 256):
    """Two rows: a prompt that is not trained, and padding at the end of the second row."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (BATCH, SEQ), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -7:] = 0
    input_ids[1, -7:] = 0
    labels = input_ids.clone()
    labels[:, :5] = IGNORE_INDEX  # prompt
    labels[1, 12:14] = IGNORE_INDEX  # a user turn in the middle
    labels[attention_mask == 0] = IGNORE_INDEX
    return input_ids, attention_mask, labels


def trainable(model: MedusaModel) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def grads(model: MedusaModel) -> dict[str, torch.Tensor]:
    """Gradients of every trainable parameter, zeros where none was produced."""
    return {name: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            for name, p in trainable(model).items()}


def zero_grads(model: MedusaModel) -> None:
    for p in model.parameters():
        p.grad = None


def assert_same(result, naive_loss, naive_result, got_grads, naive_grads):
    assert result.loss.dtype == torch.float32 and not result.loss.requires_grad
    torch.testing.assert_close(result.loss, naive_loss, rtol=1e-5, atol=0)
    for mine, ref in zip(result.per_head, naive_result.per_head, strict=True):
        assert mine.count == ref.count
        assert mine.top1 == ref.top1 and mine.top5 == ref.top5
        assert mine.loss == pytest.approx(ref.loss, rel=1e-5)
    assert got_grads.keys() == naive_grads.keys()
    for name in naive_grads:
        assert naive_grads[name].abs().sum() > 0, f"{name}: the reference gradient is all zero, the test proves nothing"
        assert_close_grad(got_grads[name], naive_grads[name], name)


def assert_close_grad(got, ref, name):
    """rtol 1e-5, with an absolute floor at 1e-5 of the tensor's scale (summation order differs)."""
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(), msg=name)
