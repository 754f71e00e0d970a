"""nodes=auto: the tree size with the most expected tokens per second under a measured cost curve."""

from __future__ import annotations

import json

import pytest
import yaml
from helpers.training import make_model_dir

from medusa_train import MedusaModel, load_backbone
from medusa_train.backbone.load import load_tokenizer
from medusa_train.cli.build_tree import build_build_tree_config, run
from medusa_train.config.build_tree import BuildTreeConfig
from medusa_train.decoding import TokenTree
from medusa_train.tree.cost import CostCurve, auto_sizes, choose_tree_size, nondecreasing, screened_sizes
from medusa_train.tree.fit import build_tree, expected_accept_length
from medusa_train.tree.size import cost_context

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

ACCURACIES = [[0.6, 0.1, 0.05], [0.4, 0.08, 0.04], [0.3, 0.05, 0.02], [0.2, 0.04, 0.01]]


def prompt_tokens(tokenizer, text: str) -> int:
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return len(tokenizer(chat, add_special_tokens=False).input_ids)


def curve(verify_ms: dict[int, float]) -> CostCurve:
    return CostCurve(device="test", dtype="float32", threads=1, context=256, repeats=1, plain_ms=10.0,
                     generate_ms=12.0, verify_ms=verify_ms)


def test_a_flat_cost_curve_picks_a_bigger_tree_than_a_steep_one():
    full = build_tree(ACCURACIES, 64)
    sizes = auto_sizes(64, len(full) + 1)
    expected = {n: expected_accept_length(full[:n - 1], ACCURACIES) for n in sizes}
    gpu_like = curve({n: 10.5 + 0.01 * n for n in sizes})  # a wide device: 64 nodes cost about one token
    cpu_like = curve({n: 10.0 + 2.0 * n for n in sizes})  # a narrow one: every node costs
    big, rows = choose_tree_size(gpu_like, expected)
    small, _ = choose_tree_size(cpu_like, expected)
    assert big > small
    for c in (gpu_like, cpu_like):
        best, rows = choose_tree_size(c, expected)
        assert best == max(sizes, key=lambda n: expected[n] / c.verify_ms[n])
        for r in rows:  # the speedup is over generate's per-token cost, as the evaluation measures it
            assert r.expected_speedup == pytest.approx(expected[r.nodes] * 12.0 / c.verify_ms[r.nodes])
            assert r.relative_cost == pytest.approx(c.verify_ms[r.nodes] / 10.0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_build_tree_auto_times_each_size_here_and_records_its_choice(tmp_path, capsys, device):
    root = tmp_path
    backbone, _ = load_backbone(str(make_model_dir(root / "model")), dtype="float32")
    heads = MedusaModel.from_backbone(backbone, num_heads=3).save_pretrained(root / "heads")
    source = root / "calib.jsonl"
    source.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Hello there!", "def add(a, b):", "One two"]))
    out = root / "tree.yaml"
    result = run(build_build_tree_config({
        "heads": str(heads), "nodes": "auto", "max_nodes": 16, "calibration": str(source), "num_prompts": 3,
        "max_new_tokens": 12, "exclude": None, "output": str(out), "device": device, "cost_context": "auto",
        "answer_tokens": 10, "cost_repeats": 2, "lookup_depth": 0}))  # heads only (the lookup split: test_lookup_sizing)
    printed = capsys.readouterr().out
    data = yaml.safe_load(out.read_text())
    # timed at the mean context of answering the prompts (no benchmark to exclude: the calibration ones)
    tokenizer = load_tokenizer(str(root / "model"))
    lengths = [prompt_tokens(tokenizer, p) for p in ["Hello there!", "def add(a, b):", "One two"]]
    assert data["cost_curve"]["context"] == round(sum(lengths) / 3 + 5)
    full = build_tree(result["rank_accuracies"], 16)
    sizes = auto_sizes(16, len(full) + 1)
    assert sorted(data["cost_curve"]["verify_ms"]) == sizes and data["dtype"] == "float32"
    assert data["device"].startswith(f"{device} (")
    # on CUDA the steps are timed replayed from CUDA graphs, as evaluate decodes there, and speedups divide by the
    # faster plain decoding; elsewhere by HF generate
    curve_ = data["cost_curve"]
    assert curve_["graphs"] is (device == "cuda")
    assert curve_["baseline_ms"] == pytest.approx(min(curve_["generate_ms"], curve_["plain_ms"]) if device == "cuda"
                                                  else curve_["generate_ms"], abs=1e-3)
    once = curve_["once"]  # screened out by the first round (cost_screen 2 by default): the biggest sizes, if any
    assert curve_["screen"] == 2.0 and once == sizes[len(sizes) - len(once):]
    fitted = data["cost_curve"]["verify_ms_fitted"]
    assert fitted == pytest.approx(nondecreasing(data["cost_curve"]["verify_ms"]), abs=1e-3)  # YAML rounds to 3 places
    assert all(fitted[a] <= fitted[b] for a, b in zip(sizes[1:], sizes[2:]))  # non-decreasing from 2 nodes
    rate = {n: data["sizes"][str(n)]["expected_tokens_per_s"] for n in sizes}
    assert data["chosen_nodes"] == max(sizes, key=lambda n: rate[n])
    # each size's expectation is the walk over the calibration text (the heads' depths at each step)
    from medusa_train.model.load import load_exported_draft
    from medusa_train.tree.calibrate import greedy_continuations, heads_depths, measure_ranks, tokens_per_step

    model, tokenizer = load_exported_draft(str(heads), device=device)
    ranks = measure_ranks(model, greedy_continuations(model, tokenizer, ["Hello there!", "def add(a, b):", "One two"],
                                                      12), 10)
    for n in sizes:
        assert data["sizes"][str(n)]["expected_accept_length"] == pytest.approx(
            tokens_per_step(heads_depths(ranks, full[:n - 1])), abs=1e-4)
    tree = TokenTree.from_name(str(out), num_heads=3)
    assert tree.num_nodes == data["chosen_nodes"]
    assert sorted(tree.choices) == sorted(tuple(c) for c in full[:data["chosen_nodes"] - 1])
    assert f"chosen size: {data['chosen_nodes']} nodes" in printed
    assert "| nodes | lookup nodes | expected accepted length |" in printed


def test_the_cost_context_is_the_evaluations_mean_context(tmp_path):
    """auto: the evaluation benchmark's first turns through the chat template, plus half the answers' length."""
    tokenizer = load_tokenizer(str(make_model_dir(tmp_path / "model")))
    bench = tmp_path / "bench.jsonl"
    turns = [["Write a poem about the sea.", "Now shorter."], ["What is 2 + 2?"], ["Name three rivers in Europe."]]
    bench.write_text("".join(json.dumps({"turns": t}) + "\n" for t in turns))
    lengths = [prompt_tokens(tokenizer, t[0]) for t in turns]
    assert len(set(lengths)) > 1  # a mean of different lengths, not one prompt's
    cfg = BuildTreeConfig(exclude=str(bench), answer_tokens=64)
    assert cost_context(cfg, tokenizer, ["a calibration prompt"]) == round(sum(lengths) / 3 + 32)
    assert cost_context(BuildTreeConfig(exclude=str(bench), cost_context=100), tokenizer, []) == 100
    empty = tmp_path / "empty.jsonl"  # a benchmark with no prompts: the calibration prompts stand in
    empty.write_text("")
    calibration = ["Hello there!", "One two three four five"]
    expected = round(sum(prompt_tokens(tokenizer, p) for p in calibration) / 2 + 32)
    assert cost_context(BuildTreeConfig(exclude=str(empty), answer_tokens=64), tokenizer, calibration) == expected


def test_every_timed_step_leaves_the_decode_state_as_it_found_it():
    """The cost curve times each step from the same state, in any order: the backbone's cache and the heads'
    own (prefix attention) cache must come back exactly as they were (the benchmark's breakdown of a step:
    tests/benchmarks/test_steps.py)."""
    from helpers.heads import STEP_TREE, assert_steps_keep_decode_state, prefix_heads_model

    from medusa_train.tree.cost import DecodeSteps

    context = 24
    steps = DecodeSteps(prefix_heads_model(), context)
    tree = TokenTree(STEP_TREE)
    assert_steps_keep_decode_state(steps, context, (
        steps.plain_step, lambda: steps.plain_step(explicit_mask=True), steps.verify_step(tree),
        steps.verify_step(TokenTree([]))))


def test_the_cost_curve_is_made_nondecreasing_from_two_nodes_by_pooling_the_runs_timed_out_of_order():
    timed = {1: 45.0, 2: 44.0, 3: 47.0, 4: 50.0, 5: 53.0, 6: 47.0, 8: 55.0, 10: 54.0, 12: 61.0}
    fitted = nondecreasing(timed)
    # 1 -> 2 may truly fall (a one-row pass); 4, 5, 6 pool to their mean, then 8 and 10 to theirs
    assert fitted == pytest.approx({1: 45.0, 2: 44.0, 3: 47.0, 4: 50.0, 5: 50.0, 6: 50.0, 8: 54.5, 10: 54.5,
                                    12: 61.0})
    assert nondecreasing(fitted) == pytest.approx(fitted)  # a monotone curve is left as it is
    increasing = {n: 40.0 + n for n in (1, 2, 4, 8)}
    assert nondecreasing(increasing) == increasing


def test_a_size_timed_in_a_dip_is_expected_at_its_pooled_cost_not_its_dip():
    expected = {1: 1.0, 2: 1.3, 4: 1.45, 6: 1.55, 8: 1.6}
    dip = curve({1: 10.0, 2: 10.5, 4: 11.0, 6: 10.2, 8: 12.0})  # 6 nodes timed below 4: noise
    best, rows = choose_tree_size(dip, expected)
    cost = {r.nodes: r.verify_ms for r in rows}
    assert cost[4] == cost[6] == pytest.approx(10.6)  # pooled
    assert best == max(expected, key=lambda n: expected[n] / cost[n]) == 6
    chosen = next(r for r in rows if r.nodes == best)
    assert chosen.expected_speedup == pytest.approx(1.55 * 12.0 / 10.6)  # not 1.55 * 12 / 10.2


def test_the_first_round_screens_out_the_sizes_past_the_last_that_could_win():
    """A one-core demo's curve (AVX2 paths, float32, 2026-11-30): 8 nodes promise the most tokens per ms; with
    screen 2 every size up to the last reaching half of that (24 nodes: 2.690 / 104.1 >= 2.188 / 50.2 / 2) is timed
    in every round, 32 nodes (2.773 / 127.8, just under) and bigger once."""
    sizes = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128]
    first = dict(zip(sizes, [36.0, 39.6, 41.2, 41.9, 46.8, 46.0, 50.2, 58.5, 61.6, 75.8, 90.4, 104.1, 127.8, 180.6,
                             231.6, 410.6, 505.0]))
    expected = dict(zip(sizes, [1.0, 1.332, 1.583, 1.787, 1.886, 1.992, 2.188, 2.290, 2.371, 2.513, 2.621, 2.690,
                                2.773, 2.868, 2.928, 3.008, 3.055]))
    assert screened_sizes(first, expected, 2.0) == sizes[:12]
    assert screened_sizes(first, expected, 1.0) == sizes[:7]  # only the best and the sizes below it
    assert screened_sizes(first, expected, 100.0) == sizes  # a wide screen keeps all
    # a size under the floor between two above it is kept: what is kept is every size up to the last that reaches it
    assert screened_sizes({1: 10.0, 2: 10.0, 4: 40.0, 8: 20.0}, {1: 1.0, 2: 2.0, 4: 2.0, 8: 2.0}, 2.0) == [1, 2, 4, 8]
    flat = {n: 10.0 + 0.01 * n for n in sizes}  # a GPU's curve: nothing screened out
    assert screened_sizes(flat, expected, 2.0) == sizes


def test_the_sizes_screened_out_are_timed_once_and_the_rest_every_round():
    """On a real (small) model: with a screen every size past the last that could win is timed in the first round
    only, and recorded so; without one, every size every round."""
    from helpers.heads import STEP_TREE, prefix_heads_model

    from medusa_train.tree.cost import measure_cost_curve

    model = prefix_heads_model()
    trees = {n: TokenTree(STEP_TREE[:n - 1]) for n in (1, 2, 3, 4)}
    hopeless = {1: 1.0, 2: 1000.0, 3: 1e-6, 4: 1e-6}  # 2 nodes promise 1000x: 3 and 4 cannot reach half of it
    curve_ = measure_cost_curve(model, trees, context=16, repeats=3, warmup=1, expected=hopeless, screen=2.0)
    assert curve_.once == [3, 4] and sorted(curve_.verify_ms) == [1, 2, 3, 4]
    assert all(ms > 0 for ms in curve_.verify_ms.values())
    everything = measure_cost_curve(model, trees, context=16, repeats=3, warmup=1, expected=hopeless, screen=None)
    assert everything.once == [] and sorted(everything.verify_ms) == [1, 2, 3, 4]
