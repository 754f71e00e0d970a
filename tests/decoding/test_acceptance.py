"""Acceptance rules: exact greedy/typical decisions, and rejection sampling that keeps the base law.

The statistical tests compare empirical distributions with exact ones computed from logits, with a
total-variation bound taken from the sampling noise of an ideal sampler (multinomial draws from the
exact law, same sample size), and check that a deliberately wrong sampler fails the same bound.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from helpers.backbones import make_tiny_backbone
from helpers.decoding import logits_from, noise_bound, tv

from medusa_train import MedusaModel
from medusa_train.decoding import TokenTree, tree_generate
from medusa_train.decoding.acceptance import (
    Acceptance,
    NodeArgmax,
    accept,
    greedy_accept,
    probabilities,
    rejection_accept,
    sample,
    typical_accept,
)

# node: 0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1], 5 [1,0], 6 [0,0,0]
HAND = TokenTree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
HAND_TOKENS = torch.tensor([5, 3, 7, 1, 2, 4, 9])


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


# ------------------------------------------------------------------------------------------ greedy
def test_greedy_walks_the_argmax_path():
    logits = logits_from({0: {7: 0.5}, 2: {4: 0.6}, 5: {8: 0.9}, 1: {1: 0.9}})
    assert greedy_accept(HAND, HAND_TOKENS, logits) == Acceptance([0, 2, 5], 8)
    # nothing matches: only the root, and the next token is the root's argmax
    logits = logits_from({0: {6: 0.5}})
    assert greedy_accept(HAND, HAND_TOKENS, logits) == Acceptance([0], 6)
    # the deepest path
    logits = logits_from({0: {3: 0.5}, 1: {1: 0.5}, 3: {9: 0.5}, 6: {0: 0.5}})
    assert greedy_accept(HAND, HAND_TOKENS, logits) == Acceptance([0, 1, 3, 6], 0)


def _walk(tree, tokens, best, node):
    """The longest path below ``node`` whose tokens are their parents' argmax (the first child wins ties)."""
    path = [node]
    for child in tree.children[node]:
        if tokens[child] == best[node] and len(below := _walk(tree, tokens, best, child)) + 1 > len(path):
            path = [node, *below]
    return path


def test_greedy_in_bf16_takes_the_same_tokens_as_torchs_argmax_and_reads_only_the_walked_rows():
    """bf16 rows widened before their argmax (and asked for lazily on a CPU) give torch's own bf16 argmax, ties and
    all: logits on a coarse grid tie often, and the first of the tied tokens must still win."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        logits = (torch.randint(0, 6, (HAND.num_nodes, 10), generator=generator) / 4).to(torch.bfloat16)
        tokens = torch.randint(0, 10, (HAND.num_nodes,), generator=generator)
        tokens[1:] = torch.where(torch.rand(HAND.num_nodes - 1, generator=generator) < 0.5,
                                 logits.argmax(-1)[HAND.parents[1:]], tokens[1:])  # paths that walk deep
        best = logits.argmax(-1).tolist()  # torch's bf16 argmax: the reference

        path = _walk(HAND, tokens.tolist(), best, 0)
        assert greedy_accept(HAND, tokens, logits) == Acceptance(path, best[path[-1]]), trial
        lazy = NodeArgmax(logits)
        assert [lazy[n] for n in range(HAND.num_nodes)] == best
    lazy = NodeArgmax(logits)
    lazy[3]
    assert list(lazy.asked) == [3]  # one row read, not the tree's seven


def test_every_rule_is_greedy_at_temperature_zero():
    logits = logits_from({0: {7: 0.5}, 2: {4: 0.6}, 5: {8: 0.9}})
    for method in ("greedy", "typical", "rejection"):
        assert accept(method, HAND, HAND_TOKENS, logits, temperature=0.0) == Acceptance([0, 2, 5], 8)
    with pytest.raises(ValueError, match="acceptance='nope'"):
        accept("nope", HAND, HAND_TOKENS, logits, temperature=1.0)


# ------------------------------------------------------------------------------------------ typical
def test_typical_keeps_the_longest_passing_path_and_breaks_ties_by_likelihood():
    # Root: tokens 3 (node 1) and 7 (node 2) both at 0.45 > min(0.09, 0.3 exp(-H)).
    # Node 1 keeps token 1 (node 3) at 0.9; node 2 keeps token 4 (node 5) at 0.5: two paths of length 3,
    # the first more likely. Node 3 gives token 9 (node 6) only 0.001: rejected. Node 3 is near one-hot on 6.
    logits = logits_from({0: {3: 0.45, 7: 0.45}, 1: {1: 0.9}, 2: {4: 0.5}, 3: {9: 0.001, 6: 0.99}})
    g = torch.Generator().manual_seed(0)
    result = typical_accept(HAND, HAND_TOKENS, logits, temperature=1.0, generator=g)
    assert result.path == [0, 1, 3]
    assert result.next_token == 6
    # a longer path wins over a more likely one
    logits = logits_from({0: {3: 0.45, 7: 0.45}, 1: {1: 0.01}, 2: {4: 0.5}})
    assert typical_accept(HAND, HAND_TOKENS, logits, 1.0, generator=g).path == [0, 2, 5]
    logits = logits_from({0: {3: 0.45, 7: 0.45}, 1: {1: 0.9}, 2: {4: 0.5}, 3: {9: 0.5}})
    assert typical_accept(HAND, HAND_TOKENS, logits, 1.0, generator=g).path == [0, 1, 3, 6]


def test_typical_threshold_formula():
    # Root puts 0.06 on token 3 (node 1): under threshold 0.09 but above alpha * exp(-H) when H is high.
    flat = logits_from({0: {3: 0.06}})  # the rest spread evenly (0.104 each, token 7 = node 2 too): high entropy
    entropy = -(probabilities(flat[0], 1.0) * probabilities(flat[0], 1.0).log()).sum().item()
    assert 0.3 * math.exp(-entropy) < 0.06 < 0.09
    assert typical_accept(HAND, HAND_TOKENS, flat, 1.0, threshold=0.09, alpha=0.3).path[:2] == [0, 1]
    assert typical_accept(HAND, HAND_TOKENS, flat, 1.0, threshold=0.05, alpha=100.0).path[:2] == [0, 1]
    assert typical_accept(HAND, HAND_TOKENS, flat, 1.0, threshold=0.07, alpha=100.0).path == [0, 2, 5]


# ------------------------------------------------------------------------------------------ rejection
def exact_emission_law(tree: TokenTree, tokens: list[int], probs: torch.Tensor) -> dict[tuple, float]:
    """Law of the tokens one step emits after the root (accepted path + next token) under exact sampling:
    at node u, the next token x ~ probs[u]; if x is a child's token we move there, else we stop."""
    law: dict[tuple, float] = {}

    def walk(node: int, prefix: tuple, mass: float) -> None:
        kids = {tokens[c]: c for c in tree.children[node]}
        for x, p in enumerate(probs[node].tolist()):
            if x in kids:
                walk(kids[x], (*prefix, x), mass * p)
            else:
                law[(*prefix, x)] = mass * p

    walk(0, (), 1.0)
    return law


def naive_accept(tree, tokens, logits, temperature, top_p=1.0, generator=None) -> Acceptance:
    """A wrong rule: accepts child x with probability p(x) but never removes rejected tokens."""
    tokens = tokens.tolist()
    node, path = 0, [0]
    while True:
        p = probabilities(logits[node], temperature, top_p)
        for child in tree.children[node]:
            if float(torch.rand((), generator=generator)) < float(p[tokens[child]]):
                node = child
                path.append(child)
                break
        else:
            return Acceptance(path, sample(p, generator))


def emission_counts(rule, tree, tokens, logits, n, **kwargs) -> Counter:
    g = torch.Generator().manual_seed(1)
    counts = Counter()
    for _ in range(n):
        result = rule(tree, tokens, logits, generator=g, **kwargs)
        counts[(*tokens[result.path[1:]].tolist(), result.next_token)] += 1
    return counts


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_rejection_sampling_keeps_the_base_law_over_a_tree(temperature, top_p):
    vocab, n = 6, 20000
    tree = TokenTree([[0], [1], [2], [0, 0], [0, 1], [1, 0]])  # nodes: 0; 1 2 3; 4 5 6
    tokens = torch.tensor([0, 1, 2, 3, 2, 4, 5])  # siblings hold distinct tokens
    logits = torch.randn(tree.num_nodes, vocab, generator=torch.Generator().manual_seed(3)) * 1.5
    probs = probabilities(logits, temperature, top_p)
    law = exact_emission_law(tree, tokens.tolist(), probs)
    outcomes = sorted(law)
    exact = torch.tensor([law[o] for o in outcomes] + [0.0])  # last bucket: emissions exact sampling never makes
    assert exact.sum().item() == pytest.approx(1.0)
    bound = noise_bound(exact, n)

    def empirical(rule):
        counts = emission_counts(rule, tree, tokens, logits, n, temperature=temperature, top_p=top_p)
        impossible = sum(c for o, c in counts.items() if o not in law)
        return torch.tensor([counts[o] / n for o in outcomes] + [impossible / n])

    got = empirical(rejection_accept)
    assert got[-1] == 0
    assert tv(got, exact) < bound
    assert tv(empirical(naive_accept), exact) > bound  # the test can fail
    assert tv(empirical(typical_accept), exact) > bound


def exact_two_token_laws(backbone, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact laws of the first and second sampled tokens (temperature 1) from the logits."""
    vocab = backbone.config.vocab_size
    with torch.no_grad():
        first = torch.softmax(backbone(ids).logits[0, -1].double(), -1)
        both = torch.cat([ids.repeat(vocab, 1), torch.arange(vocab)[:, None]], dim=1)
        second_given_first = torch.softmax(backbone(both).logits[:, -1].double(), -1)
    return first.float(), (first @ second_given_first).float()


def test_rejection_generate_matches_base_sampling_distribution():
    """End to end on a tiny model: 4000 samples of 2 tokens at temperature 1 (~25 s on 2 cores)."""
    backbone = make_tiny_backbone("llama", seed=0)
    with torch.no_grad():
        backbone.lm_head.weight.mul_(20)  # a peaked distribution, so 4000 samples resolve it
    model = MedusaModel.from_backbone(backbone, num_heads=1)
    ids = torch.tensor([[5, 17, 99, 42, 7]])
    first, second = exact_two_token_laws(backbone, ids)
    # heads propose the most likely second tokens, so children are often accepted and often rejected
    model.head_logits = lambda hidden, k: second.log().expand(*hidden.shape[:-1], -1)
    tree = TokenTree([[0], [1], [2], [3]])
    candidates = second.topk(4).indices

    def run(acceptance: str, n: int):
        g = torch.Generator().manual_seed(0)
        counts = torch.zeros(2, len(first))
        children_kept = 0
        for _ in range(n):
            out = tree_generate(model, ids, tree, max_new_tokens=2, temperature=1.0, acceptance=acceptance,
                                  eos_token_id=[], generator=g)
            counts[0, out.sequences[0, -2]] += 1
            counts[1, out.sequences[0, -1]] += 1
            children_kept += out.accepted_depths[0] >= 1  # the step kept a child, not only the root
        return counts / n, children_kept / n

    def grouped(law):  # the candidate tokens, then everything else: where a biased rule shows first
        return torch.cat([law[candidates], 1 - law[candidates].sum(0, keepdim=True)])

    n = 4000
    bounds = [noise_bound(first, n), noise_bound(second, n), noise_bound(grouped(second), n)]
    assert max(bounds) < 0.08
    (got_first, got_second), kept = run("rejection", n)
    assert 0.2 < kept < 0.9  # both branches of the rule are exercised
    assert tv(got_first, first) < bounds[0]
    assert tv(got_second, second) < bounds[1]
    assert tv(grouped(got_second), grouped(second)) < bounds[2]
    for wrong, samples in (("typical", n), ("greedy", 50)):
        (_, got_second), _ = run(wrong, samples)
        assert tv(got_second, second) > bounds[1], wrong
