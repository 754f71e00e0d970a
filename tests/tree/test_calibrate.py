"""Tree building from measured head accuracies: the YAML, the node choice, the measurement, the script."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
import yaml
from helpers.training import make_model_dir

from medusa_train import MedusaModel, load_backbone
from medusa_train.cli.build_tree import build_build_tree_config, run
from medusa_train.config.check import ConfigError
from medusa_train.data.benchmarks import normalise_prompt
from medusa_train.decoding import TokenTree
from medusa_train.model.load import load_exported_draft
from medusa_train.tree.calibrate import (
    calibration_prompts,
    greedy_continuations,
    measure_rank_accuracies,
    training_prompts,
    write_tree,
)
from medusa_train.tree.fit import expected_accept_length

HAND_MADE = [  # [head][rank]
    [0.60, 0.20, 0.10],
    [0.50, 0.10, 0.05],
    [0.40, 0.01, 0.01],
]


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def test_builder_picks_the_most_likely_paths(tmp_path):
    path, choices = write_tree(tmp_path / "t.yaml", HAND_MADE, 5, 1.234, comments=["medusa-train build-tree"])
    # chances: [0] .6, [0,0] .3, [1] .2, [0,0,0] .12; next best ([2], [1,0]) are .1
    assert sorted(choices) == sorted([[0], [0, 0], [1], [0, 0, 0]])
    expected = 1.234  # the walk's figure, written as given
    text = path.read_text()
    assert text.startswith("# medusa-train build-tree\n")
    data = yaml.safe_load(text)
    assert data["expected_accept_length"] == pytest.approx(expected, abs=1e-4)
    assert data["rank_accuracies"] == HAND_MADE
    tree = TokenTree.from_name(str(path))
    assert tree.num_nodes == 5 and tree.depth == 3


@pytest.mark.parametrize("nodes", [1, 2, 16, 64])
def test_node_count_equals_nodes(tmp_path, nodes):
    rng = random.Random(nodes)
    accuracies = [sorted((rng.uniform(0.01, 0.5) for _ in range(10)), reverse=True) for _ in range(4)]
    path, choices = write_tree(tmp_path / "t.yaml", accuracies, nodes, 1.0)
    tree = TokenTree.from_name(str(path), num_heads=4)
    assert tree.num_nodes == nodes == len(choices) + 1
    # optimal: no path outside the tree is more likely than the least likely path inside it
    if choices:
        inside = min(expected_accept_length([c], accuracies) for c in choices)
        frontier = [c + [r] for c in [[]] + choices for r in range(10) if len(c) < 4 and c + [r] not in choices]
        assert inside >= max(expected_accept_length([f], accuracies) for f in frontier) - 1e-12


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    backbone, _ = load_backbone(str(make_model_dir(root / "model")), dtype="float32")
    return MedusaModel.from_backbone(backbone, num_heads=3).save_pretrained(root / "heads")


def write_prompts(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def test_rank_accuracies_line_up_with_tokens_k_plus_2_ahead(heads_dir, monkeypatch):
    """Heads that put the true token k+2 ahead at rank k must score exactly 1.0 at [k][k]."""
    model, tokenizer = load_exported_draft(heads_dir, device="cpu")
    sequences = greedy_continuations(model, tokenizer, ["Hello there!", "def add(a, b):"], 10)
    lookup = {}
    for ids, _ in sequences:
        with torch.no_grad():
            hidden = model(ids).hidden_states[0]
        for t in range(ids.shape[1]):
            lookup[tuple(hidden[t].tolist())] = (ids[0].tolist(), t)
    vocab = model.lm_head.weight.shape[0]

    def head_logits(hidden, k):
        rows = []
        for h in hidden.reshape(-1, hidden.shape[-1]):
            tokens, t = lookup[tuple(h.tolist())]
            order = [i for i in range(vocab) if i != tokens[t + k + 2]]
            order.insert(k, tokens[t + k + 2])
            logits = torch.empty(vocab)
            logits[order] = torch.arange(vocab, 0, -1, dtype=torch.float)
            rows.append(logits)
        return torch.stack(rows)

    monkeypatch.setattr(model, "head_logits", head_logits)
    accuracies, counts = measure_rank_accuracies(model, sequences, top_k=4)
    for k in range(3):
        assert accuracies[k] == [1.0 if i == k else 0.0 for i in range(4)]
        # positions from the last prompt token to the one whose target is the last token
        assert counts[k] == sum(ids.shape[1] - prompt_len - k - 1 for ids, prompt_len in sequences)


def test_calibration_prompts_skip_benchmark_and_long_prompts(heads_dir, tmp_path):
    _, tokenizer = load_exported_draft(heads_dir, device="cpu")
    bench = write_prompts(tmp_path / "bench.jsonl", ["Write a poem."])
    source = write_prompts(tmp_path / "calib.jsonl", ["Hello there!", "write a  POEM.", "word " * 300, "Bye", "More"])
    assert calibration_prompts(str(source), tokenizer, 2, 64, exclude=str(bench)) == ["Hello there!", "Bye"]
    assert calibration_prompts(str(source), tokenizer, 9, 64, exclude=None) == [
        "Hello there!", "write a  POEM.", "Bye", "More"]


def test_prompts_the_heads_were_trained_on_are_not_calibration_prompts(heads_dir, tmp_path):
    import shutil

    heads = tmp_path / "heads"
    shutil.copytree(heads_dir, heads)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "ok"}]})
                            + "\n" for q in ["hello  THERE!", "Bye"]))
    (heads / "training_config.json").write_text(json.dumps({"data": {"source": str(data), "max_samples": None}}))
    _, tokenizer = load_exported_draft(heads, device="cpu")
    seen = training_prompts(heads)
    assert seen == {normalise_prompt("Hello there!"), normalise_prompt("bye")}
    source = write_prompts(tmp_path / "calib.jsonl", ["Hello there!", "Bye", "More", "Again"])
    assert calibration_prompts(str(source), tokenizer, 2, 64, exclude=None, seen=seen) == ["More", "Again"]
    assert calibration_prompts(str(source), tokenizer, 2, 64, exclude=None) == ["Hello there!", "Bye"]
    assert training_prompts(heads_dir) == set()  # heads without a training_config.json


def test_script_run_writes_a_tree_evaluate_can_use(heads_dir, tmp_path, capsys):
    source = write_prompts(tmp_path / "calib.jsonl", ["Hello there!", "def add(a, b):", "The quick brown fox."])
    out = tmp_path / "tree.yaml"
    cfg = build_build_tree_config({"heads": str(heads_dir), "nodes": 8, "calibration": str(source),
                                   "num_prompts": 3, "max_new_tokens": 12, "exclude": None, "output": str(out),
                                   "device": "cpu"})
    result = run(cfg)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"expected accepted length: \d+\.\d{3} tokens per step \(walked over the calibration text\)", last)
    text = out.read_text()
    assert text.startswith(f"# medusa-train build-tree draft={heads_dir} nodes=8 calibration={source}")
    tree = TokenTree.from_name(str(out), num_heads=3)
    assert tree.num_nodes == len(result["choices"]) + 1 + result["lookup_depth"] <= 8
    assert tree.lookup_depth == result["lookup_depth"]
    assert len(result["rank_accuracies"]) == 3 and all(len(row) == 10 for row in result["rank_accuracies"])


def test_config_refuses_mt_bench_as_calibration(heads_dir):
    with pytest.raises(ConfigError) as err:
        build_build_tree_config({"heads": str(heads_dir), "calibration": "packaged:mt-bench", "nodes": 0})
    assert "calibration='packaged:mt-bench': MT-Bench is the evaluation set" in str(err.value)
    assert "nodes=0" in str(err.value)
