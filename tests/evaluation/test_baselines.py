"""The free baselines in every evaluation: HF generate greedy (the plain row) and HF prompt lookup, decoded
prompt by prompt beside the heads, every row counting tokens per target forward the same way."""

from __future__ import annotations

import pytest
from helpers.training import make_model_dir

from medusa_train import MedusaModel, load_backbone
from medusa_train.backbone.generation import encode_chat, plain_generate
from medusa_train.config.evaluate import BaselinesConfig
from medusa_train.data.benchmarks import BenchPrompt
from medusa_train.evaluation.evaluate import choose_prompt_lookup, evaluate
from medusa_train.evaluation.report import headline_lines, render_markdown

pytestmark = pytest.mark.usefixtures("one_thread")

# repetitive text gives prompt lookup n-grams to copy from
PROMPTS = [BenchPrompt("r", "extraction", ["the cat sat on the mat. the cat sat on the mat. the cat sat on the"]),
           BenchPrompt("w", "writing", ["Hello there! How are you today?", "Now say it again."])]
TREE = [[0], [1], [0, 0]]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("baselines")
    backbone, tokenizer = load_backbone(str(make_model_dir(root / "model")), dtype="float32")
    model = MedusaModel.from_backbone(backbone, num_heads=2)
    return model.eval(), tokenizer


def test_forwards_are_counted_by_the_backbone_itself(loaded):
    """``plain_generate`` counts the backbone's forward passes (a hook on it), so HF greedy makes one
    token per forward after the prefill, and prompt lookup never needs more forwards for the same tokens."""
    model, tokenizer = loaded
    ids = encode_chat(tokenizer, [{"role": "user", "content": PROMPTS[0].turns[0]}])
    plain, plain_t = plain_generate(model.backbone, ids, 24, [], tokenizer.pad_token_id)
    looked, lookup_t = plain_generate(model.backbone, ids, 24, [], tokenizer.pad_token_id, prompt_lookup=(5, 2))
    assert len(plain) == 24 and plain_t["forwards"] == 24  # the prefill gives the first, 23 forwards the rest
    assert looked == plain  # float32 greedy: lossless
    assert lookup_t["forwards"] <= plain_t["forwards"]


def test_every_row_counts_tokens_per_forward_after_the_prefill(loaded):
    model, tokenizer = loaded
    report = evaluate(model, tokenizer, PROMPTS, TREE, max_new_tokens=16, progress=False, warmup=False,
                      baselines=BaselinesConfig(prompt_lookup_num_tokens=5, prompt_lookup_ngram_size=2))
    rows, records = report["methods"], report["per_prompt"]
    assert list(rows) == ["plain", "prompt_lookup", "draft"]
    n = len(records)
    assert rows["plain"]["tokens_per_forward"] == 1.0  # exactly: HF greedy is one token per forward
    lookup_tokens = sum(r["prompt_lookup_new_tokens"] for r in records)
    lookup_forwards = sum(r["prompt_lookup_s"]["forwards"] - 1 for r in records)
    assert rows["prompt_lookup"]["tokens_per_forward"] == pytest.approx((lookup_tokens - n) / lookup_forwards)
    assert rows["draft"]["tokens_per_forward"] == report["mean_accepted_length"]
    # speedups divide by the same plain row; greedy outputs are compared with it
    for name in ("prompt_lookup", "draft"):
        assert rows[name]["speedup"] == pytest.approx(rows[name]["tokens_per_s"] / rows["plain"]["tokens_per_s"])
        assert rows[name]["outputs"] == {"compared": n, "identical": n}
    assert report["settings"]["prompt_lookup"] == {"num_tokens": 5, "max_matching_ngram_size": 2, "sweep": [],
                                                   "swept_on": 0}
    assert report["settings"]["plain_decoding"].startswith("HF transformers ")
    # no CUDA here: no graphs, so HF generate is the plain decoding every speedup divides by
    assert report["plain_reference"] == "plain" and report["settings"]["cuda_graphs"] is False
    assert report["plain_steadiness"]["method"] == "plain" and report["plain_steadiness"]["median_ms"] > 0
    assert set(report["settings"]["garbage_collections"]) == {"collections", "seconds", "total_s"}


def test_speedups_divide_by_the_faster_plain_decoding():
    """Where the graphed plain row ran (CUDA), every speedup divides by whichever plain row was faster."""
    from medusa_train.evaluation.summary import method_rows, plain_reference

    def record(plain_s: float, graphed_s: float) -> dict:
        timing = lambda s: {"wall_s": s, "decode_s": s * 0.9, "forwards": 11}  # noqa: E731
        return {"new_tokens": 11, "steps": 4, "draft_s": {"wall_s": 1.0, "decode_s": 0.9}, "match": True,
                "plain_new_tokens": 11, "plain_s": timing(plain_s), "prompt_lookup_s": None,
                "plain_graphed_new_tokens": 11, "plain_graphed_s": timing(graphed_s), "plain_graphed_match": True}

    for plain_s, graphed_s, reference in ((2.0, 1.0, "plain_graphed"), (1.0, 2.0, "plain")):
        rows = method_rows([record(plain_s, graphed_s)])
        assert plain_reference(rows) == reference and rows[reference]["speedup"] == 1.0
        assert rows["draft"]["speedup"] == pytest.approx(rows["draft"]["tokens_per_s"] / rows[reference]["tokens_per_s"])
        assert rows["plain_graphed"]["outputs"] == {"compared": 1, "identical": 1}


def test_the_first_lines_say_what_the_heads_buy_over_the_best_free_baseline(loaded):
    model, tokenizer = loaded
    report = evaluate(model, tokenizer, PROMPTS[:1], TREE, turns=1, max_new_tokens=12, progress=False, warmup=False,
                      baselines=BaselinesConfig(prompt_lookup_num_tokens=3, prompt_lookup_ngram_size=2))
    rows = report["methods"]
    line = headline_lines(report)[0]
    best = max(("plain", "prompt_lookup"), key=lambda k: rows[k]["tokens_per_s"])
    bought = rows["draft"]["tokens_per_s"] / rows[best]["tokens_per_s"]
    assert f"the heads buy {bought:.2f}x" in line
    assert ("plain decoding" if best == "plain" else "HF prompt lookup (N=3, ngram 2)") in line.split("best free")[1]
    markdown = render_markdown(report).splitlines()
    assert markdown[2] == f"**{line}**"  # right under the title
    assert any(row.startswith("| HF prompt lookup (N=3, ngram 2) |") for row in markdown)


def test_the_sweep_times_the_grid_and_keeps_the_fastest(loaded):
    model, tokenizer = loaded
    chosen = choose_prompt_lookup(model, tokenizer, PROMPTS, BaselinesConfig(prompt_lookup_ngram_size=3, sweep_prompts=1,
                                                                             sweep_max_new_tokens=8), [], 0)
    assert [(r["num_tokens"], r["max_matching_ngram_size"]) for r in chosen["sweep"]] == \
        [(3, 3), (5, 3), (10, 3)]  # a given setting fixes its half of the grid, the other half is swept
    odd = choose_prompt_lookup(model, tokenizer, PROMPTS, BaselinesConfig(prompt_lookup_num_tokens=4, sweep_prompts=1,
                                                                          sweep_max_new_tokens=8), [], 0)
    assert [(r["num_tokens"], r["max_matching_ngram_size"]) for r in odd["sweep"]] == [(4, 2), (4, 3)]
    best = max(chosen["sweep"], key=lambda r: r["tokens_per_s"])
    assert (chosen["num_tokens"], chosen["max_matching_ngram_size"]) == (best["num_tokens"], 3)
    assert chosen["swept_on"] == 1


def test_turning_prompt_lookup_off_leaves_two_rows(loaded):
    model, tokenizer = loaded
    report = evaluate(model, tokenizer, PROMPTS[:1], TREE, turns=1, max_new_tokens=6, progress=False, warmup=False,
                      baselines=BaselinesConfig(prompt_lookup=False))
    assert list(report["methods"]) == ["plain", "draft"] and report["settings"]["prompt_lookup"] is None


def test_a_plain_reference_timed_while_disturbed_is_named():
    """On an H200 the first evaluation in a process stepped its graphed plain decoding 7-10x slower on 2 of 8 prompts
    (two device calls alike; docs/results/gpu-2026-12-01): a speedup divided by it reads high, so the report names
    those prompts and its first lines say so; the second evaluation, steady, is not flagged."""
    import json
    from pathlib import Path

    from medusa_train.evaluation.summary import UNSTEADY, plain_steadiness

    measured = json.loads((Path(__file__).parents[2] / "docs/results/gpu-2026-12-01/per-prompt.json").read_text())
    flagged = {}
    for name, evaluation in measured["evaluations"].items():
        records = [{"id": p["id"], "turn": p["turn"], "plain_graphed_s": p["plain_graphed"]}
                   for p in evaluation["per_prompt"]]
        steadiness = plain_steadiness(records, "plain_graphed")
        flagged[name] = [u["id"] for u in steadiness["unsteady"]]
        step_ms = sorted(p["plain_graphed"]["decode_s"] * 1e3 / (p["plain_graphed"]["forwards"] - 1)
                         for p in evaluation["per_prompt"])
        assert steadiness["slowest_ms"] == pytest.approx(step_ms[-1])
        assert all(u["ms"] > UNSTEADY * steadiness["median_ms"] for u in steadiness["unsteady"])
        report = {"plain_steadiness": steadiness}
        warned = [line for line in headline_lines(report) if line.startswith("Warning: the plain reference")]
        assert len(warned) == bool(flagged[name])
    assert flagged == {"check/eval-0": ["81", "131"], "check/eval-1": [],
                       "check-again/eval-0": ["81", "131"], "check-again/eval-1": []}
    assert plain_steadiness([{"id": "1", "turn": 1, "plain_s": None}], "plain") is None  # the row did not run
    # a one-token reply has no decode step: left out, the others still checked
    records = [{"id": p["id"], "turn": p["turn"], "plain_graphed_s": p["plain_graphed"]}
               for p in measured["evaluations"]["check/eval-0"]["per_prompt"]]
    records.append({"id": "short", "turn": 1, "plain_graphed_s": {"decode_s": 0.0, "forwards": 1}})
    steadiness = plain_steadiness(records, "plain_graphed")
    assert steadiness["replies"] == len(records) - 1 and [u["id"] for u in steadiness["unsteady"]] == ["81", "131"]
