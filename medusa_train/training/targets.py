"""What each head learns (``loss.targets``), as one small strategy: the recipe asks it for (inputs, targets).

Head ``k`` (0-based) at position ``t`` predicts the token at ``t + k + 2`` (the base LM head predicts
``t + 1``). ``inputs_and_targets`` returns what the heads read there (``MedusaModel.head_features``)
and a ``HeadTargets``, the one type the loss takes:

- ``text``: the data's own token ``labels[:, t + k + 2]``;
- ``greedy``: the frozen backbone's greedy continuation, where this one forward pass knows it
  (``greedy_tokens``); ``HeadTargets.text_counts()`` says how many targets the text offered;
- ``teacher``: the backbone's whole next-token distribution at ``t + k + 1`` (soft labels, ``Teacher``),
  at the text's trained positions.

Heads with a draft vocabulary (``heads.draft_vocab_size``) learn the same targets among its tokens
(``in_draft_vocabulary``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from medusa_train.data.tokenize import IGNORE_INDEX

TARGETS = ("text", "greedy", "teacher")


@dataclass
class Teacher:
    """Soft targets: the backbone's own next-token distribution, read from its hidden states.

    Head ``k`` at position ``t`` predicts the token at ``t + k + 2``; the backbone's distribution
    over that token is ``softmax(logits_fn(hidden[:, t + k + 1]))``, given the text up to
    ``t + k + 1``. Heads that read their path are given exactly that text, so on any text this is
    what decoding asks of them: the distribution whose top token the verify step accepts. Heads
    that do not read their path meet it only where the text is the backbone's own greedy
    continuation (self-distilled data).

    Every head reads the same distributions, shifted by one position per head, so ``window``
    computes each position's once for all heads (not once per head: the projection to the
    vocabulary is the teacher's whole cost).

    Attributes:
        logits_fn: ``hidden -> logits`` of the backbone, e.g. ``model.base_logits``.
        hidden: (batch, seq, hidden) the backbone's final hidden states (never differentiated).
    """

    logits_fn: Callable[[torch.Tensor], torch.Tensor]
    hidden: torch.Tensor

    @torch.no_grad()
    def window(self, start: int, valid: torch.Tensor) -> TeacherWindow:
        """The distributions the heads' targets at positions ``start:start + valid.shape[-1]`` need, each
        position's computed once: ``valid`` (num_heads, batch, width) says where head ``k`` learns. Every
        selected position has a target (``t + k + 2 < seq``, as the token targets guarantee)."""
        num_heads, _, width = valid.shape
        seq = self.hidden.shape[1]
        # column j of the window is position start + 1 + j; head k at chunk column c reads column c + k
        columns = max(0, min(width + num_heads - 1, seq - start - 1))
        needed = torch.zeros(valid.shape[1], columns, dtype=torch.bool, device=valid.device)
        for k in range(num_heads):
            span = max(0, min(width, columns - k))
            needed[:, k:k + span] |= valid[k, :, :span]
        rows = self.hidden.detach()[:, start + 1:start + 1 + columns][needed]
        probs = torch.softmax(self.logits_fn(rows).float(), dim=-1)
        index = torch.cumsum(needed.flatten(), 0).reshape(needed.shape) - 1
        return TeacherWindow(probs, probs.argmax(-1), index)


@dataclass
class TeacherWindow:
    """The teacher's distributions over one window of positions (``Teacher.window``), shared by every head.

    Attributes:
        probs: (n, vocab) float32, one row per position some head needs.
        top: (n,) each row's top token.
        index: (batch, columns) the row of ``probs`` at each column of the window (meaningless where none is).
    """

    probs: torch.Tensor
    top: torch.Tensor
    index: torch.Tensor

    def rows(self, k: int, mask: torch.Tensor) -> torch.Tensor:
        """Head ``k``'s rows of ``probs``, in the order of the positions its ``mask`` (batch, width) selects."""
        span = min(mask.shape[1], self.index.shape[1] - k)
        return self.index[:, k:k + span][mask[:, :span]]


@dataclass
class HeadTargets:
    """Every head's targets.

    Attributes:
        tokens: (num_heads, batch, seq) the token head ``k`` learns at each position, ``IGNORE_INDEX``
            where it learns nothing.
        teacher: Soft labels at the same positions (``loss.targets=teacher``); ``tokens`` then only
            say where.
        text_labels: The text's labels, when these targets keep only a share of its targets (greedy
            targets); ``None`` otherwise. Only an evaluation asks how many (``text_counts``).
    """

    tokens: torch.Tensor
    teacher: Teacher | None = None
    text_labels: torch.Tensor | None = None

    def text_counts(self) -> list[int] | None:
        """Per head, how many targets the text offers (``None`` unless these targets keep a share of them)."""
        if self.text_labels is None:
            return None
        return (text_tokens(self.text_labels, self.num_heads) != IGNORE_INDEX).sum(dim=(1, 2)).tolist()

    @property
    def num_heads(self) -> int:
        return self.tokens.shape[0]


def shift_labels_for_head(labels: torch.Tensor, k: int) -> torch.Tensor:
    """Targets of head ``k`` aligned with positions: ``out[:, t] = labels[:, t + k + 2]``.

    Args:
        labels: (batch, seq) token at each position, ``IGNORE_INDEX`` where not trained.
        k: 0-based head index.

    Returns:
        A (batch, seq) tensor; positions whose target falls past the end are ``IGNORE_INDEX``.
    """
    shift = k + 2
    out = torch.full_like(labels, IGNORE_INDEX)
    if shift < labels.shape[-1]:
        out[..., :-shift] = labels[..., shift:]
    return out


def text_tokens(labels: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(num_heads, batch, seq): head ``k`` learns the text, ``labels[:, t + k + 2]``."""
    return torch.stack([shift_labels_for_head(labels, k) for k in range(num_heads)])


def greedy_tokens(labels: torch.Tensor, num_heads: int, predictions: torch.Tensor) -> torch.Tensor:
    """(num_heads, batch, seq): what greedy decoding from position ``t`` would emit ``k + 2`` tokens on.

    ``predictions[:, t]`` is the frozen backbone's greedy next token after position ``t``. Head ``k``'s
    target is known from this one forward pass only where the text's next ``k + 1`` tokens are the
    backbone's own greedy choices (so the states it ran on are those of its greedy continuation):
    it is then ``predictions[:, t + k + 1]``, taken only where ``labels[:, t + k + 2]`` is trained. On
    the backbone's own greedy replies almost every position qualifies; on someone else's text fewer
    do, and the targets are still exactly what the heads meet when decoding.
    """
    if predictions.shape != labels.shape:
        raise ValueError(f"predictions {tuple(predictions.shape)} and labels {tuple(labels.shape)} differ")
    greedy = torch.full_like(labels, IGNORE_INDEX)  # aligned like labels: greedy[:, j] = choice for token j
    greedy[:, 1:] = predictions[:, :-1]
    # agrees[:, t]: the text's token t + 1 is the backbone's greedy choice after t (and is trained text).
    agrees = torch.zeros_like(labels, dtype=torch.bool)
    agrees[:, :-1] = (labels[:, 1:] == greedy[:, 1:]) & (labels[:, 1:] != IGNORE_INDEX)
    out, run = [], torch.ones_like(agrees)
    for k in range(num_heads):
        run = run & _shift_left(agrees, k)  # text agrees with greedy at t, ..., t + k
        target = shift_labels_for_head(greedy, k)
        trained = shift_labels_for_head(labels, k) != IGNORE_INDEX
        out.append(torch.where(run & trained, target, IGNORE_INDEX))
    return torch.stack(out)


def text_targets(labels: torch.Tensor, num_heads: int) -> HeadTargets:
    """``loss.targets=text``."""
    return HeadTargets(text_tokens(labels, num_heads))


def greedy_targets(labels: torch.Tensor, num_heads: int, predictions: torch.Tensor) -> HeadTargets:
    """``loss.targets=greedy`` (see ``greedy_tokens``), keeping the text's labels for ``text_counts``."""
    labels = labels.to(predictions.device)
    return HeadTargets(greedy_tokens(labels, num_heads, predictions), text_labels=labels)


def teacher_targets(labels: torch.Tensor, num_heads: int, teacher: Teacher) -> HeadTargets:
    """``loss.targets=teacher``: soft labels at the text's trained positions."""
    return HeadTargets(text_tokens(labels, num_heads), teacher=teacher)


def following_tokens(labels: torch.Tensor, num_heads: int,
                      greedy: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The token after each position that heads reading it are given in training: the text's own
    ``labels[:, t + 1]``, whose continuation the targets are. Where that is not trained text but some
    head has a target (the last prompt token of a turn), the backbone's greedy choice, what decoding
    gives them: ``greedy(mask)`` returns it for the positions of the bool ``mask`` (batch, seq), so the
    LM head runs on those few positions only. Positions no head reads get token 0 (never read by the
    loss). Heads that read their path take these tokens at ``t, ..., t + k``; each of those positions
    is one where a shorter head has the same target, so it already gets its token here. On greedy
    targets the text and the greedy choice agree wherever a head keeps a target.
    """
    tokens = torch.full_like(labels, IGNORE_INDEX)
    tokens[..., :-1] = labels[..., 1:]
    needed = (tokens == IGNORE_INDEX) & (text_tokens(labels, num_heads) != IGNORE_INDEX).any(dim=0)
    if needed.any():
        tokens[needed] = greedy(needed).to(tokens.device)
    return tokens.masked_fill_(tokens == IGNORE_INDEX, 0)


def inputs_and_targets(kind: str, model, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, HeadTargets]:
    """``(what the heads read, what they learn)`` for a batch, by ``loss.targets`` (``kind``).

    Args:
        kind: ``text``, ``greedy`` or ``teacher``.
        model: The ``MedusaModel`` (its LM head gives greedy tokens and teacher distributions).
        hidden: (batch, seq, hidden) the backbone's final hidden states (a teacher reads them detached).
        labels: (batch, seq) the text, ``IGNORE_INDEX`` where not trained.
    """
    if kind not in TARGETS:
        raise ValueError(f"loss.targets={kind!r}: must be one of {', '.join(TARGETS)}")
    n = model.num_heads
    labels = labels.to(hidden.device)
    predictions = model.next_tokens(hidden) if kind == "greedy" else None
    if predictions is not None:
        targets = greedy_targets(labels, n, predictions)
    elif kind == "teacher":
        targets = teacher_targets(labels, n, Teacher(model.base_logits, hidden.detach()))
    else:
        targets = text_targets(labels, n)
    greedy = (lambda mask: predictions[mask]) if predictions is not None else \
        (lambda mask: model.next_tokens(hidden[mask]))
    if model.token_map is not None:
        targets = in_draft_vocabulary(targets, model)
    return model.head_features(hidden, lambda: following_tokens(labels, n, greedy)), targets


def in_draft_vocabulary(targets: HeadTargets, model) -> HeadTargets:
    """``targets`` for heads that score a draft vocabulary: token targets become indices among its tokens
    (a target outside it is dropped: the heads cannot guess it, the verify pass still emits it), and a
    teacher's distribution is the backbone's over those tokens, renormalised (``draft_base_logits``)."""
    tokens = model.head_indices(targets.tokens)
    tokens = tokens.masked_fill_(tokens < 0, IGNORE_INDEX)
    teacher = None if targets.teacher is None else Teacher(model.draft_base_logits, targets.teacher.hidden)
    return HeadTargets(tokens, teacher, targets.text_labels)


def _shift_left(x: torch.Tensor, by: int) -> torch.Tensor:
    """``out[:, t] = x[:, t + by]``, False past the end."""
    if by == 0:
        return x
    out = torch.zeros_like(x)
    if by < x.shape[-1]:
        out[..., :-by] = x[..., by:]
    return out
