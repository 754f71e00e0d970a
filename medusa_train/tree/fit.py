"""Fitting a tree to the heads: the ``num_nodes`` paths most likely to be accepted, given per-head,
per-rank accuracies (measured by ``tree/calibrate.py``, or assumed), and the expected accepted
length of any tree under those accuracies."""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence

# Assumed probability that head d's rank-k guess is right (top-1 per head: Medusa's 7B heads at the
# end of training; lower ranks decay as top1 * 0.15 / k, which puts head 1's top-5 near 0.73 and its
# top-10 near 0.8, as in the Medusa paper). Used to shape the built-in ``default`` tree.
ASSUMED_TOP1 = (0.56, 0.32, 0.20, 0.15)
ASSUMED_RANKS = 10


def assumed_rank_accuracies(top1: Sequence[float] = ASSUMED_TOP1, ranks: int = ASSUMED_RANKS) -> list[list[float]]:
    """Per-head, per-rank hit probabilities with a ``top1 * 0.15 / k`` decay below the top-1 guess."""
    return [[p if k == 0 else p * 0.15 / k for k in range(ranks)] for p in top1]



def build_tree(rank_accuracies: Sequence[Sequence[float]], num_nodes: int) -> list[list[int]]:
    """The ``num_nodes``-node tree (root included) with the largest expected accept length.

    Treating heads as independent, a path's chance of being accepted is the product of its
    heads' rank accuracies, and the expected accept length of a tree is 1 + the sum of its paths'
    chances. Every extension lowers a path's chance, so taking the most likely paths first keeps
    every prefix in the tree: shallow depths get the most branching.

    Args:
        rank_accuracies: ``[head][rank]`` probability that the head's rank-th guess is right.
        num_nodes: Size of the tree, root included.

    Returns:
        The choices, most likely first.
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes={num_nodes}: must be >= 1 (the root)")
    chosen: list[list[int]] = []
    # max-heap of (-log chance, path); extensions of a chosen path join as they become reachable
    heap = [(-math.log(acc), (k,)) for k, acc in enumerate(rank_accuracies[0] if rank_accuracies else []) if acc > 0]
    heapq.heapify(heap)
    while heap and len(chosen) < num_nodes - 1:
        cost, path = heapq.heappop(heap)
        chosen.append(list(path))
        depth = len(path)
        if depth < len(rank_accuracies):
            for k, acc in enumerate(rank_accuracies[depth]):
                if acc > 0:
                    heapq.heappush(heap, (cost - math.log(acc), (*path, k)))
    return chosen


def expected_accept_length(choices: Iterable[Sequence[int]], rank_accuracies: Sequence[Sequence[float]]) -> float:
    """1 + the sum over paths of the product of their rank accuracies (heads taken as independent)."""
    return 1.0 + sum(math.prod(rank_accuracies[d][k] for d, k in enumerate(p)) for p in choices)
