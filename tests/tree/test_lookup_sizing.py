"""Sizing the lookup chain by measurement: what each lookup node adds beyond the heads' tree, measured on the text,
equals what the decoder then accepts step by step."""

from __future__ import annotations

import pytest
import torch
from helpers.backbones import make_tiny_backbone
from helpers.decoding import hf_greedy, install_oracle_heads

from medusa_train import MedusaModel
from medusa_train.decoding import TokenTree, tree_generate
from medusa_train.tree.calibrate import (
    heads_depths,
    lookup_gains,
    lookup_runs,
    measure_ranks,
    rank_accuracies_from,
    tokens_per_step,
    walked_steps,
)
from medusa_train.tree.fit import build_tree

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def test_lookup_runs_count_the_chain_tokens_right_in_a_row():
    # prompt [7, 1, 2, 3] (length 4), then 9 1 2 3 1 2; at position t the root is the token at t + 1:
    # t=3 root 9: never before, 0; t=4 root 1: "1" was followed by 2 3 9, the text goes 2 3 1: 2 right;
    # t=5 root 2: "1 2" by 3 9, text 3 1: 1; t=6 root 3: "1 2 3" by 9, text 1: 0; t=7 root 1: "1" last by 2, text 2: 1
    ids = torch.tensor([[7, 1, 2, 3, 9, 1, 2, 3, 1, 2]])
    assert lookup_runs([(ids, 4)], max_depth=3, ngram=(1, 3)) == [[0, 2, 1, 0, 1]]
    assert lookup_runs([(ids, 4)], max_depth=1, ngram=(1, 3)) == [[0, 1, 1, 0, 1]]
    assert lookup_runs([(ids, 4)], max_depth=3, ngram=(4, 4)) == [[0, 0, 0, 0, 0]]


def test_heads_depths_walk_the_true_tokens_ranks_through_the_tree():
    ranks = [[[0, 1, 0, 3], [0, 0, 2], [1, 0]]]  # one sequence, three heads, positions 0..3
    assert heads_depths(ranks, [[0], [1], [0, 0], [0, 0, 1], [1, 0]]) == [[3, 2, 1, 0]]
    assert heads_depths(ranks, []) == [[0, 0, 0, 0]]
    assert rank_accuracies_from(ranks, 3, 2) == ([[0.5, 0.25], [2 / 3, 0.0], [0.5, 0.5]], [4, 3, 2])


def test_lookup_gains_count_only_what_the_heads_do_not_reach():
    runs, depths = [[3, 1, 0, 2]], [[1, 1, 0, 3]]
    # i = 1: run >= 1 and depth < 1: none; i = 2: positions 0; i = 3: position 0
    assert lookup_gains(runs, depths, 3) == [0.0, 0.25, 0.25]
    assert lookup_gains([[]], [[]], 2) == [0.0, 0.0]


def test_the_walk_counts_a_loop_once_per_step_not_once_per_position():
    # a text whose last 8 positions loop: per position, lookup would add 8+7+...+1 over 12 positions (3 a position);
    # decoded, the 4 fresh positions take a step each and the loop one step of the 8 tokens left (its 8 copied
    # guesses reach the text's end; the token the step would choose after them lies past it): 12 tokens in 5 steps
    depths, runs = [0, 0, 0, 0] + [0] * 8, [0, 0, 0, 0, 8, 7, 6, 5, 4, 3, 2, 1]
    assert walked_steps(depths, runs, 8) == [1, 1, 1, 1, 8]
    assert walked_steps(depths, runs, 3) == [1, 1, 1, 1, 4, 4]  # the chain capped at 3 nodes
    assert walked_steps([1, 0, 2, 0, 0], (), 0) == [2, 3]  # heads alone: their depth at each step's position
    # the last step writes only what the text has left: 3 positions, 3 tokens after the first, however deep
    assert walked_steps([0, 3, 3], (), 0) == [1, 2]
    assert walked_steps([2, 2, 2], (), 0) == [3]
    assert walked_steps([], (), 0) == []
    assert tokens_per_step([depths, [1, 0, 2, 0, 0]], [runs, []], 8) == pytest.approx(17 / 7)
    assert tokens_per_step([[]]) == 1.0


def looping_prompt(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(3, 256, (5,), generator=g)
    return torch.cat([phrase, torch.randint(3, 256, (3,), generator=g), phrase])[None]


@pytest.mark.parametrize("seed", [0, 1])
def test_measured_depths_are_what_the_hybrid_decoder_accepts_step_by_step(seed):
    """On the backbone's own greedy text, each decode step accepts 1 + the longer of the heads' measured depth and
    the lookup chain's measured run at that position: calibration and decoder count the same positions."""
    backbone = make_tiny_backbone("llama", seed=4)
    model = MedusaModel.from_backbone(backbone, num_heads=4)
    ids = looping_prompt(seed)
    ref = hf_greedy(backbone, ids, 40, eos_token_id=[])
    install_oracle_heads(model, ref, seed=seed)
    tree = TokenTree([[0], [1], [0, 0], [0, 0, 0]], lookup_depth=5)
    prompt_len = ids.shape[1]
    ranks = measure_ranks(model, [(ref, prompt_len)], top_k=4)
    depth = heads_depths(ranks, tree.choices)[0]
    run = lookup_runs([(ref, prompt_len)], tree.lookup_depth, tree.lookup_ngram)[0]
    out = tree_generate(model, ids, tree, max_new_tokens=40, eos_token_id=[])
    assert out.sequences.tolist() == ref.tolist()
    j = 0  # the step's position, counted from the last prompt token
    for step, gained in enumerate(out.accept_lengths[:-1]):  # the last one is cut at the reply's end
        assert gained == 1 + max(depth[j], run[j]), (step, j)
        assert (out.accepted_depths[step], out.lookup_depths[step]) == \
            ((depth[j], 0) if depth[j] >= run[j] else (0, run[j]))
        j += gained
    assert sum(out.lookup_depths) > 0 and sum(out.accepted_depths) > 0  # both branches were kept
    # what build-tree's sizing walks is what the decoder did, step for step, the last step included
    assert walked_steps(depth, run, tree.lookup_depth) == out.written_per_step
    assert sum(out.written_per_step) == out.new_tokens - 1 == len(depth)


def test_build_tree_shares_the_nodes_between_heads_and_lookup_by_what_each_adds(tmp_path, capsys):
    """``build-tree nodes=auto lookup_depth=auto``: every size's split is the one with the most expected tokens per
    step (greedy decoding walked over the same calibration text, the heads' depths and lookup runs recomputed here),
    the chosen tree carries its chain, and the YAML and the output say how many nodes went to lookup."""
    import json

    import yaml
    from helpers.training import make_model_dir

    from medusa_train import load_backbone
    from medusa_train.cli.build_tree import build_build_tree_config, run
    from medusa_train.model.load import load_exported_draft
    from medusa_train.tree.calibrate import greedy_continuations

    backbone, _ = load_backbone(str(make_model_dir(tmp_path / "model")), dtype="float32")
    heads = MedusaModel.from_backbone(backbone, num_heads=3).save_pretrained(tmp_path / "heads")
    prompts = ["Hello there!", "def add(a, b):", "One two one two one two"]
    source = tmp_path / "calib.jsonl"
    source.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    out = tmp_path / "tree.yaml"
    result = run(build_build_tree_config({
        "heads": str(heads), "nodes": "auto", "max_nodes": 12, "calibration": str(source), "num_prompts": 3,
        "max_new_tokens": 24, "exclude": None, "output": str(out), "device": "cpu", "cost_context": 32,
        "cost_repeats": 1, "lookup_depth": "auto", "lookup_max_depth": 4,
        "guard_prompts": 0}))  # the walk's split as it stands (the guard's decoding: tests/tree/test_guard.py)
    data = yaml.safe_load(out.read_text())
    model, tokenizer = load_exported_draft(str(heads), device="cpu")
    sequences = greedy_continuations(model, tokenizer, prompts, 24)
    ranks = measure_ranks(model, sequences, 10)
    accuracies, _ = rank_accuracies_from(ranks, 3, 10)
    runs = lookup_runs(sequences, 4, (1, 3))

    def expected(n, d):
        choices = build_tree(accuracies, n - d)
        return tokens_per_step(heads_depths(ranks, choices), runs, d)

    for size, row in data["sizes"].items():
        n = int(size)
        best = max(range(min(4, n - 1) + 1), key=lambda d: (round(expected(n, d), 9), -d))
        assert row["lookup_nodes"] == best, (n, [expected(n, d) for d in range(min(4, n - 1) + 1)], row)
        assert row["expected_accept_length"] == pytest.approx(expected(n, best), abs=1e-4)
    chosen, depth = data["chosen_nodes"], data["chosen_lookup_nodes"]
    assert result["lookup_depth"] == depth == data.get("lookup_depth", 0)
    tree = TokenTree.from_name(str(out), num_heads=3)
    assert tree.num_nodes == chosen and tree.lookup_depth == depth and tree.lookup_ngram == (1, 3)
    assert f"lookup: {depth} of the {chosen} nodes go to the lookup chain" in capsys.readouterr().out
    if depth:
        assert data["expected_accept_length"] == pytest.approx(expected(chosen, depth), abs=1e-4)
        assert data["lookup_gains"] == pytest.approx(
            lookup_gains(runs, heads_depths(ranks, build_tree(accuracies, chosen - depth)), 4)[:depth], abs=1e-4)
    assert any(row["lookup_nodes"] > 0 for row in data["sizes"].values())  # the looping text pays for lookup somewhere
