"""The product chooses by measurement: a hybrid tree ships only when decoding shows it beating the draft alone and
the lookup chain alone, and where extra nodes are dear the size chosen is the root, never a tree that loses."""

from __future__ import annotations

import random

import torch

from medusa_train.config.build_tree import BuildTreeConfig
from medusa_train.tree import size
from medusa_train.tree.cost import CostCurve
from medusa_train.tree.guard import DRAFT, HYBRID, LOOKUP, choose

NODES = {HYBRID: 12, DRAFT: 12, LOOKUP: 6}


def test_the_hybrid_is_kept_only_when_it_beats_both_alternatives_by_the_margin():
    assert choose({HYBRID: 110.0, DRAFT: 100.0, LOOKUP: 90.0}, NODES, 0.03)[0] == HYBRID
    kept, why = choose({HYBRID: 102.0, DRAFT: 100.0, LOOKUP: 90.0}, NODES, 0.03)  # within the margin: not kept
    assert kept == DRAFT and "did not beat" in why
    assert choose({HYBRID: 80.0, DRAFT: 70.0, LOOKUP: 95.0}, NODES, 0.03)[0] == LOOKUP  # the hybrid lost: never it


def test_within_the_margin_the_smaller_tree_wins():
    kept, why = choose({HYBRID: 90.0, DRAFT: 100.0, LOOKUP: 98.5}, NODES, 0.03)
    assert kept == LOOKUP and "smaller" in why  # 6 nodes against 12, 1.5% slower
    assert choose({HYBRID: 90.0, DRAFT: 100.0, LOOKUP: 95.0}, NODES, 0.03)[0] == DRAFT  # 5% slower: not a tie


def looping_texts(n: int, length: int, seed: int = 0) -> list[tuple[torch.Tensor, int]]:
    """Texts that repeat a phrase: the lookup chain copies them well (a hybrid would look attractive)."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        phrase = [rng.randrange(100, 200) for _ in range(6)]
        prompt = [rng.randrange(100, 200) for _ in range(12)]
        texts.append((torch.tensor([prompt + (phrase * length)[:length]]), len(prompt)))
    return texts


def test_where_extra_nodes_are_dear_the_size_chosen_is_the_root_never_a_tree_that_loses(monkeypatch):
    """An injected cost curve where every node costs as much as a plain step (a machine with no spare width): the
    walk would gain from heads and lookup alike, but no tree pays for its nodes, so nodes=auto keeps the root alone
    (plain decoding), with no lookup chain and no guard to run."""
    sequences = looping_texts(4, 60)
    depth = 3
    ranks = [[[0 if (j + k) % 3 else 1 for j in range(len(ids[0]) - n - 1 - k)] for k in range(depth)]
             for ids, n in sequences]
    accuracies = [[0.6, 0.2, 0.1], [0.4, 0.1, 0.05], [0.3, 0.05, 0.02]]
    cfg = BuildTreeConfig(heads="unused", nodes="auto", max_nodes=16, lookup_depth="auto", lookup_max_depth=4,
                          top_k=3)
    split = size.LookupSplit(cfg, accuracies, ranks, sequences)
    assert split.best(8)[1] > 0 and split.best(8)[0] > 2  # the walk wants a hybrid: it is the cost that says no
    dear = {}

    def measure(model, trees, context, repeats, graphs=None, expected=None, screen=None):
        dear.update({n: 10.0 * n for n in trees})  # a verify step of n nodes costs n plain steps
        return CostCurve(device="test", dtype="float32", threads=1, context=context, repeats=repeats, plain_ms=10.0,
                         generate_ms=10.0, verify_ms=dict(dear))

    monkeypatch.setattr(size, "measure_cost_curve", measure)
    best, extra = size.choose_size(None, accuracies, cfg, 100, split)
    assert best == 1 and extra["chosen_lookup_nodes"] == 0
    assert extra["expected_speedup"] <= 1.0 + 1e-9
    assert all(row["expected_speedup"] <= extra["expected_speedup"] + 1e-9 for row in extra["sizes"].values())


def test_the_guard_sized_to_its_time_decodes_the_same_first_prompts_with_every_tree():
    """``max_minutes`` stops the guard starting prompts, never one tree's: what was decoded by each is the same
    prompts, and equals decoding those prompts without a budget (the first is always decoded)."""
    from helpers.backbones import make_tiny_backbone

    from medusa_train import MedusaModel
    from medusa_train.decoding.tree import TokenTree
    from medusa_train.tree.guard import decode_rates

    model = MedusaModel.from_backbone(make_tiny_backbone(), num_heads=2).eval()
    sequences = looping_texts(3, 20)
    trees = {HYBRID: TokenTree([[0], [0, 0]], lookup_depth=2), DRAFT: TokenTree([[0], [1], [0, 0]]),
             LOOKUP: TokenTree([], lookup_depth=2)}
    rates, same, decoded = decode_rates(model, sequences, trees, 8, [], progress=False, max_minutes=1e-9)
    alone, _, whole = decode_rates(model, sequences[:1], trees, 8, [], progress=False)
    assert decoded == 1 and whole == 1 and same
    assert {n: (r["tokens"], r["tokens_per_step"]) for n, r in rates.items()} == \
        {n: (r["tokens"], r["tokens_per_step"]) for n, r in alone.items()}
    assert decode_rates(model, sequences, trees, 8, [], progress=False)[2] == 3  # no budget: every prompt
