"""Training-time test: an EAGLE-3 draft trained on its own chained steps, as it drafts at serving time.

Step 0 at row ``p`` reads the token ``x[p + 1]`` and ``fc`` of the backbone's three states at ``p``, at rope position
``p``; step ``s >= 1`` at row ``p`` reads the text's token ``x[p + s + 1]`` (teacher-forced) and its own step
``s - 1`` pre-norm output at row ``p``, at rope position ``p + s``. Step ``s`` attends to the step-0 keys at rows
``<= p`` (causal) and to the keys of row ``p`` at steps ``1 .. s`` (the entries its own earlier steps wrote, as a
chain writes them while drafting). Step ``s`` at row ``p`` learns the backbone's distribution over the token at
``p + s + 2`` (its logits at ``p + s + 1``), renormalised over the draft vocabulary, where that token is one the
data trains (assistant labels) and the backbone's top token lies inside the draft vocabulary. The loss is
``sum_s w_s * mean CE_s`` with ``w = head_weights(steps, decay)`` (``decay**s``, normalised).

The chained steps are ``Eagle3Model.chained_steps``. The draft vocabulary's logits are computed a chunk of rows at a time and recomputed in the backward pass
(``torch.utils.checkpoint``), so at most ``chunk x draft vocab`` logits exist at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from medusa_train.data.tokenize import IGNORE_INDEX
from medusa_train.training.losses import TOPK, HeadMetrics, LossResult, head_weights


def ttt_loss(model, aux: torch.Tensor, final_hidden: torch.Tensor, input_ids: torch.Tensor,
             attention_mask: torch.Tensor, labels: torch.Tensor, steps: int, decay: float,
             chunk_size: int | None = None, backward: Callable | None = None, loss_scale: float = 1.0) -> LossResult:
    """Forward (and, with ``backward``, backward) of training-time test over one batch.

    Args:
        model: An ``Eagle3Model`` (its draft trains; the backbone's embedding and LM head are read, frozen).
        aux: (batch, seq, 3H) the backbone's three hidden states (``Eagle3Model.aux_states``).
        final_hidden: (batch, seq, H) its final-norm hidden states (the teacher's logits come from them).
        input_ids: (batch, seq) the text.
        attention_mask: (batch, seq) 1 on tokens, 0 on padding.
        labels: (batch, seq) the text's tokens where it trains, ``IGNORE_INDEX`` elsewhere.
        steps: Chained draft steps trained (``eagle3.ttt_steps``).
        decay: Step ``s`` weighs ``decay**s`` (normalised).
        chunk_size: Rows of draft-vocabulary logits at a time (``None``: 1024).
        backward: Called with the scaled loss (``accelerator.backward``); ``None`` evaluates only.
        loss_scale: Multiplies the loss given to ``backward`` (gradient accumulation).

    Returns:
        A ``LossResult`` whose ``per_head[s]`` are step ``s``'s figures (top-1: the draft's top token is the
        backbone's, among the draft vocabulary).
    """
    with torch.no_grad():
        trains = _trained_targets(model, final_hidden, labels)  # (batch, seq): a target at that token
    total = 0.0
    weights = head_weights(steps, decay)
    metrics = []
    for s, normed in enumerate(model.chained_steps(aux, input_ids, attention_mask, steps)):
        # row p at step s predicts the token at p + s + 2: trained when that token is
        target = F.pad(trains[:, s + 2:], (0, s + 2), value=False)
        rows = target.nonzero(as_tuple=True)
        teacher_rows = (rows[0], rows[1] + s + 1)
        ce, top1, topk, count = _soft_cross_entropy(model, normed[rows], final_hidden[teacher_rows].detach(),
                                                    chunk_size or 1024)
        mean = ce / max(count, 1)
        total = total + weights[s] * mean
        metrics.append(HeadMetrics(loss=float(mean.detach()), top1=float(top1) / max(count, 1),
                                   top5=float(topk) / max(count, 1), count=count))
    if backward is not None and torch.is_tensor(total) and total.requires_grad:
        backward(total * loss_scale)
    loss = total.detach().float() if torch.is_tensor(total) else torch.tensor(float(total))
    return LossResult(loss=loss, per_head=metrics)


def _trained_targets(model, final_hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(batch, seq) bool: the token at ``t`` is trained (a label) and the backbone's top token for it (its logits at
    ``t - 1``) lies in the draft vocabulary, so its renormalised distribution there is a fair target."""
    if model.config.draft_vocab_size == model.config.vocab_size:  # every top token is one the draft can guess
        return labels != IGNORE_INDEX
    in_vocab = torch.zeros(model.config.vocab_size, dtype=torch.bool, device=final_hidden.device)
    in_vocab[model.draft.token_map.to(final_hidden.device)] = True
    flat = final_hidden.reshape(-1, final_hidden.shape[-1])
    top = torch.cat([model.base_logits(rows).argmax(-1) for rows in flat.split(1024)]).view(final_hidden.shape[:-1])
    ok = (labels != IGNORE_INDEX) & F.pad(in_vocab[top][:, :-1], (1, 0), value=False)
    return ok


def _soft_cross_entropy(model, normed: torch.Tensor, teacher_hidden: torch.Tensor, chunk: int):
    """Summed CE of the draft's logits at ``normed`` (n, H) against the backbone's renormalised distribution at
    ``teacher_hidden`` (n, H), chunk by chunk, and top-1 / top-5 hits. Both sides' logits are recomputed in the
    backward pass (``checkpoint``), so only one chunk's exist at a time, forward or backward."""
    teacher_rows = model.draft_lm_head_rows()  # (draft vocab, H): gathered once per call, not per chunk
    ce = normed.new_zeros((), dtype=torch.float32)
    top1 = topk = 0
    for start in range(0, normed.shape[0], chunk):
        rows, teacher = normed[start:start + chunk], teacher_hidden[start:start + chunk]
        if rows.requires_grad:
            part, top, best = checkpoint(_chunk_ce, model.draft, rows, teacher, teacher_rows, use_reentrant=False)
        else:
            part, top, best = _chunk_ce(model.draft, rows, teacher, teacher_rows)
        ce = ce + part
        top1 += int((top[:, 0] == best).sum())
        topk += int((top == best[:, None]).any(-1).sum())
    return ce, top1, topk, normed.shape[0]


def _chunk_ce(draft, rows: torch.Tensor, teacher: torch.Tensor, teacher_rows: torch.Tensor):
    with torch.no_grad():
        target = torch.softmax((teacher.to(teacher_rows.dtype) @ teacher_rows.T).float(), dim=-1)
        best = target.argmax(-1)
    logits = draft.logits(rows).float()
    ce = -(target * torch.log_softmax(logits, dim=-1)).sum()
    return ce, logits.detach().topk(min(TOPK, logits.shape[-1]), dim=-1).indices, best
