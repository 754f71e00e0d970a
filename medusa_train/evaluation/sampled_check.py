"""Whether sampled replies come from the backbone's distribution: scored under the backbone, not just timed.

Sampled replies differ from one server to the next even when both are right, so they cannot be compared
token by token. What a correct sampler almost never does is pick a token the backbone gives a tiny
probability at the sampling temperature; a speculative sampler that lets a rejected draft (or a token
from the wrong distribution) through does it every time that happens. So every reply token is scored under
the backbone, ``softmax(logits / T)`` over the prompt and the reply before it, and the tokens below
``threshold`` are counted. A correct sampler picks such a token at each position with probability equal to
that position's *tail mass* (the summed probability of the tokens below ``threshold``), so the count is
expected to be the sum of the tail masses, with the variance of a sum of independent Bernoulli draws.
A reply set whose count exceeds that expectation by more than ``Z_LIMIT`` standard deviations (and by
more than ``SLACK`` tokens, so one rare draw flags nothing) is flagged as incorrect; so is one whose share
exceeds the share of the server without speculation on the same prompts and seeds by as much
(``against_plain``). A stray token the backbone finds plausible (above the threshold) is not caught.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

Z_LIMIT = 4.0
SLACK = 2


@torch.no_grad()
def score_replies(model, inputs: Sequence[torch.Tensor], replies: Sequence[Sequence[int] | None], temperature: float,
                  threshold: float) -> dict:
    """Count the reply tokens below ``threshold`` under the backbone at ``temperature``, and the count expected.

    Args:
        model: A ``MedusaModel`` (its backbone scores; ``base_logits`` gives the LM head's logits).
        inputs: (1, len) prompt ids of each reply, as the replies were asked (same tokenisation).
        replies: Each reply's token ids (``None``: skipped).
        temperature: The sampling temperature (> 0).
        threshold: The probability below which a token is suspect.

    Returns:
        ``{"tokens", "below", "expected_below", "std", "share_below", "expected_share", "z", "flagged",
        "threshold", "temperature", "replies"}``.
    """
    tokens = below = 0
    expected = variance = 0.0
    scored = 0
    for input_ids, reply in zip(inputs, replies):
        if not reply:
            continue
        device = input_ids.device
        ids = torch.cat([input_ids[0], torch.tensor(list(reply), dtype=input_ids.dtype, device=device)])
        hidden = model(ids[None]).hidden_states[0, input_ids.shape[1] - 1: -1]  # the positions predicting the reply
        probs = torch.softmax(model.base_logits(hidden).float() / temperature, dim=-1)
        chosen = probs.gather(-1, ids[input_ids.shape[1]:, None].to(probs.device))[:, 0]
        tail = probs.masked_fill(probs >= threshold, 0.0).sum(-1)
        tokens += len(reply)
        below += int((chosen < threshold).sum())
        expected += float(tail.sum())
        variance += float((tail * (1 - tail)).sum())
        scored += 1
    return verdict(tokens, below, expected, variance, threshold, temperature, scored)


def verdict(tokens: int, below: int, expected: float, variance: float, threshold: float, temperature: float,
            replies: int) -> dict:
    """The check's figures and whether ``below`` is more than chance allows (see the module docstring)."""
    std = math.sqrt(variance)
    excess = below - expected
    z = excess / std if std > 0 else (math.inf if excess > 0 else 0.0)
    return {"tokens": tokens, "below": below, "expected_below": expected, "std": std,
            "share_below": below / tokens if tokens else None, "expected_share": expected / tokens if tokens else None,
            "z": z, "flagged": excess > max(Z_LIMIT * std, SLACK), "threshold": threshold,
            "temperature": temperature, "replies": replies}


def describe(check: dict) -> str:
    """``"incorrect: 12.5% of 3,072 tokens below 1e-04 (0.1% expected)"`` or ``"correct: ..."``."""
    share = "n/a" if check["share_below"] is None else f"{check['share_below']:.1%}"
    expected = "n/a" if check["expected_share"] is None else f"{check['expected_share']:.1%}"
    word = "incorrect" if check["flagged"] else "consistent with the backbone"
    plain = check.get("plain_share_below")
    beside = f", {plain:.1%} from the server without speculation" if plain is not None else ""
    return (f"{word}: {share} of {check['tokens']:,} reply tokens below p={check['threshold']:g} at "
            f"T={check['temperature']:g} ({expected} expected from a correct sampler{beside})")


def against_plain(check: dict, plain: dict) -> dict:
    """``check``'s share of tokens below the threshold against the plain server's (a two-proportion test).

    Returns:
        ``{"plain_share_below", "z_against_plain", "flagged_against_plain"}``.
    """
    n1, n0, b1, b0 = check["tokens"], plain["tokens"], check["below"], plain["below"]
    if not n1 or not n0:
        return {"plain_share_below": plain["share_below"], "z_against_plain": None, "flagged_against_plain": False}
    pooled = (b1 + b0) / (n1 + n0)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n0))
    z = (b1 / n1 - b0 / n0) / se if se > 0 else 0.0
    return {"plain_share_below": b0 / n0, "z_against_plain": z,
            "flagged_against_plain": z > Z_LIMIT and b1 - n1 * b0 / n0 > SLACK}
