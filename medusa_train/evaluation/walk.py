"""What decoding will accept, measured before decoding: the draft walked along the validation continuations.

At each position of the backbone's own greedy continuation the draft is asked as the decoder asks it (its scores at
every depth, ``calibration_scores``), and each decode step is walked as greedy decoding takes it: the step at a
position accepts the longest path of the tree whose guesses are the text's tokens, and the next step starts after
them (``tree/calibrate.py``: ``heads_depths``, ``walked_steps``). Tokens per step counts as every decoder row does
(``evaluation/summary.py``): tokens after each reply's first per forward after its prefill, the reply's last step
included. For a K-chain this is what vLLM accepts serving the draft with ``num_speculative_tokens=K`` where it serves
the draft; for any tree, what our decoder accepts (greedy, the same dtype: rounding aside, the same text).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from medusa_train.tree.calibrate import (
    heads_depths,
    measure_ranks,
    outside_draft_vocab_rank,
    rank_accuracies_from,
    tokens_per_step,
)


def chain_choices(k: int) -> list[list[int]]:
    """The K-chain: the draft's top guess at each of the first ``k`` depths."""
    return [[0] * d for d in range(1, k + 1)]


def fixed_tree_choices(nodes: int, depth: int, top_k: int) -> list[list[int]]:
    """The built-in default tree cut to ``nodes`` (root included) and to the draft's ``depth``, ranks below ``top_k``."""
    from medusa_train.decoding.tree import MedusaTree

    tree = MedusaTree.from_name("default").truncated(max_nodes=nodes, max_depth=depth)
    return [list(c) for c in tree.choices if max(c) < top_k]


@torch.no_grad()
def walk_figures(model, sequences: Sequence[tuple[torch.Tensor, int]], states: Sequence[torch.Tensor] | None = None,
                 chains: Sequence[int] = (1, 2, 3, 4), tree_choices: Sequence[Sequence[int]] | None = None,
                 top_k: int = 10) -> dict:
    """``{"chain{K}": tokens per step, "tree": ..., "top1_teacher_forced": [per depth], "outside_draft_vocab": share,
    "positions": n}`` of ``model``'s draft over ``sequences`` (``(ids (1, len), prompt length)``); chains longer than
    the depths the draft is measured at (``model.config.depth``) are left out."""
    ranks = measure_ranks(model, sequences, top_k, states)
    depth = model.config.depth
    figures = {f"chain{k}": tokens_per_step(heads_depths(ranks, chain_choices(k))) for k in chains if k <= depth}
    if tree_choices:
        figures["tree"] = tokens_per_step(heads_depths(ranks, tree_choices))
    accuracies, counts = rank_accuracies_from(ranks, depth, top_k)
    outside = sum(r == outside_draft_vocab_rank(top_k) for by_head in ranks for r in by_head[0])
    figures.update(top1_teacher_forced=[row[0] for row in accuracies], positions=counts[0],
                   outside_draft_vocab=outside / counts[0] if counts[0] else 0.0)
    return figures


def walk_line(figures: dict, tree_nodes: int | None = None) -> str:
    """One log line of ``walk_figures``."""
    chains = ", ".join(f"K={k.removeprefix('chain')} {v:.3f}" for k, v in figures.items() if k.startswith("chain"))
    tree = f"; {tree_nodes}-node tree {figures['tree']:.3f}" if "tree" in figures else ""
    top1 = " ".join(f"{a:.3f}" for a in figures["top1_teacher_forced"])
    return (f"tokens per step {chains}{tree}; teacher-forced top-1 by depth {top1} (tokens outside the draft "
            f"vocabulary counted as misses: {figures['outside_draft_vocab']:.1%} of {figures['positions']:,} positions)")
