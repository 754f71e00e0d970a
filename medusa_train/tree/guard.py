"""The guard before a hybrid tree ships: decode it, the draft alone and the lookup chain alone, and keep it only if
it is faster than both.

The walk (``tree/size.py``) sizes the heads' nodes and the lookup chain from what each accepts on the calibration
text; the step costs it weighs them with are timed at one context. Decoding a few validation prompts with each tree,
interleaved prompt by prompt (so a slow minute of the machine falls on all three), measures what the walk predicts:
tokens per second here. The hybrid is kept only when it beats both alternatives by ``margin``; otherwise the faster
of the two, and within ``margin`` of each other the smaller tree.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from medusa_train.config.budget import budget_spent
from medusa_train.decoding.tree import TokenTree

HYBRID, DRAFT, LOOKUP = "hybrid", "draft alone", "lookup chain alone"


@torch.no_grad()
def decode_rates(model, sequences: Sequence[tuple[torch.Tensor, int]], trees: dict[str, TokenTree],
                 max_new_tokens: int, eos: Sequence[int], progress: bool = True,
                 max_minutes: float | None = None) -> tuple[dict[str, dict], bool, int]:
    """``(per tree {"tokens_per_s", "tokens_per_step", "tokens", "seconds"}, whether every tree wrote the same text
    for every prompt, prompts decoded)``, decoding each prompt of ``sequences`` (its first ``prompt length`` tokens)
    greedy, the trees taking turns first; no prompt starts after ``max_minutes`` of this call (the first always
    does), so every tree decodes the same prompts."""
    from tqdm.auto import tqdm

    from medusa_train.decoding.generate import tree_generate

    started = time.perf_counter()
    names = list(trees)
    totals = {n: {"tokens": 0, "forwards": 0, "replies": 0, "seconds": 0.0} for n in names}
    same, decoded = True, 0
    first_ids = sequences[0][0][:, :sequences[0][1]]
    for n in names:  # one short warm-up each: the first call of a shape pays for allocations
        tree_generate(model, first_ids, trees[n], 8, eos_token_id=list(eos))
    bar = tqdm(sequences, desc="guard: decoding", unit="prompt", disable=not progress)
    for i, (ids, prompt_len) in enumerate(bar):
        if decoded and budget_spent(started, max_minutes):
            break  # the budget spent: the prompts left are not started
        decoded += 1
        texts = set()
        for n in names[i % len(names):] + names[:i % len(names)]:
            out = tree_generate(model, ids[:, :prompt_len], trees[n], max_new_tokens, eos_token_id=list(eos))
            t = totals[n]
            t["tokens"] += out.new_tokens
            t["forwards"] += out.steps
            t["replies"] += 1
            t["seconds"] += out.timings["prefill_s"] + out.timings["decode_s"]
            texts.add(tuple(out.sequences[0, prompt_len:].tolist()))
        same = same and len(texts) == 1
    bar.close()
    rates = {n: {"tokens_per_s": t["tokens"] / max(t["seconds"], 1e-9),
                 "tokens_per_step": (t["tokens"] - t["replies"]) / max(t["forwards"], 1),
                 "tokens": t["tokens"], "seconds": round(t["seconds"], 3)} for n, t in totals.items()}
    return rates, same, decoded


def choose(rates: dict[str, float], nodes: dict[str, int], margin: float) -> tuple[str, str]:
    """``(kept, why)``: the hybrid when its tokens/s beat the draft alone and the lookup chain alone by ``margin``; else the
    faster of those two, the one with fewer nodes when they are within ``margin`` of each other."""
    others = [n for n in rates if n != HYBRID]
    best_other = max(rates[n] for n in others)
    if HYBRID in rates and rates[HYBRID] > best_other * (1 + margin):
        return HYBRID, (f"the hybrid's {rates[HYBRID]:.1f} tokens/s beat the better alternative's {best_other:.1f} by "
                        f"more than {margin:.0%}")
    close = [n for n in others if rates[n] >= best_other / (1 + margin)]
    kept = min(close, key=lambda n: (nodes[n], -rates[n]))
    why = (f"the hybrid's {rates[HYBRID]:.1f} tokens/s did not beat {best_other:.1f} by {margin:.0%}; "
           if HYBRID in rates else "")
    why += f"{kept}: {rates[kept]:.1f} tokens/s" + (f", within {margin:.0%} of the best and smaller" if len(close) > 1
                                                    else "")
    return kept, why
