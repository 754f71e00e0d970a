"""Whether two decodings of the same input agree, and, where they part, whether rounding explains it.

Greedy Medusa decoding must reproduce plain decoding token for token; a served engine with speculation
must reproduce itself without. Each difference is located (``first_difference``) and classified by the
base model's logits there (``mismatch_detail``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where ``a`` and ``b`` differ (a length difference counts); ``None`` if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def mismatch_detail(model, input_ids: torch.Tensor, plain: list[int], drafted: list[int], position: int,
                    stop_ids: Sequence[int] = ()) -> dict:
    """The base model's view of the first differing position, and whether rounding explains the difference.

    The logits come from one teacher-forced pass (in the model's dtype) over the prompt and the plain
    tokens before ``position``. The tree pass sums attention over other keys than one-token decoding,
    so in a low-precision dtype the two may round differently: that explains a difference only where
    both tokens' logits are within ``rounding_tolerance`` of the best one (``kind: "at_rounding"``).
    Anything else, and every difference in float32, is ``"unexplained"``: a bug.
    """
    context = torch.cat([input_ids[0], torch.tensor(plain[:position], dtype=input_ids.dtype,
                                                    device=input_ids.device)])
    hidden = model(context[None]).hidden_states[0, -1]
    return classify_at(model.base_logits(hidden), plain, drafted, position, stop_ids)


def classify_at(raw: torch.Tensor, plain: Sequence[int], drafted: Sequence[int], position: int,
                stop_ids: Sequence[int] = ()) -> dict:
    """``mismatch_detail`` from the base model's next-token logits ``raw`` (in the dtype they were computed in) after
    the prompt and ``plain[:position]``: both tokens within ``rounding_tolerance`` of the best logit is a
    difference rounding explains (``kind: "at_rounding"``), anything else ``"unexplained"``. A reply that ended at
    ``position`` (replies given without their stop token, as a server returns them) chose a stop token there: the
    likeliest of ``stop_ids`` (none given: no token, unexplained)."""
    logits = raw.float()
    top = logits.topk(2)
    stop = max(stop_ids, key=lambda t: logits[t].item()) if stop_ids else None
    plain_token = plain[position] if position < len(plain) else stop
    draft_token = drafted[position] if position < len(drafted) else stop
    diff = (logits[plain_token] - logits[draft_token]).item() \
        if plain_token is not None and draft_token is not None else None
    tolerance = rounding_tolerance(logits, raw.dtype)
    gaps = [top.values[0].item() - logits[t].item() for t in (plain_token, draft_token) if t is not None]
    explained = plain_token is not None and draft_token is not None and max(gaps) <= tolerance
    return {"position": position, "plain_token": plain_token, "draft_token": draft_token,
            "top2_gap": (top.values[0] - top.values[1]).item(), "plain_minus_draft_logit": diff,
            "tolerance": tolerance, "kind": "at_rounding" if explained else "unexplained"}


#: what a served row keeps of a difference's classification (``brief``)
BRIEF = ("kind", "top2_gap", "tolerance", "plain_token", "draft_token")


def brief(detail: dict) -> dict:
    """The part of ``classify_at``'s detail a served row keeps beside the position ``compare_outputs`` records."""
    return {k: detail[k] for k in BRIEF}


def rounding_tolerance(logits: torch.Tensor, dtype: torch.dtype) -> float:
    """How far apart two logits computed in ``dtype`` by differently ordered sums can land: two spacings of
    ``dtype`` at the largest logit's magnitude (``2 eps max|logit|``; 0 in float32 and float64, where the
    tree pass must reproduce one-token decoding exactly)."""
    if dtype in (torch.float32, torch.float64):
        return 0.0
    return 2 * torch.finfo(dtype).eps * logits.abs().max().item()


def compare_outputs(plain: Sequence[list[int] | None], speculated: Sequence[list[int] | None], classify=None) -> dict:
    """Greedy replies with and without speculation: identical, or where and why they part."""
    details = []
    for i, (a, b) in enumerate(zip(plain, speculated)):
        if a is None or b is None:
            continue
        position = first_difference(a, b)
        if position is not None:
            detail = {"index": i, "position": position}
            if classify is not None:
                detail.update(classify(i, a, b, position))
            details.append(detail)
    kinds = [d.get("kind") for d in details]
    return {"compared": sum(a is not None and b is not None for a, b in zip(plain, speculated)),
            "identical": sum(a is not None and a == b for a, b in zip(plain, speculated)),
            "at_rounding": kinds.count("at_rounding"), "unexplained": kinds.count("unexplained"),
            "details": details}
