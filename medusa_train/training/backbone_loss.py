"""The backbone's own next-token loss in Medusa-2: cross-entropy on the labels, or self-distillation
(KL from the original model's distribution to the adapted one's), chunk by chunk."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from medusa_train.data.tokenize import IGNORE_INDEX


@dataclass
class BaseMetrics:
    """The backbone's own next-token figures over the positions whose next token is a label.

    Attributes:
        ce: Mean cross-entropy of the adapted model on the labels.
        kl: Mean KL(original || adapted) per position (0 when no original was given).
        top1: Fraction of labels that are the adapted model's top-1 prediction.
        agreement: Fraction of positions where the adapted and original top-1 agree (1 without original).
        count: Number of positions.
    """

    ce: float
    kl: float
    top1: float
    agreement: float
    count: int


def base_loss_backward(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    labels: torch.Tensor,
    kind: str | None,
    original_hidden: torch.Tensor | None = None,
    chunk_size: int | None = None,
    backward: Callable[[torch.Tensor], None] | None = torch.Tensor.backward,
    loss_scale: float = 1.0,
) -> BaseMetrics:
    """The backbone's next-token loss, forward and backward one sequence chunk at a time.

    Position ``t`` predicts ``labels[:, t + 1]``; only positions with a valid target count. At
    most ``batch x chunk_size`` positions' logits exist at once.

    Args:
        logits_fn: ``hidden -> logits`` (e.g. ``model.base_logits``).
        hidden: (batch, seq, hidden) adapted hidden states; backpropagated into when it requires grad
            (pass a detached leaf, as ``depthwise_loss_backward`` does).
        labels: (batch, seq) tokens, ``IGNORE_INDEX`` where not trained.
        kind: What is backpropagated: ``ce``, ``distill`` (KL from ``original_hidden``'s
            distribution), or ``None`` (metrics only).
        original_hidden: (batch, seq, hidden) hidden states of the original model (no grad);
            needed for ``distill`` and for the KL / agreement metrics.
        chunk_size: Sequence positions per chunk; ``None`` for the whole sequence.
        backward: Called on each chunk's share of the mean loss; ``None`` computes metrics only.
        loss_scale: Factor on what is backpropagated (e.g. ``1 / grad_accum_steps``).

    Returns:
        ``BaseMetrics`` (unscaled means).
    """
    if labels.dim() != 2 or hidden.shape[:2] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} differ in (batch, seq)")
    if kind not in (None, "ce", "distill"):
        raise ValueError(f"loss.base={kind!r}: must be null, ce or distill")
    if kind == "distill" and original_hidden is None:
        raise ValueError("loss.base=distill needs the original model's hidden states")
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    valid = targets != IGNORE_INDEX
    step = chunk_size or labels.shape[1]
    chunk_counts = [int(v.sum()) for v in valid.split(step, dim=1)]
    count = sum(chunk_counts)
    train = backward is not None and kind is not None and hidden.requires_grad
    sums = torch.zeros(4, dtype=torch.float64)  # CE, KL, top-1 hits, agreements
    for c, start in enumerate(range(0, labels.shape[1], step)):
        if chunk_counts[c] == 0:
            continue
        mask = valid[:, start:start + step]
        chunk_targets = targets[:, start:start + step][mask]
        with torch.set_grad_enabled(train):
            log_q = logits_fn(hidden[:, start:start + step][mask]).float().log_softmax(-1)
            ce = -log_q.gather(-1, chunk_targets[:, None]).sum()
            kl, agree = torch.zeros(()), torch.tensor(float(chunk_counts[c]))
            if original_hidden is not None:
                with torch.no_grad():
                    log_p = logits_fn(original_hidden[:, start:start + step][mask]).float().log_softmax(-1)
                    agree = (log_p.argmax(-1) == log_q.argmax(-1)).sum()
                with torch.set_grad_enabled(train and kind == "distill"):
                    kl = (log_p.exp() * (log_p - log_q)).sum()
            if train:
                backward((ce if kind == "ce" else kl) * (loss_scale / count))
        with torch.no_grad():
            top1 = (log_q.argmax(-1) == chunk_targets).sum()
            sums += torch.stack([ce.detach(), kl.detach(), top1, agree]).double().cpu()
    n = max(count, 1)
    return BaseMetrics(ce=sums[0].item() / n, kl=sums[1].item() / n, top1=sums[2].item() / n,
                       agreement=sums[3].item() / n if count else 1.0, count=count)


def base_term(base: BaseMetrics | None, kind: str | None) -> float:
    """``L_base`` as configured: the CE, the KL, or 0."""
    if base is None or kind is None:
        return 0.0
    return base.ce if kind == "ce" else base.kl


BASE_FIGURES = ("ce", "kl", "top1", "agreement")


def base_sums(bases: list[BaseMetrics]) -> torch.Tensor:
    """``[tokens, ce, kl, top1, agreement]``, each figure times its tokens, summed over ``bases`` (float64): what
    micro-batches and processes add up (``accelerator.reduce(..., "sum")``) before ``from_sums`` takes the means."""
    return torch.tensor([sum(b.count for b in bases)] + [sum(getattr(b, k) * b.count for b in bases)
                                                         for k in BASE_FIGURES], dtype=torch.float64)


def from_sums(sums: torch.Tensor) -> BaseMetrics:
    """The token-weighted means of ``base_sums``' totals."""
    count = int(sums[0].item())
    return BaseMetrics(**{k: sums[i + 1].item() / max(count, 1) for i, k in enumerate(BASE_FIGURES)}, count=count)


def base_record(base: BaseMetrics) -> dict[str, float]:
    """``base``'s figures keyed ``base/ce``, ``base/kl``, ``base/top1``, ``base/agreement`` (none without tokens)."""
    return {f"base/{k}": getattr(base, k) for k in BASE_FIGURES} if base.count else {}
