"""Context lookup as a branch of the tree: the index, the tree's lookup chain, acceptance with a per-step validity
mask, and decoding that stays token-identical to plain greedy with the chain in it."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from helpers.backbones import make_tiny_backbone
from helpers.decoding import (
    hf_greedy,
    install_oracle_heads,
    logits_from,
    noise_bound,
    perturb_heads,
    prompts,
    tv,
)

from medusa_train import MedusaModel
from medusa_train.decoding import TokenTree, tree_generate
from medusa_train.decoding.acceptance import (
    Acceptance,
    greedy_accept,
    probabilities,
    rejection_accept,
    typical_accept,
)
from medusa_train.decoding.lookup import LookupChain

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


# ------------------------------------------------------------------------------------------ the index
def rescan(tokens: list[int], length: int, max_n: int, min_n: int) -> list[int]:
    """The definition, by rescanning: the most recent earlier occurrence of the longest matching suffix."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # an occurrence with at least one token after it
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + length]
    return []


def test_lookup_finds_the_most_recent_continuation_of_the_longest_suffix():
    lookup = LookupChain(max_ngram=3, min_ngram=1, tokens=[5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    assert lookup.propose(2) == [9, 2]  # "6 7" last occurred before "9 2" (not "8 1"): the most recent
    lookup.extend([9])
    assert lookup.propose(4) == [2, 6, 7, 9]  # "6 7 9" matched whole; the continuation may run into the suffix
    lookup.extend([3])
    assert lookup.propose(4) == []  # 3 never occurred before
    assert LookupChain(2, 2, [4, 4]).propose(3) == []  # "4 4" has not occurred before with a token after it
    assert LookupChain(1, 1, [4, 4]).propose(3) == [4]
    assert LookupChain(1, 1, [1, 2, 1]).propose(0) == []
    with pytest.raises(ValueError, match="min=2, max=1"):
        LookupChain(max_ngram=1, min_ngram=2)


def test_the_index_built_as_tokens_arrive_equals_a_rescan():
    rng = random.Random(0)
    for trial in range(40):
        max_n, min_n = rng.choice([(3, 1), (2, 2), (4, 2), (1, 1)])
        lookup = LookupChain(max_n, min_n)
        tokens: list[int] = []
        for _ in range(60):
            new = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
            lookup.extend(new)
            tokens += new
            length = rng.randrange(1, 6)
            assert lookup.propose(length) == rescan(tokens, length, max_n, min_n), (trial, tokens)


# ------------------------------------------------------------------------------------------ the tree
def test_a_lookup_chain_hangs_from_the_root_after_the_heads_nodes():
    # nodes: 0 root; heads 1 [0], 2 [1], 3 [0, 0]; lookup 4, 5, 6
    tree = TokenTree([[0], [1], [0, 0]], lookup_depth=3)
    assert (tree.num_nodes, tree.num_head_nodes, tree.depth, tree.lookup_depth, tree.tree_depth) == (7, 4, 2, 3, 3)
    assert tree.parents.tolist() == [-1, 0, 0, 1, 0, 4, 5]
    assert tree.children == [[1, 2, 4], [3], [], [], [5], [6], []]
    assert tree.position_offsets.tolist() == [0, 1, 1, 2, 1, 2, 3]
    assert tree.node_heads.tolist() == [-1, 0, 0, 1, -1, -1, -1]
    assert tree.node_ranks.tolist() == [-1, 0, 1, 0, -1, -1, -1]
    assert tree.node_lookup.tolist() == [-1, -1, -1, -1, 0, 1, 2]
    assert tree.visibility.int().tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 0, 0, 0, 1, 0, 0],
        [1, 0, 0, 0, 1, 1, 0],
        [1, 0, 0, 0, 1, 1, 1]]
    assert tree.retrieve_paths.tolist() == [[0, 2, -1, -1], [0, 1, 3, -1], [0, 4, 5, 6]]
    assert tree.heads_tree == TokenTree([[0], [1], [0, 0]]) and tree.heads_tree.lookup_depth == 0
    assert tree != tree.heads_tree and tree == tree.heads_tree.with_lookup(3)
    assert tree.truncated(max_nodes=6) == TokenTree([[0], [1]], lookup_depth=3)
    with pytest.raises(ValueError, match="the 3 lookup nodes"):
        tree.truncated(max_nodes=3)
    lookup_only = TokenTree([], lookup_depth=2)
    assert lookup_only.children == [[1], [2], []] and lookup_only.depth == 0 and lookup_only.tree_depth == 2
    with pytest.raises(ValueError, match="lookup_depth=-1"):
        TokenTree([[0]], lookup_depth=-1)


def test_a_tree_file_states_its_lookup_depth(tmp_path):
    from medusa_train.decoding.tree import tree_from_config

    path = tmp_path / "hybrid.yaml"
    path.write_text("choices: [[0], [0, 0]]\nlookup_depth: 4\n")
    assert TokenTree.from_name(str(path)) == TokenTree([[0], [0, 0]], lookup_depth=4)
    assert TokenTree.from_name(str(path)).lookup_ngram == (1, 3)  # the default suffix sizes
    path.write_text("choices: [[0]]\nlookup_depth: 2\nlookup_ngram: [2, 4]\n")
    assert TokenTree.from_name(str(path)).lookup_ngram == (2, 4)
    assert tree_from_config({"choices": [[0]], "lookup_depth": 2}) == TokenTree([[0]], lookup_depth=2)
    assert TokenTree.from_name("default").lookup_depth == 0
    with pytest.raises(ValueError, match=r"lookup_ngram=\[3, 1\]"):
        TokenTree([[0]], lookup_depth=2, lookup_ngram=(3, 1))


# ------------------------------------------------------------------------------------------ acceptance
# nodes: 0 root; heads 1 [0], 2 [1], 3 [0, 0]; lookup 4, 5, 6
TREE = TokenTree([[0], [1], [0, 0]], lookup_depth=3)


def test_greedy_never_keeps_a_node_that_holds_no_guess():
    tokens = torch.tensor([0, 1, 2, 3, 7, 8, 9])
    logits = logits_from({0: {7: 0.9}, 4: {8: 0.9}, 5: {9: 0.9}, 6: {5: 0.9}}, n=7)
    assert greedy_accept(TREE, tokens, logits) == Acceptance([0, 4, 5, 6], 5)
    missed = torch.tensor([True] * 5 + [False] * 2)  # lookup found one token: nodes 5 and 6 are filler
    assert greedy_accept(TREE, tokens, logits, missed) == Acceptance([0, 4], 8)
    assert typical_accept(TREE, tokens, logits, temperature=1.0, valid=missed).path == [0, 4]


def test_greedy_follows_every_child_holding_the_argmax():
    """A lookup token equal to a head's guess: the longer accepted path wins, the heads' on a tie."""
    tokens = torch.tensor([0, 1, 2, 3, 1, 8, 9])  # node 4 (lookup) duplicates node 1 (head 1's top-1)
    logits = logits_from({0: {1: 0.9}, 1: {3: 0.9}, 4: {8: 0.9}, 5: {9: 0.9}}, n=7)
    assert greedy_accept(TREE, tokens, logits) == Acceptance([0, 4, 5, 6], logits[6].argmax().item())
    logits = logits_from({0: {1: 0.9}, 1: {3: 0.9}, 4: {8: 0.9}, 5: {4: 0.9}}, n=7)
    assert greedy_accept(TREE, tokens, logits) == Acceptance([0, 1, 3], logits[3].argmax().item())  # tie: heads


def exact_law(children: dict[int, dict[int, int]], probs: torch.Tensor) -> dict[tuple, float]:
    """Law of what one step emits under exact sampling, given which node holds each token below each node."""
    law: dict[tuple, float] = {}

    def walk(node: int, prefix: tuple, mass: float) -> None:
        for x, p in enumerate(probs[node].tolist()):
            if x in children.get(node, {}):
                walk(children[node][x], (*prefix, x), mass * p)
            else:
                law[(*prefix, x)] = mass * p

    walk(0, (), 1.0)
    return law


@pytest.mark.parametrize("valid, descend", [
    (None, {0: {1: 4, 2: 2}, 4: {4: 5}, 5: {5: 6}}),  # token 1: the lookup chain, which reaches deeper
    ([True] * 5 + [False] * 2, {0: {1: 1, 2: 2}, 1: {3: 3}}),  # lookup found one token: the head's node
])
def test_rejection_sampling_keeps_the_base_law_with_a_lookup_chain(valid, descend):
    vocab, n = 6, 20000
    tokens = torch.tensor([0, 1, 2, 3, 1, 4, 5])  # node 4 (lookup) holds node 1's token
    logits = torch.randn(TREE.num_nodes, vocab, generator=torch.Generator().manual_seed(5)) * 1.5
    logits[4] = logits[1]  # the same text so far: the same distribution
    probs = probabilities(logits, 1.0)
    law = exact_law(descend, probs)
    outcomes = sorted(law)
    exact = torch.tensor([law[o] for o in outcomes] + [0.0])
    mask = None if valid is None else torch.tensor(valid)
    g, counts = torch.Generator().manual_seed(1), Counter()
    for _ in range(n):
        result = rejection_accept(TREE, tokens, logits, 1.0, generator=g, valid=mask)
        counts[(*tokens[result.path[1:]].tolist(), result.next_token)] += 1
    impossible = sum(c for o, c in counts.items() if o not in law)
    got = torch.tensor([counts[o] / n for o in outcomes] + [impossible / n])
    assert impossible == 0 and tv(got, exact) < noise_bound(exact, n)


# ------------------------------------------------------------------------------------------ decoding
def looping_prompts(n: int, seed: int) -> list[torch.Tensor]:
    """Prompts that repeat a phrase, so the text so far has continuations to find."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        phrase = torch.randint(3, 256, (int(torch.randint(3, 7, (), generator=g)),), generator=g)
        out.append(torch.cat([phrase, torch.randint(3, 256, (2,), generator=g), phrase, phrase[:2]])[None])
    return out


@pytest.mark.parametrize("arch, attn, tree_name", [("llama", "sdpa", "default"), ("qwen2", "eager", "small"),
                                                   ("gpt_neox", "sdpa", "chain")])
def test_greedy_parity_with_a_lookup_chain(arch, attn, tree_name):
    backbone = make_tiny_backbone(arch, seed=2, attn_implementation=attn)
    model = MedusaModel.from_backbone(backbone, num_heads=4)
    perturb_heads(model, seed=3)
    tree = TokenTree.from_name(tree_name, num_heads=4).with_lookup(5)
    kept = 0
    for ids in looping_prompts(3, seed=1) + prompts(2, seed=4):
        ref = hf_greedy(backbone, ids, 40, eos_token_id=[1, 2])
        out = tree_generate(model, ids, tree, max_new_tokens=40, eos_token_id=[1, 2])
        assert out.sequences.tolist() == ref.tolist()
        assert sum(out.accept_lengths) == out.new_tokens and len(out.lookup_depths) == out.steps
        assert all(h == 0 or k == 0 for h, k in zip(out.accepted_depths, out.lookup_depths))  # one branch a step
        kept += sum(out.lookup_depths)
    assert kept > 0  # the chain was accepted: tiny random models repeat themselves


def test_lookup_alone_is_prompt_lookup_decoding():
    """A tree of the root and a lookup chain: plain greedy's tokens, in fewer steps where the text repeats."""
    backbone = make_tiny_backbone("llama", seed=2)
    model = MedusaModel.from_backbone(backbone, num_heads=1)
    for ids in looping_prompts(3, seed=2):
        ref = hf_greedy(backbone, ids, 40, eos_token_id=[])
        out = tree_generate(model, ids, TokenTree([], lookup_depth=6), max_new_tokens=40, eos_token_id=[])
        assert out.sequences.tolist() == ref.tolist() and not any(out.accepted_depths)
        assert out.steps < out.new_tokens - 1  # plain greedy takes a forward per token after the first


@pytest.mark.parametrize("acceptance, temperature", [("greedy", 0.0), ("typical", 0.8)])
def test_a_lookup_that_finds_nothing_gives_exactly_the_heads_only_steps(acceptance, temperature):
    """The chain's nodes hold the root token as filler when lookup finds nothing (here: suffixes longer than any
    text), and the validity mask keeps them out: the same per-step accepted lengths as the heads' tree alone
    (without the mask, typical acceptance keeps filler here and this fails)."""
    backbone = make_tiny_backbone("llama", seed=4)
    model = MedusaModel.from_backbone(backbone, num_heads=4)
    tree = TokenTree.from_name("default")
    for i, ids in enumerate(looping_prompts(3, seed=3)):
        install_oracle_heads(model, hf_greedy(backbone, ids, 30, eos_token_id=[]), seed=i)
        run = dict(max_new_tokens=30, eos_token_id=[], acceptance=acceptance, temperature=temperature)
        heads = tree_generate(model, ids, tree, generator=torch.Generator().manual_seed(i), **run)
        hybrid = tree_generate(model, ids, tree.with_lookup(4, lookup_ngram=(1000, 1000)),
                                 generator=torch.Generator().manual_seed(i), **run)
        assert hybrid.accept_lengths == heads.accept_lengths and hybrid.sequences.tolist() == heads.sequences.tolist()
        assert hybrid.accepted_depths == heads.accepted_depths and not any(hybrid.lookup_depths)
