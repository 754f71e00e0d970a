"""Medusa head losses, computed head by head so only one head's logits exist at a time.

Head ``k`` (0-based) at position ``t`` predicts the token at ``t + k + 2`` (the base LM head
predicts ``t + 1``). Each head's loss is the float32 cross-entropy averaged over its valid
targets; the total is ``sum_k w_k * L_k`` with ``w = head_weights(num_heads, head_decay)``.

With a ``Teacher`` (``loss.targets=teacher``) head ``k`` at ``t`` learns the backbone's whole
next-token distribution at ``t + k + 1`` (soft labels) instead of the one token the text holds.

``depthwise_loss_backward`` is what training calls: it runs forward *and* backward one sequence
chunk (optional) and one head at a time, so peak memory is about one head's logits instead of
all of them; a teacher's distributions over a chunk are computed once for every head.
``depthwise_loss_naive`` is the all-heads-at-once reference used by tests and the benchmark.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from medusa_train.data.tokenize import IGNORE_INDEX
from medusa_train.training.targets import HeadTargets

TOPK = 5
# Rows of logits upcast to float32 at once inside the cross-entropy (about 64 MiB per block).
_BLOCK_ELEMENTS = 2**24

HeadLogitsFn = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass
class HeadMetrics:
    """One head's figures over its valid targets.

    Attributes:
        loss: Mean cross-entropy (0 when there are no valid targets).
        top1: Fraction of targets that are the head's top-1 prediction.
        top5: Fraction of targets among the head's top-5 predictions (top-vocab when vocab < 5).
        count: Number of valid target tokens.
    """

    loss: float
    top1: float
    top5: float
    count: int


@dataclass
class LossResult:
    """What a loss call returns.

    Attributes:
        loss: Detached float32 scalar: the weighted, normalised total (without ``loss_scale``).
        per_head: Metrics of each head, head 0 first.
    """

    loss: torch.Tensor
    per_head: list[HeadMetrics]

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        """Flat metrics for a logger, heads named 1-based: ``{"loss", "head1/loss", "head1/top1", ...}``."""
        out = {f"{prefix}loss": float(self.loss)}
        for k, m in enumerate(self.per_head, start=1):
            out[f"{prefix}head{k}/loss"] = m.loss
            out[f"{prefix}head{k}/top1"] = m.top1
            out[f"{prefix}head{k}/top5"] = m.top5
        return out


def head_weights(num_heads: int, head_decay: float) -> list[float]:
    """Loss weights ``decay**k`` normalised to sum to 1, so the head count does not change the loss scale."""
    if num_heads < 1:
        raise ValueError(f"num_heads={num_heads}: must be >= 1")
    if head_decay < 0:
        raise ValueError(f"head_decay={head_decay}: must be >= 0")
    raw = [head_decay**k for k in range(num_heads)]
    return [w / sum(raw) for w in raw]


def depthwise_loss_backward(
    head_logits_fn: HeadLogitsFn,
    hidden: torch.Tensor,
    targets: HeadTargets,
    head_decay: float = 0.8,
    chunk_size: int | None = None,
    backward: Callable[[torch.Tensor], None] | None = torch.Tensor.backward,
    loss_scale: float = 1.0,
) -> LossResult:
    """Medusa loss, forward and backward one head (and one sequence chunk) at a time.

    Gradients equal those of ``depthwise_loss_naive(...)[0].backward()`` (times ``loss_scale``),
    but at most one head's logits for ``batch x chunk_size`` positions exist at any moment.
    When ``hidden`` requires grad, the heads backpropagate into a detached leaf copy whose
    gradient is pushed into the backbone once at the end (``hidden.backward(leaf.grad)``).

    Only positions with a valid target are sent to the heads, packed as a (1, n, hidden)
    tensor, so ``head_logits_fn`` must treat positions independently (Medusa heads do). The
    logits it returns are overwritten by their own gradient during backward: they must not be
    saved by its last operation (a Linear layer's output never is; autograd raises otherwise).

    Args:
        head_logits_fn: ``(hidden, k) -> logits`` of head ``k``, e.g. ``model.head_logits``.
        hidden: (batch, seq, hidden) final hidden states, requiring grad or not.
        targets: What each head learns (``training.targets``): token ids, or soft labels with a
            ``teacher`` (cross-entropy to the backbone's distribution; top-1/top-5 count hits on its top token).
        head_decay: Head ``k`` is weighted ``head_decay**k`` (normalised, see ``head_weights``).
        chunk_size: Sequence positions per chunk; ``None`` for the whole sequence.
        backward: Called on each weighted partial loss (e.g. ``accelerator.backward``);
            ``None`` computes metrics only, without gradients (evaluation).
        loss_scale: Factor on what is backpropagated (e.g. ``1 / grad_accum_steps``); the
            returned loss is not scaled.
    Returns:
        The detached total loss and per-head metrics.

    Raises:
        ValueError: ``hidden`` and the targets differ in (batch, seq), or ``chunk_size`` < 1.
    """
    _check_shapes(hidden, targets)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: must be >= 1 or None")
    num_heads, teacher = targets.num_heads, targets.teacher
    seq = hidden.shape[1]
    step = chunk_size or seq
    weights = head_weights(num_heads, head_decay)
    train = backward is not None
    to_backbone = train and hidden.requires_grad
    leaf = hidden.detach().requires_grad_(to_backbone)

    # Counts first (one sync): every chunk's share is normalised by its head's total count.
    tokens = targets.tokens.to(hidden.device)
    valid = tokens != IGNORE_INDEX
    chunk_counts = torch.stack([v.sum(dim=(1, 2)) for v in valid.split(step, dim=2)], dim=1).tolist()
    counts = [sum(c) for c in chunk_counts]
    stats = torch.zeros(num_heads, 3, device=hidden.device)  # summed CE, top-1 hits, top-k hits

    with torch.set_grad_enabled(train):
        for c, start in enumerate(range(0, seq, step)):
            if not any(chunk_counts[k][c] for k in range(num_heads)):
                continue
            masks = valid[:, :, start:start + step]
            window = None if teacher is None else teacher.window(start, masks)  # every head's, computed once
            for k in range(num_heads):
                if chunk_counts[k][c] == 0:
                    continue
                mask = masks[k]
                rows = None if window is None else window.rows(k, mask)
                chunk_targets = tokens[k, :, start:start + step][mask] if window is None else window.top[rows]
                logits = head_logits_fn(leaf[:, start:start + step][mask].unsqueeze(0), k)
                logits = logits.reshape(-1, logits.shape[-1])  # (n, vocab)
                with torch.no_grad():
                    stats[k, 1:] += torch.stack(_topk_hits(logits, chunk_targets))
                ce_sum = _SumCrossEntropy.apply(logits, chunk_targets if window is None else window.probs, rows)
                del logits  # from here on only the autograd graph holds them, until backward frees it
                stats[k, 0] += ce_sum.detach()
                if train:
                    backward(ce_sum * (weights[k] * loss_scale / counts[k]))
    if to_backbone and leaf.grad is not None:
        hidden.backward(leaf.grad)
    return _result(stats, counts, weights)


def depthwise_loss_naive(
    head_logits_fn: HeadLogitsFn,
    hidden: torch.Tensor,
    targets: HeadTargets,
    head_decay: float = 0.8,
) -> tuple[torch.Tensor, LossResult]:
    """Reference Medusa loss: every head's logits at once, one differentiable total.

    Returns:
        ``(loss, result)``: the total with its autograd graph (call ``.backward()`` on it) and
        the same detached total with per-head metrics.
    """
    _check_shapes(hidden, targets)
    num_heads, teacher = targets.num_heads, targets.teacher
    weights = head_weights(num_heads, head_decay)
    logits = [head_logits_fn(hidden, k) for k in range(num_heads)]
    all_targets = targets.tokens.to(hidden.device)
    total = torch.zeros((), device=hidden.device)
    stats = torch.zeros(num_heads, 3, device=hidden.device)
    counts = []
    for k, head_logits in enumerate(logits):
        targets = all_targets[k]
        count = int((targets != IGNORE_INDEX).sum())
        if teacher is None:
            ce_sum = F.cross_entropy(head_logits.flatten(0, -2).float(), targets.flatten(),
                                     ignore_index=IGNORE_INDEX, reduction="sum")
        else:  # the distribution at t + k + 1 for every position t that has a target
            valid = targets != IGNORE_INDEX
            seq = valid.shape[1]
            with torch.no_grad():
                source = teacher.hidden.detach()[:, k + 1:][valid[:, :seq - k - 1]]
                probs = torch.softmax(teacher.logits_fn(source).float(), dim=-1)
            ce_sum = F.cross_entropy(head_logits[valid].float(), probs, reduction="sum")
            head_logits, targets = head_logits[valid], probs.argmax(-1)
        total = total + weights[k] * ce_sum / max(count, 1)
        with torch.no_grad():
            stats[k] = torch.stack([ce_sum.detach(), *_topk_hits(head_logits, targets)])
        counts.append(count)
    return total, _result(stats, counts, weights)


class _SumCrossEntropy(torch.autograd.Function):
    """Summed float32 cross-entropy of (n, vocab) logits whose gradient is written over the logits.

    Targets are either (n,) token ids or soft labels: (m, vocab) probabilities with ``rows`` (n,), the row of
    each logits row's target (rows a teacher's window shares between heads, read in place). ``F.cross_entropy``
    keeps a float32 log-softmax for backward and its backward allocates two more logits-sized tensors. This keeps
    only the logits (and the soft targets) and, in backward, overwrites the logits block by block with
    ``(softmax - target) * grad``, so a head costs about one logits tensor (soft targets: plus one block of the rows
    it gathers, at most ``_BLOCK_ELEMENTS`` floats). Every target must be valid (the caller drops ignored positions).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        block_rows = _block_rows(logits)
        lse = torch.cat([torch.logsumexp(block.float(), dim=-1) for block in logits.split(block_rows)])
        if rows is None:
            target_logits = logits.gather(1, targets[:, None]).squeeze(1).float()
        else:
            target_logits = torch.cat([(block.float() * targets.index_select(0, index)).sum(-1)
                                       for block, index in zip(logits.split(block_rows), rows.split(block_rows))])
        ctx.save_for_backward(logits, targets, lse, rows)
        return (lse - target_logits).sum()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, targets, lse, rows = ctx.saved_tensors
        block_rows = _block_rows(logits)
        for start in range(0, logits.shape[0], block_rows):
            block = logits[start:start + block_rows]
            grad = block.float()  # the block itself (in place) when the logits are float32
            grad.sub_(lse[start:start + block_rows, None]).exp_()  # softmax
            if rows is None:
                grad[torch.arange(grad.shape[0], device=grad.device), targets[start:start + block_rows]] -= 1.0
            else:
                grad.sub_(targets.index_select(0, rows[start:start + block_rows]))
            grad.mul_(grad_loss)
            if grad is not block:
                block.copy_(grad)
        return logits, None, None


def _check_shapes(hidden: torch.Tensor, targets: HeadTargets) -> None:
    if targets.tokens.dim() != 3 or hidden.shape[:2] != targets.tokens.shape[1:]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.tokens.shape)} (heads, batch, seq) "
                         "differ in (batch, seq)")


def _block_rows(logits: torch.Tensor) -> int:
    return max(1, _BLOCK_ELEMENTS // logits.shape[-1])


def _topk_hits(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 and top-``min(5, vocab)`` hit counts over the targets that are not ``IGNORE_INDEX``."""
    top = logits.topk(min(TOPK, logits.shape[-1]), dim=-1).indices
    hits = (top == targets.unsqueeze(-1)) & (targets != IGNORE_INDEX).unsqueeze(-1)
    return hits[..., 0].sum().float(), hits.any(dim=-1).sum().float()


def _result(stats: torch.Tensor, counts: list[int], weights: list[float]) -> LossResult:
    """Per-head means from summed (CE, top-1 hits, top-k hits) and counts; heads with no targets give 0."""
    sums = stats.detach().double().tolist()
    per_head = [HeadMetrics(loss=ce / max(c, 1), top1=top1 / max(c, 1), top5=topk / max(c, 1), count=c)
                for (ce, top1, topk), c in zip(sums, counts)]
    total = sum(w * m.loss for w, m in zip(weights, per_head))
    return LossResult(loss=torch.tensor(total, dtype=torch.float32, device=stats.device), per_head=per_head)
