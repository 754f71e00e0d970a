"""The decoder's walk along a text: what greedy decoding accepts step by step, measured without decoding.

At each position of a text (the backbone's own greedy continuation of a prompt) the draft is asked as the decoder asks
it (its scores at every depth, ``calibration_scores``): ``measure_ranks`` records where the true token ranks among its
guesses. A tree's step at a position accepts the longest path whose guesses are the text's tokens (``heads_depths``;
beside it a lookup chain's run, ``tree.calibrate.lookup_runs``), and the next step starts after them (``walked_steps``). Tokens per step
counts as every decoder row does (``evaluation/summary.py``): tokens after each reply's first per forward after its
prefill, the reply's last step included. For a K-chain this is what vLLM accepts serving the draft with
``num_speculative_tokens=K``; for any tree, what our decoder accepts (greedy, the same dtype: rounding aside, the same
text). Training's validation (``training/validation_walk.py``), build-tree's calibration and expectation (``tree/``) and
the GPU check walk with these functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


@torch.no_grad()
def measure_ranks(model, sequences: Sequence[tuple[torch.Tensor, int]], top_k: int = 10,
                  states: Sequence[torch.Tensor] | None = None) -> list[list[list[int]]]:
    """Per sequence, per head (draft depth), the rank of the true token among the head's guesses at each position
    from the last prompt token on (``top_k``: not among its first ``top_k``; ``top_k + 1``: a token outside the
    draft's vocabulary, never guessed): position j of every head is the same place in the text (head k's list is k
    tokens shorter: the text ends). ``states``: per sequence, what the draft's capture stores (no backbone run)."""
    ranks = []
    for i, (ids, prompt_len) in enumerate(sequences):
        by_head = [[] for _ in range(model.config.depth)]
        # the model says what its draft scores at each depth along the text, and which output is the true token
        for k, logits, targets in model.calibration_scores(ids, prompt_len - 1, None if states is None else states[i]):
            target_logits = logits.gather(-1, targets.clamp(min=0)[:, None])
            rank = (logits > target_logits).sum(-1).clamp_(max=top_k)
            by_head[k] = rank.masked_fill_(targets < 0, outside_draft_vocab_rank(top_k)).tolist()
        ranks.append(by_head)
    return ranks


def outside_draft_vocab_rank(top_k: int) -> int:
    """The rank ``measure_ranks`` gives a true token the draft cannot guess (outside its draft vocabulary)."""
    return top_k + 1


def rank_accuracies_from(ranks: Sequence[Sequence[Sequence[int]]], num_heads: int,
                         top_k: int) -> tuple[list[list[float]], list[int]]:
    """``(rank_accuracies [num_heads][top_k], positions per head)`` from ``measure_ranks``' ranks."""
    hits = [[0] * top_k for _ in range(num_heads)]
    counts = [0] * num_heads
    for by_head in ranks:
        for k, row in enumerate(by_head):
            counts[k] += len(row)
            for r in row:
                if r < top_k:
                    hits[k][r] += 1
    return [[hits[k][i] / counts[k] if counts[k] else 0.0 for i in range(top_k)] for k in range(num_heads)], counts


def heads_depths(ranks: Sequence[Sequence[Sequence[int]]], choices: Sequence[Sequence[int]]) -> list[list[int]]:
    """Per sequence and position, how deep the heads' guesses in ``choices`` are accepted (greedy, the text's
    own continuation): the longest prefix of the true tokens' ranks that is a path of the tree."""
    paths = {tuple(c) for c in choices}
    depths = []
    for by_head in ranks:
        row = []
        for j in range(len(by_head[0]) if by_head else 0):
            d = 0
            while d < len(by_head) and j < len(by_head[d]) and tuple(by_head[k][j] for k in range(d + 1)) in paths:
                d += 1
            row.append(d)
        depths.append(row)
    return depths


def walked_steps(depths: Sequence[int], runs: Sequence[int] = (), lookup_depth: int = 0) -> list[int]:
    """The tokens each greedy decode step adds when it writes one calibration text again: the first step sits at
    the first position (the last prompt token's), each takes 1 + the longer of the heads' depth there
    (``heads_depths``) and the lookup chain's run there capped at ``lookup_depth`` (``lookup_runs``), but never more
    than the text has left after that position (``len(depths) - j``: the step's own token past the text's end is one
    the decoder never writes), and the next starts after the tokens it added. The steps add up to the text's tokens
    after its first, as the decoder's rows count (``evaluation/summary.py``)."""
    steps, j = [], 0
    while j < len(depths):
        steps.append(min(1 + max(depths[j], min(runs[j], lookup_depth) if j < len(runs) else 0), len(depths) - j))
        j += steps[-1]
    return steps


def tokens_per_step(depths: Sequence[Sequence[int]], runs: Sequence[Sequence[int]] | None = None,
                    lookup_depth: int = 0) -> float:
    """Tokens per decode step over every calibration text, walked step by step (``walked_steps``).

    A loop's positions count as the decoder meets them: a step that copies 8 tokens passes over 8 positions, which
    an average over positions (``lookup_gains``) counts as 8 steps that long, promising several times what comes
    when the text loops only in parts."""
    steps = [n for k, row in enumerate(depths) for n in walked_steps(row, runs[k] if runs else (), lookup_depth)]
    return sum(steps) / len(steps) if steps else 1.0


def chain_choices(k: int) -> list[list[int]]:
    """The K-chain: the draft's top guess at each of the first ``k`` depths."""
    return [[0] * d for d in range(1, k + 1)]


def truncated_choices(listed: Sequence[Sequence[int]], max_nodes: float, max_depth: int | None = None
                      ) -> list[tuple[int, ...]]:
    """The paths of a tree cut to ``max_nodes`` nodes besides the root and to ``max_depth``: taken in their listed
    order (most likely first for the built-in trees); a path whose prefix is not yet in brings that prefix in first,
    so the result is always a tree (``TokenTree.truncated``)."""
    kept: dict[tuple[int, ...], None] = {}
    for path in map(tuple, listed):
        if max_depth is not None and len(path) > max_depth:
            continue
        missing = [path[:d] for d in range(1, len(path) + 1) if path[:d] not in kept]
        if len(kept) + len(missing) > max_nodes:
            continue
        kept.update(dict.fromkeys(missing))
    return list(kept)


def fixed_tree_choices(nodes: int, depth: int, top_k: int, name: str = "default") -> list[list[int]]:
    """The built-in tree ``name`` (``configs/tree/<name>.yaml``) cut to ``nodes`` (root included) and to the draft's
    ``depth``, ranks below ``top_k``: the fixed tree training's validation walks."""
    import yaml  # a hydra-core dependency

    from medusa_train.config.paths import TREE_DIR

    listed = yaml.safe_load((TREE_DIR / f"{name}.yaml").read_text())["choices"]
    return [list(c) for c in truncated_choices(listed, nodes - 1, depth) if max(c) < top_k]


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


