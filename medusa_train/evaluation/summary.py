"""The report's figures from per-prompt records: one accepted length, one speedup, for every decoder alike.

**Tokens per forward** (the report's ``mean_accepted_length`` and every method's ``tokens_per_forward``):
tokens after each reply's first, per target forward after that reply's prefill, summed over replies.
The prefill makes a reply's first token whatever the decoder, so it is left out of both counts:
plain decoding scores exactly 1.00, and a decoder that verifies drafts scores the tokens each of its
forwards adds. The same count is made of a served engine (``evaluation.served``), so rows compare.
Every prediction counts the same way: the walk of training's validation and build-tree's expectation
(``model/walk.py``) give tokens after each reply's first per forward, the reply's last step included, so
evaluate's ``expected`` sits beside ``mean_accepted_length`` as like beside like. ``tokens_per_verify_step`` (1 + the
drafts each verify step accepted) is kept, labelled, as a diagnostic of the steps alone.

**Speedup**: a method's tokens/s over HF ``generate`` greedy (the ``plain`` row) in the same process,
measured prompt by prompt in turn with the others (wall clock, prefill + decode; ``decode_speedup``:
decode time only, tokens after the first).
"""

from __future__ import annotations

import statistics
from collections import Counter

#: in-process methods: record-key prefix, what the row decodes with ({draft}: what proposes the tree's tokens, its
#: config's ``draft_name``: the heads, or an EAGLE-3 draft)
DECODE_ROWS = {
    "plain": "HF transformers generate, greedy (one token per forward)",
    "prompt_lookup": "HF transformers generate with prompt lookup (drafts copied from the context; no training)",
    "plain_graphed": "medusa-train decoder, the root alone (one token per forward, greedy) over a static cache, each "
                     "step replayed from a CUDA graph: plain decoding as a server steps",
    "draft_only": "medusa-train tree decoder, the tree's nodes from {draft} alone (no lookup chain)",
    "lookup_chain": "medusa-train tree decoder, the tree's lookup chain alone (no {draft}; no training)",
    "draft": "medusa-train tree decoder with {draft}",
}
#: the rows that decode one token per forward: speedups divide by the faster of them (``plain_reference``)
PLAIN_ROWS = ("plain", "plain_graphed")
#: the draft row's description when its tree has a lookup chain
HYBRID = "medusa-train tree decoder with {draft} and the lookup chain in one tree"


def per_forward(tokens: int, replies: int, forwards_after_prefill: int) -> float | None:
    """Tokens after each reply's first per target forward after its prefill (``None`` without forwards)."""
    return (tokens - replies) / forwards_after_prefill if forwards_after_prefill > 0 else None


def _method_counts(records: list[dict], method: str) -> dict | None:
    """Tokens, forwards after the prefill and times of one method over ``records`` (None if it did not run)."""
    if method == "draft":
        return {"tokens": sum(r["new_tokens"] for r in records), "forwards": sum(r["steps"] for r in records),
                "wall_s": sum(r["draft_s"]["wall_s"] for r in records),
                "decode_s": sum(r["draft_s"]["decode_s"] for r in records)}
    if method in ("draft_only", "lookup_chain"):
        if any(method not in r for r in records):
            return None
        return {k: sum(r[method][f] for r in records)
                for k, f in (("tokens", "new_tokens"), ("forwards", "steps"), ("wall_s", "wall_s"),
                             ("decode_s", "decode_s"))}
    if any(r.get(f"{method}_s") is None for r in records):
        return None
    return {"tokens": sum(r[f"{method}_new_tokens"] for r in records),
            "forwards": sum(r[f"{method}_s"]["forwards"] - 1 for r in records),
            "wall_s": sum(r[f"{method}_s"]["wall_s"] for r in records),
            "decode_s": sum(r[f"{method}_s"]["decode_s"] for r in records)}


def method_rows(records: list[dict], draft: str = "the heads") -> dict[str, dict]:
    """``{method: {decodes_with, tokens_per_forward, tokens_per_s, decode_tokens_per_s, speedup, decode_speedup,
    outputs}}`` for the methods that ran; speedups over the ``plain`` row, outputs compared with it (greedy);
    ``draft`` names what proposes the tree's tokens in the descriptions."""
    n = len(records)
    rows = {}
    for method, what in DECODE_ROWS.items():
        c = _method_counts(records, method)
        if c is None:
            continue
        if method == "draft" and _has_lookup_chain(records):
            what = HYBRID
        rows[method] = {"decodes_with": what.format(draft=draft), "tokens_per_forward": per_forward(c["tokens"], n, c["forwards"]),
                        "tokens": c["tokens"], "forwards_after_prefill": c["forwards"],
                        "tokens_per_s": c["tokens"] / max(c["wall_s"], 1e-9),
                        "decode_tokens_per_s": (c["tokens"] - n) / max(c["decode_s"], 1e-9)}
    plain = rows[plain_reference(rows)]
    for method, row in rows.items():
        row["speedup"] = row["tokens_per_s"] / max(plain["tokens_per_s"], 1e-9)
        row["decode_speedup"] = row["decode_tokens_per_s"] / max(plain["decode_tokens_per_s"], 1e-9)
        if method in ("draft_only", "lookup_chain"):
            checked = [r[method]["match"] for r in records if r[method]["match"] is not None]
        else:
            match_key = {"plain": None, "prompt_lookup": "prompt_lookup_match", "plain_graphed": "plain_graphed_match",
                         "draft": "match"}[method]
            checked = [r[match_key] for r in records if match_key and r.get(match_key) is not None]
        row["outputs"] = {"compared": len(checked), "identical": sum(checked)} if checked else None
    return rows


def plain_reference(rows: dict[str, dict]) -> str:
    """The plain decoding every speedup divides by: the faster of HF ``generate`` (``plain``) and, where it ran, the
    graphed plain row (``plain_graphed``)."""
    return max((m for m in PLAIN_ROWS if m in rows), key=lambda m: rows[m]["tokens_per_s"])


#: a prompt whose plain step took more than this many times the plain row's median step: timed while disturbed
UNSTEADY = 1.5


def plain_steadiness(records: list[dict], method: str) -> dict | None:
    """Milliseconds a decode step of the plain row ``method`` took, prompt by prompt: a plain step costs about the
    same on every prompt, so a prompt whose step took over ``UNSTEADY`` x the median was timed while something else
    held the machine (on an H200 the first evaluation in a process stepped 7x slower on 2 of 8 prompts, 2026-12-01),
    and every speedup divided by that row is too high. ``{method, median_ms, slowest_ms, unsteady: [{id, turn, ms}],
    replies}`` over the replies with decode steps (a reply of one token has none); None when the row did not run."""
    key = f"{method}_s"
    if not records or any(r.get(key) is None for r in records):
        return None
    steps = [(r, r[key]["decode_s"] * 1e3 / (r[key]["forwards"] - 1)) for r in records if r[key]["forwards"] >= 2]
    if not steps:
        return None
    median = statistics.median(ms for _, ms in steps)
    return {"method": method, "median_ms": median, "slowest_ms": max(ms for _, ms in steps), "replies": len(steps),
            "unsteady": [{"id": r["id"], "turn": r["turn"], "ms": ms} for r, ms in steps if ms > UNSTEADY * median]}


def verify_step_tokens(records: list[dict]) -> float:
    """1 + the drafts each verify step accepted, averaged over the steps of ``records`` (a diagnostic; predictions
    are of tokens per forward)."""
    depths = [d for r in records for d in r["accepted_depths"]]
    return sum(1 + d for d in depths) / max(len(depths), 1)


def _totals(records: list[dict], rows: dict[str, dict] | None = None) -> dict:
    """Accepted length, tokens/s and speedups of a group of per-prompt records (``rows``: their ``method_rows``,
    when already computed)."""
    rows = rows or method_rows(records)
    draft, plain = rows["draft"], rows[plain_reference(rows)]
    tokens, steps, n = draft["tokens"], draft["forwards_after_prefill"], len(records)
    checked = [r for r in records if r["match"] is not None]
    totals = {
        "count": n, "accepted_length": per_forward(tokens, n, steps) or 0.0,
        "tokens_per_verify_step": verify_step_tokens(records), "speedup": draft["speedup"],
        "decode_speedup": draft["decode_speedup"],
        "tokens_per_s": {"draft": draft["tokens_per_s"], "plain": plain["tokens_per_s"]},
        "decode_tokens_per_s": {"draft": draft["decode_tokens_per_s"], "plain": plain["decode_tokens_per_s"]},
        "mismatches": sum(not r["match"] for r in checked) if checked else None,
        "mismatches_unexplained": sum(bool(r["mismatch"]) and r["mismatch"]["kind"] == "unexplained"
                                      for r in checked) if checked else None,
        "mismatches_at_rounding": sum(bool(r["mismatch"]) and r["mismatch"]["kind"] == "at_rounding"
                                      for r in checked) if checked else None,
        "new_tokens": {"draft": tokens, "plain": plain["tokens"]}, "steps": steps,
    }
    for method in ("prompt_lookup", "draft_only", "lookup_chain"):
        if method in rows:
            totals[f"{method}_speedup"] = rows[method]["speedup"]
            totals[f"{method}_tokens_per_forward"] = rows[method]["tokens_per_forward"]
    return totals


def summarise(records: list[dict], num_heads: int, draft: str = "the heads") -> dict:
    """The report's headline numbers from per-prompt records (``num_heads``: the heads the tree reaches;
    ``draft``: what proposes the tree's tokens, for the rows' descriptions).

    Returns:
        ``mean_accepted_length`` (tokens per forward, see the module docstring), ``tokens_per_verify_step``,
        ``speedup`` and ``decode_speedup`` (the heads over the faster plain decoding, ``plain_reference``: HF
        ``generate`` greedy, or the graphed plain row where it ran and was faster), ``tokens_per_s`` and
        ``decode_tokens_per_s`` ({draft, plain}), ``methods`` (every in-process decoder's row, see
        ``method_rows``), ``plain_steadiness`` (the plain reference's step prompt by prompt: ``plain_steadiness``),
        ``mismatches`` (greedy outputs differing from plain decoding; ``None`` when
        sampling), split into ``mismatches_unexplained`` (must be 0) and ``mismatches_at_rounding`` (see
        ``mismatch_detail``), with ``mismatch_details``, ``per_head_acceptance``, ``accept_length_histogram``
        ({tokens per verify step: steps}), ``per_category`` ({category: count, accepted_length, speedup, ...})
        and ``totals``.
    """
    methods = method_rows(records, draft)
    overall = _totals(records, methods)
    steps = max(overall["steps"], 1)
    depths = [d for r in records for d in r["accepted_depths"]]
    categories = sorted({r["category"] for r in records})
    return {
        "mean_accepted_length": overall["accepted_length"],
        "tokens_per_verify_step": overall["tokens_per_verify_step"],
        "speedup": overall["speedup"],
        "decode_speedup": overall["decode_speedup"],
        "tokens_per_s": overall["tokens_per_s"],
        "decode_tokens_per_s": overall["decode_tokens_per_s"],
        "methods": methods,
        "plain_reference": plain_reference(methods),
        "plain_steadiness": plain_steadiness(records, plain_reference(methods)),
        "mismatches": overall["mismatches"],
        "mismatches_unexplained": overall["mismatches_unexplained"],
        "mismatches_at_rounding": overall["mismatches_at_rounding"],
        "mismatch_details": [{"id": r["id"], "category": r["category"], "turn": r["turn"], **r["mismatch"]}
                             for r in records if r["mismatch"]],
        "per_head_acceptance": [sum(d > k for d in depths) / steps for k in range(num_heads)],
        # with a lookup chain: per chain index, the fraction of steps that kept the chain that far
        "lookup_acceptance": _lookup_acceptance(records, steps),
        "accept_length_histogram": dict(sorted(Counter(n for r in records for n in r["accept_lengths"]).items())),
        "per_category": {c: _totals([r for r in records if r["category"] == c]) for c in categories},
        "totals": {k: overall[k] for k in ("count", "new_tokens", "steps")},
    }


def _has_lookup_chain(records: list[dict]) -> bool:
    """Whether the tree decoded had a lookup chain (its records say how many nodes; older ones: a branch row)."""
    return any(r.get("lookup_nodes") or "draft_only" in r for r in records)


def _lookup_acceptance(records: list[dict], steps: int) -> list[float] | None:
    """Per lookup chain index i, the fraction of verify steps that kept the chain's first i + 1 tokens (``None``:
    no lookup chain); these steps' tokens are the chain's, not the heads' (``per_head_acceptance``)."""
    if not _has_lookup_chain(records):
        return None
    depths = [d for r in records for d in r["lookup_depths"]]
    deepest = max(depths, default=0)
    return [sum(d > i for d in depths) / steps for i in range(deepest)]
