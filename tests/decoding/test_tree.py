"""TokenTree: exact buffers of a hand-worked tree, validation errors, built-in trees, the builder."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from medusa_train.config.paths import TREE_DIR
from medusa_train.decoding import TokenTree, tree_from_config
from medusa_train.tree.fit import assumed_rank_accuracies, build_tree, expected_accept_length

# Node numbering: root, then (depth, path) order.
#   0 root
#   1 [0]      2 [1]
#   3 [0,0]    4 [0,1]    5 [1,0]
#   6 [0,0,0]
HAND_CHOICES = [[0, 0, 0], [1, 0], [0], [0, 1], [1], [0, 0]]  # deliberately unsorted


@pytest.fixture
def hand_tree():
    return TokenTree(HAND_CHOICES)


def test_node_order_and_structure(hand_tree):
    assert hand_tree.choices == [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    assert hand_tree.num_nodes == len(hand_tree) == 7
    assert hand_tree.depth == 3
    assert hand_tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert hand_tree.children == [[1, 2], [3, 4], [5], [6], [], [], []]
    assert hand_tree.head_top_k == [2, 2, 1]


def test_exact_visibility_and_additive_mask(hand_tree):
    expected = torch.tensor([
        # 0  1  2  3  4  5  6
        [1, 0, 0, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0, 0, 0],  # [0]
        [1, 0, 1, 0, 0, 0, 0],  # [1]
        [1, 1, 0, 1, 0, 0, 0],  # [0,0]
        [1, 1, 0, 0, 1, 0, 0],  # [0,1]
        [1, 0, 1, 0, 0, 1, 0],  # [1,0]
        [1, 1, 0, 1, 0, 0, 1],  # [0,0,0]
    ], dtype=torch.bool)
    assert torch.equal(hand_tree.visibility, expected)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        mask = hand_tree.attention_mask(dtype)
        assert mask.dtype == dtype
        want = torch.where(expected, torch.tensor(0.0, dtype=dtype), torch.tensor(torch.finfo(dtype).min, dtype=dtype))
        assert torch.equal(mask, want)


def test_exact_positions_slots_and_retrieve_paths(hand_tree):
    assert hand_tree.position_offsets.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert hand_tree.node_heads.tolist() == [-1, 0, 0, 1, 1, 1, 2]
    assert hand_tree.node_ranks.tolist() == [-1, 0, 1, 0, 1, 0, 0]
    assert hand_tree.retrieve_paths.tolist() == [
        [0, 1, 4, -1],  # leaf [0,1]
        [0, 2, 5, -1],  # leaf [1,0]
        [0, 1, 3, 6],   # leaf [0,0,0]
    ]


def test_root_only_tree():
    tree = TokenTree([])
    assert tree.num_nodes == 1 and tree.depth == 0
    assert tree.retrieve_paths.tolist() == [[0]]
    assert torch.equal(tree.attention_mask(), torch.zeros(1, 1))


@pytest.mark.parametrize("choices, kwargs, message", [
    ([[0], [1], [0]], {}, r"tree path \[0\] appears more than once"),
    ([[0], [1, 0]], {}, r"tree path \[1, 0\]: its prefix \[1\] is missing"),
    ([[0], [0, 0], [0, 1, 2]], {}, r"tree path \[0, 1, 2\]: its prefix \[0, 1\] is missing"),
    ([[0], [0, 0], [0, 0, 0]], {"num_heads": 2}, r"tree path \[0, 0, 0\] needs 3 heads but num_heads=2"),
    ([[0], [-1]], {}, r"tree path \[-1\]: ranks must be >= 0"),
    ([[0], [1], [2]], {"top_k": 2}, r"tree path \[2\]: rank 2 needs top_k > 2 but top_k=2"),
    ([[0], []], {}, r"tree path \[\]: the root is implicit"),
    ([[0], [0.5]], {}, r"tree path \[0.5\]: ranks must be integers"),
    ([[0], 1], {}, r"tree path 1: must be a list of top-k ranks"),
    ("[[0]]", {}, r"tree choices must be a list of paths"),
])
def test_validation_errors_name_the_path(choices, kwargs, message):
    with pytest.raises(ValueError, match=message):
        TokenTree(choices, **kwargs)


def test_check_num_heads_names_path_and_head_count():
    tree = TokenTree.chain(6)
    tree.check_num_heads(6)
    with pytest.raises(ValueError, match=r"tree path \[0, 0, 0, 0, 0\] needs 5 heads but the model has 4"):
        tree.check_num_heads(4)


def test_chain():
    assert TokenTree.chain(3).choices == [(0,), (0, 0), (0, 0, 0)]
    assert TokenTree.chain(0).num_nodes == 1
    assert TokenTree.from_name("chain", num_heads=2).choices == [(0,), (0, 0)]


def test_builtin_trees_load_and_open_with_a_command_comment():
    files = sorted(TREE_DIR.glob("*.yaml"))
    assert {"chain", "default"} <= {f.stem for f in files}
    for f in files:
        assert f.read_text().splitlines()[0].startswith("# medusa-train "), f
        tree = TokenTree.from_name(f.stem)
        assert tree == TokenTree.from_name(str(f))  # a path works too


def test_default_tree_shape():
    tree = TokenTree.from_name("default")
    assert 60 <= tree.num_nodes <= 70
    assert 4 <= tree.depth <= 5
    widths = [sum(len(p) == d for p in tree.choices) for d in range(1, tree.depth + 1)]
    assert widths[0] > widths[-1]  # more branching near the root
    # it is exactly the builder's pick from the assumed accuracies, most likely path first
    assert [list(p) for p in tree.listed_choices] == build_tree(assumed_rank_accuracies(), tree.num_nodes)


def test_from_name_errors(tmp_path: Path):
    with pytest.raises(ValueError, match=r"tree=nope: unknown tree; built-in trees are \[.*'default'"):
        TokenTree.from_name("nope")
    with pytest.raises(FileNotFoundError):
        TokenTree.from_name(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("# python x\nfoo: 1\n")
    with pytest.raises(ValueError, match="choices"):
        TokenTree.from_name(str(bad))
    with pytest.raises(ValueError, match=r"needs 4 heads but num_heads=3"):
        TokenTree.from_name("default", num_heads=3)


def test_tree_from_config_forms():
    expected = TokenTree([[0], [1], [0, 0]])
    assert tree_from_config([[0], [1], [0, 0]]) == expected
    assert tree_from_config({"choices": [[0], [1], [0, 0]]}) == expected
    assert tree_from_config(expected) is expected
    assert tree_from_config("chain", num_heads=3) == TokenTree.chain(3)
    assert tree_from_config({"name": "default"}) == TokenTree.from_name("default")
    with pytest.raises(ValueError, match=r"needs 2 heads but the model has 1"):
        tree_from_config(expected, num_heads=1)


def test_truncated_keeps_prefixes_and_listed_order():
    default = TokenTree.from_name("default")
    for n in (1, 2, 5, 16, 32, default.num_nodes):
        sub = default.truncated(max_nodes=n)
        assert sub.num_nodes == n
        assert list(sub.listed_choices) == list(default.listed_choices[: n - 1])  # already prefix-closed
    shallow = default.truncated(max_depth=2)
    assert shallow.depth == 2 and set(shallow.choices) == {p for p in default.choices if len(p) <= 2}
    # a listing where a child comes before its parent still yields a valid tree
    tree = TokenTree([[1, 0], [0], [1], [2], [0, 0]])
    assert tree.truncated(max_nodes=2).choices == [(0,)]  # [1, 0] and its prefix [1] do not fit
    assert tree.truncated(max_nodes=3).choices == [(1,), (1, 0)]
    assert tree.truncated(max_nodes=4).choices == [(0,), (1,), (1, 0)]


def test_build_tree_is_optimal_on_a_small_universe():
    acc = [[0.6, 0.2, 0.1], [0.4, 0.15, 0.05]]
    universe = [(a,) for a in range(3)] + [(a, b) for a in range(3) for b in range(3)]
    for size in range(1, 8):
        best = max(expected_accept_length(s, acc) for s in itertools.combinations(universe, size)
                   if all(p[:-1] in s or len(p) == 1 for p in s))
        got = build_tree(acc, size + 1)
        assert len(got) == size
        TokenTree(got)  # prefix-closed
        assert expected_accept_length(got, acc) == pytest.approx(best)
