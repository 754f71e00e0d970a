"""evaluate: report numbers recomputed from per-prompt records, greedy parity, files, config, command line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT
from helpers.backbones import make_tiny_backbone
from helpers.training import make_model_dir

from medusa_train import MedusaModel, load_backbone
from medusa_train.cli.evaluate import build_eval_config, run
from medusa_train.config.check import ConfigError
from medusa_train.config.evaluate import default_output_dir
from medusa_train.data.benchmarks import BenchPrompt
from medusa_train.decoding import TokenTree, tree_generate
from medusa_train.evaluation.compare import first_difference, mismatch_detail, rounding_tolerance
from medusa_train.evaluation.evaluate import encode_chat, evaluate, plain_generate, resolve_tree
from medusa_train.evaluation.report import headline_lines, render_markdown

REQUIRED_KEYS = {"mean_accepted_length", "speedup", "mismatches", "per_head_acceptance", "per_category",
                 "tokens_per_s", "settings", "per_prompt"}
PROMPTS = [
    BenchPrompt("a", "writing", ["Hello there! How are you today?", "Now say it again."]),
    BenchPrompt("b", "coding", ["def add(a, b):", "And subtract?"]),
    BenchPrompt("c", "writing", ["The quick brown fox."]),  # one turn only
]
TREE = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory) -> Path:
    """A tiny Llama folder (ChatML BPE tokenizer) and 3 heads for it, perturbed so they differ from the LM head."""
    root = tmp_path_factory.mktemp("eval")
    model_dir = make_model_dir(root / "model")
    backbone, _ = load_backbone(str(model_dir), dtype="float32")
    model = MedusaModel.from_backbone(backbone, num_heads=3)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model.save_pretrained(root / "run" / "export")


@pytest.fixture(scope="module")
def loaded(heads_dir):
    from medusa_train.model.load import load_exported_draft

    return load_exported_draft(heads_dir, device="cpu")


def test_report_numbers_recompute_from_per_prompt(loaded):
    model, tokenizer = loaded
    report = evaluate(model, tokenizer, PROMPTS, TREE, max_new_tokens=12, progress=False)
    rows = report["per_prompt"]
    assert [(r["id"], r["turn"]) for r in rows] == [("a", 1), ("a", 2), ("b", 1), ("b", 2), ("c", 1)]
    tokens, steps = sum(r["new_tokens"] for r in rows), sum(r["steps"] for r in rows)
    # tokens after each reply's first per target forward after its prefill; the decoder's own count kept beside
    assert report["mean_accepted_length"] == pytest.approx((tokens - len(rows)) / steps)
    depths = [d for r in rows for d in r["accepted_depths"]]
    assert report["tokens_per_verify_step"] == pytest.approx(sum(1 + d for d in depths) / steps)  # the tree fit's count
    assert all(sum(r["accept_lengths"]) == r["new_tokens"] and len(r["accept_lengths"]) == r["steps"] for r in rows)
    assert sum(report["accept_length_histogram"].values()) == steps
    assert report["per_head_acceptance"] == pytest.approx([sum(d > k for d in depths) / steps for k in range(3)])
    assert report["per_head_acceptance"] == sorted(report["per_head_acceptance"], reverse=True)
    # plain decoding is the reference: greedy Medusa reproduces it token for token
    assert report["mismatches"] == 0 and report["mismatch_details"] == []
    assert report["mismatches_unexplained"] == 0 and report["mismatches_at_rounding"] == 0
    assert all(r["match"] and r["plain_new_tokens"] == r["new_tokens"] for r in rows)
    cats = report["per_category"]
    assert {c: v["count"] for c, v in cats.items()} == {"coding": 2, "writing": 3}
    writing = [r for r in rows if r["category"] == "writing"]
    assert cats["writing"]["accepted_length"] == pytest.approx(
        (sum(r["new_tokens"] for r in writing) - len(writing)) / sum(r["steps"] for r in writing))
    medusa_tps = tokens / sum(r["draft_s"]["wall_s"] for r in rows)
    plain_tps = sum(r["plain_new_tokens"] for r in rows) / sum(r["plain_s"]["wall_s"] for r in rows)
    assert report["tokens_per_s"] == pytest.approx({"draft": medusa_tps, "plain": plain_tps})
    assert report["speedup"] == pytest.approx(medusa_tps / plain_tps)
    assert report["settings"]["tree_nodes"] == len(TREE) + 1 and report["settings"]["max_new_tokens"] == 12



def test_an_eagle3_drafts_rows_name_the_draft_not_heads(loaded):
    """The report asks the model what its guesses come from: evaluating an EAGLE-3 draft, the decoder's row says
    the draft (a reader of 'with the heads' would think Medusa heads were measured), and its greedy output is plain's."""
    from medusa_train.families.eagle3.model import Eagle3Model

    _, tokenizer = loaded
    backbone = make_tiny_backbone(vocab_size=len(tokenizer), layers=4)  # three distinct layers to read
    backbone.config.pad_token_id, backbone.config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    draft = Eagle3Model.from_backbone(backbone, aux_layer_ids=[0, 1, 3], ttt_steps=2)
    report = evaluate(draft, tokenizer, PROMPTS[:1], [[0], [0, 0]], turns=1, max_new_tokens=8, progress=False)
    assert report["methods"]["draft"]["decodes_with"] == "medusa-train tree decoder with the EAGLE-3 draft"
    assert report["mismatches"] == 0
    assert "| draft | medusa-train tree decoder with the EAGLE-3 draft |" in render_markdown(report)
    assert "the EAGLE-3 draft buys" in headline_lines(report)[0] and "heads" not in headline_lines(report)[0]

def test_a_head_the_tree_never_reaches_is_reported_as_untried_not_as_never_right(loaded):
    """A 2-deep tree over 3 heads: acceptance for heads 1-2, each recomputed; head 3 was never tried, so the report
    lists no figure for it (a 0.000 would read as a head that is always wrong) and says why."""
    model, tokenizer = loaded
    report = evaluate(model, tokenizer, PROMPTS[:1], [[0], [1], [0, 0]], turns=1, max_new_tokens=12, progress=False)
    depths = [d for r in report["per_prompt"] for d in r["accepted_depths"]]
    steps = sum(r["steps"] for r in report["per_prompt"])
    assert report["per_head_acceptance"] == pytest.approx([sum(d > k for d in depths) / steps for k in range(2)])
    markdown = render_markdown(report)
    assert "| head | 1 | 2 |" in markdown
    assert "\nThe heads on `" in markdown  # what decoded, named (was "Heads `?`")
    report["settings"]["draft_folder"] = "runs/x/export"  # as `medusa-train evaluate draft=runs/x/export` records it
    assert "\nThe heads `runs/x/export` on `" in render_markdown(report)
    assert "Heads 3 of 3: not in the tree (its depth is 2), never tried." in markdown

def test_a_tree_with_a_lookup_chain_is_reported_with_each_branch_alone(loaded):
    """Heads and lookup in one tree: the heads' nodes alone and the chain alone are decoded on the same prompts in
    the same run, each row recomputes from the records, every output equals plain decoding's, and the report labels
    the hybrid and both branches, per category too."""
    model, tokenizer = loaded
    report = evaluate(model, tokenizer, PROMPTS, {"choices": TREE, "lookup_depth": 3}, max_new_tokens=12,
                      progress=False, warmup=False)
    rows, methods = report["per_prompt"], report["methods"]
    assert list(methods) == ["plain", "prompt_lookup", "draft_only", "lookup_chain", "draft"]
    assert "lookup chain in one tree" in methods["draft"]["decodes_with"]
    for name in ("draft_only", "lookup_chain"):
        tokens, steps = sum(r[name]["new_tokens"] for r in rows), sum(r[name]["steps"] for r in rows)
        assert methods[name]["tokens_per_forward"] == pytest.approx((tokens - len(rows)) / steps)
        assert methods[name]["speedup"] == pytest.approx(
            tokens / sum(r[name]["wall_s"] for r in rows) / methods["plain"]["tokens_per_s"])
        assert methods[name]["outputs"] == {"compared": len(rows), "identical": len(rows)}
    assert report["mismatches"] == 0 and all(len(r["lookup_depths"]) == r["steps"] for r in rows)
    depths = [d for r in rows for d in r["lookup_depths"]]
    assert report["lookup_acceptance"] == pytest.approx(
        [sum(d > i for d in depths) / report["totals"]["steps"] for i in range(max(depths, default=0))])
    assert report["settings"]["tree_nodes"] == len(TREE) + 1 + 3 and report["settings"]["lookup_depth"] == 3
    # TensorRT-LLM's static tree has no lookup chain: it would accept what the heads' nodes alone do
    assert report["engines"]["trtllm"]["mean_accepted_length"] == methods["draft_only"]["tokens_per_forward"]
    assert report["engines"]["native"]["mean_accepted_length"] == report["mean_accepted_length"]
    assert set(report["per_category"]["writing"]) >= {"draft_only_speedup", "lookup_chain_tokens_per_forward"}
    markdown = render_markdown(report)
    assert "the heads and lookup chain in one tree" in markdown and "the heads alone" in markdown
    assert "| category | count | accepted length | speedup | draft alone | our lookup chain alone |" in markdown
    plain_tree = evaluate(model, tokenizer, PROMPTS[:1], TREE, max_new_tokens=8, progress=False, warmup=False)
    assert "draft_only" not in plain_tree["methods"] and plain_tree["lookup_acceptance"] is None


def install_oracle_heads(monkeypatch, model, tokenizer, prompts, max_new_tokens):
    """Heads that know the greedy answer to each prompt's first turn: at a hidden state of that answer,
    head k puts the true token k + 2 ahead first (elsewhere they keep their own guesses)."""
    eos = [model.backbone.config.eos_token_id]
    hiddens, targets = [], []
    for prompt in prompts:
        ids = encode_chat(tokenizer, [{"role": "user", "content": prompt.turns[0]}])
        new, _ = plain_generate(model.backbone, ids, max_new_tokens, eos, tokenizer.pad_token_id)
        seq = torch.cat([ids[0], torch.tensor(new)])
        with torch.no_grad():
            hiddens.append(model(seq[None]).hidden_states[0])
        targets += [[seq[t + k + 2].item() if t + k + 2 < len(seq) else None for k in range(model.num_heads)]
                    for t in range(len(seq))]
    reference = torch.cat(hiddens)
    own = model.head_logits

    def head_logits(hidden, k):
        logits = own(hidden, k).clone()
        flat = logits.view(-1, logits.shape[-1])
        dist, pos = torch.cdist(hidden.reshape(-1, hidden.shape[-1]), reference,
                                compute_mode="donot_use_mm_for_euclid_dist").min(-1)
        for row, (d, j) in enumerate(zip(dist.tolist(), pos.tolist())):
            if d < 1e-3 and targets[j][k] is not None:
                flat[row, targets[j][k]] = flat[row].max() + 1
        return logits

    monkeypatch.setattr(model, "head_logits", head_logits)


def test_without_branches_a_lookup_chain_tree_is_decoded_alone_and_still_lossless(loaded):
    """``branches=False``: the hybrid tree, plain decoding and prompt lookup on every prompt, neither branch alone; the
    tree's output is still plain greedy and its lookup acceptance still counted."""
    model, tokenizer = loaded
    report = evaluate(model, tokenizer, PROMPTS[:2], {"choices": TREE, "lookup_depth": 3}, max_new_tokens=12,
                      progress=False, warmup=False, branches=False)
    assert list(report["methods"]) == ["plain", "prompt_lookup", "draft"]
    assert all("draft_only" not in r and "lookup_chain" not in r for r in report["per_prompt"])
    assert report["mismatches"] == 0 and report["lookup_acceptance"] is not None
    assert "with the heads and the lookup chain in one tree" in report["methods"]["draft"]["decodes_with"]
    assert "the heads and lookup chain in one tree" in headline_lines(report)[0]  # named as what it is, without branches


def test_long_accepted_paths_stay_lossless(loaded, monkeypatch):
    model, tokenizer = loaded
    install_oracle_heads(monkeypatch, model, tokenizer, PROMPTS, 16)
    report = evaluate(model, tokenizer, PROMPTS, TREE, turns=1, max_new_tokens=16, warmup=False, progress=False)
    rows = report["per_prompt"]
    assert report["mismatches"] == 0
    assert report["mean_accepted_length"] == pytest.approx((sum(r["new_tokens"] for r in rows) - len(rows)) /
                                                           sum(r["steps"] for r in rows))
    assert report["mean_accepted_length"] > 3  # the chain [0, 0, 0] is taken almost every step
    assert report["per_head_acceptance"][2] > 0.5


def test_turns_one_and_limit(loaded):
    model, tokenizer = loaded
    report = evaluate(model, tokenizer, PROMPTS, "chain", turns=1, limit=2, max_new_tokens=6, warmup=False,
                      progress=False)
    assert [(r["id"], r["turn"]) for r in report["per_prompt"]] == [("a", 1), ("b", 1)]
    assert report["settings"]["tree_depth"] == 3  # chain is built for the model's 3 heads


def test_sampling_reports_no_mismatch_count(loaded):
    model, tokenizer = loaded
    report = evaluate(model, tokenizer, PROMPTS[:1], TREE, turns=1, max_new_tokens=6, temperature=0.8,
                      acceptance="rejection", warmup=False, progress=False)
    assert report["mismatches"] is None and report["per_prompt"][0]["match"] is None
    assert report["settings"]["sampling"] is True


def test_mismatch_detail_describes_the_base_models_choice(loaded):
    model, tokenizer = loaded
    ids = encode_chat(tokenizer, [{"role": "user", "content": "Hello there!"}])
    plain, _ = plain_generate(model.backbone, ids, 8, [], tokenizer.pad_token_id)
    other = plain[:3] + [(plain[3] + 1) % len(tokenizer)] + plain[4:]
    assert first_difference(plain, plain) is None
    assert first_difference(plain, other) == 3 and first_difference(plain, plain[:5]) == 5
    detail = mismatch_detail(model, ids, plain, other, 3)
    assert detail["position"] == 3 and detail["plain_token"] == plain[3] and detail["draft_token"] == other[3]
    assert detail["top2_gap"] >= 0 and detail["plain_minus_draft_logit"] >= 0  # plain's token is the argmax
    # float32: the tree pass must reproduce one-token decoding exactly, so no difference is rounding
    assert detail["tolerance"] == 0.0 and detail["kind"] == "unexplained"


def test_a_reply_that_ended_chose_its_stop_token_there():
    """Servers return replies without their stop token: where one reply ended and the other goes on, the ended one
    chose the likeliest stop token, which is a near-tie like any other (bf16 here), or a real difference."""
    from medusa_train.evaluation.compare import classify_at

    logits = torch.zeros(8)
    logits[3], logits[7], logits[6] = 10.0, 9.95, 2.0  # token 3 best, stop token 7 within rounding, stop token 6 far
    raw = logits.bfloat16()
    plain, ended = [5, 3, 4], [5]
    detail = classify_at(raw, plain, ended, 1, stop_ids=[6, 7])
    assert (detail["plain_token"], detail["draft_token"], detail["kind"]) == (3, 7, "at_rounding")
    assert classify_at(raw, plain, ended, 1)["kind"] == "unexplained"  # no stop ids: no token to weigh
    assert classify_at(raw, plain, ended, 1, stop_ids=[6])["kind"] == "unexplained"  # the stop far from the best
    assert classify_at(raw, ended, plain, 1, stop_ids=[6, 7])["plain_token"] == 7  # either side may have ended


def test_rounding_tolerance_is_two_spacings_of_the_dtype_at_the_largest_logit():
    logits = torch.tensor([1.0, -10.0, 3.0])
    assert rounding_tolerance(logits, torch.bfloat16) == 2 * 2**-7 * 10.0
    assert rounding_tolerance(logits, torch.float16) == 2 * 2**-10 * 10.0
    assert rounding_tolerance(logits, torch.float32) == 0.0


def test_resolve_tree():
    assert resolve_tree("chain", 2) == TokenTree([[0], [0, 0]])
    with pytest.warns(UserWarning, match="tree=default is 4 deep"):
        assert resolve_tree("default", 2).depth == 2
    with pytest.raises(ValueError, match=r"needs \d heads but num_heads=2"):
        resolve_tree(str(ROOT / "configs" / "tree" / "chain.yaml"), 2)


def write_bench(path: Path) -> Path:
    lines = [{"turns": p.turns, "category": p.category, "id": p.id} for p in PROMPTS]
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    return path


def test_run_writes_report_files_and_prints_headline_last(heads_dir, tmp_path, capsys):
    cfg = build_eval_config({"heads": str(heads_dir), "tree": "default",
                             "bench": {"source": str(write_bench(tmp_path / "bench.jsonl")), "limit": 2},
                             "generation": {"max_new_tokens": 8}, "output_dir": str(tmp_path / "out"),
                             "device": "cpu", "progress": False})
    with pytest.warns(UserWarning, match="tree=default"):  # default is 4 deep, the heads 3
        run(cfg)
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"mean accepted length: \d+\.\d\d", lines[-2])
    assert re.fullmatch(r"speedup: \d+\.\d\dx", lines[-1])
    for name in ("report.json", "report.md", "report.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert REQUIRED_KEYS <= set(report)
    assert set(report["tokens_per_s"]) == {"draft", "plain"}
    assert report["mismatches"] == 0 and len(report["per_prompt"]) == 4
    assert f"{report['mean_accepted_length']:.2f}" in lines[-2]
    assert "| writing |" in (tmp_path / "out" / "report.md").read_text()
    assert report["written_by"] == "medusa-train evaluate"  # its mark: the next run into out/ may replace them


def test_report_files_evaluate_did_not_write_are_refused_before_any_work(heads_dir, tmp_path):
    """Issue 57: an output_dir holding someone's report.md is refused at the config check, the file kept."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.md").write_text("# my notes\n")
    with pytest.raises(ConfigError, match=r"holds report\.md, which evaluate did not write; nothing was changed"):
        build_eval_config({"heads": str(heads_dir), "output_dir": str(mine)})
    assert (mine / "report.md").read_text() == "# my notes\n"


def test_config_errors_are_reported_together(tmp_path):
    with pytest.raises(ConfigError) as err:
        build_eval_config({"heads": str(tmp_path), "tree": "nope", "model": {"dtype": "int3", "chat_template": "no.jinja"},
                           "bench": {"turns": 0, "source": str(tmp_path / "none.jsonl")},
                           "generation": {"max_new_tokens": 0, "acceptance": "maybe"}, "colour": "red"})
    text = str(err.value)
    for key in ("draft=", "tree=nope", "model.dtype='int3'", "model.chat_template='no.jinja'", "bench.turns=0", "bench.source=",
                "generation.max_new_tokens=0", "generation.acceptance='maybe'", "colour: unknown key"):
        assert key in text, key
    with pytest.raises(ConfigError, match="draft: required"):
        build_eval_config({})


def test_command_line_names():
    from omegaconf import OmegaConf

    from medusa_train.config.compose import compose_config

    # draft= and tree= are plain keys of the command's own config root, not training's config groups
    OmegaConf.register_new_resolver("default_output_dir", default_output_dir, replace=True)
    raw = compose_config("evaluate", ["draft=/x/run/export", "tree=t.yaml", "bench.limit=2"])
    assert (raw.draft, raw.tree, raw.bench.limit) == ("/x/run/export", "t.yaml", 2)
    assert raw.output_dir == os.path.join("outputs", "eval", "run")
    assert default_output_dir("/runs/medusa1/export") == os.path.join("outputs", "eval", "medusa1")
    assert default_output_dir("/runs/my-heads") == os.path.join("outputs", "eval", "my-heads")


@pytest.mark.integration
def test_script_with_a_tree_file(heads_dir, tmp_path):
    tree = tmp_path / "tree.yaml"
    tree.write_text("# test\nchoices: [[0], [1], [0, 0]]\n")
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "scripts" / "evaluate.py"), f"heads={heads_dir}", f"tree={tree}",
           f"bench.source={write_bench(tmp_path / 'bench.jsonl')}", "bench.limit=1", "bench.turns=1",
           "generation.max_new_tokens=6", f"output_dir={out}", "progress=false", "threads=1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1].startswith("speedup: ")
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["tree_nodes"] == 4 and report["settings"]["tree"] == str(tree)


def test_the_vllm_row_is_decoding_with_a_rank0_chain_of_every_head(loaded, heads_dir):
    """vLLM and TGI propose a top-1 chain of plain heads: their row must be our decoder's accepted length
    with a ``num_heads``-long rank-0 chain on the very inputs the evaluation decoded."""
    from medusa_train.backbone.generation import encode_chat, eos_token_ids

    model, tokenizer = loaded
    report = evaluate(model, tokenizer, PROMPTS, TREE, turns=1, max_new_tokens=12, progress=False)
    engines = report["engines"]
    assert list(engines) == ["vllm", "tgi", "trtllm", "native"]
    tokens = steps = 0
    for prompt in PROMPTS:  # first turns only: the inputs are the chat-encoded questions
        ids = encode_chat(tokenizer, [{"role": "user", "content": prompt.turns[0]}])
        out = tree_generate(model, ids, TokenTree.chain(3), max_new_tokens=12,
                              eos_token_id=eos_token_ids(model.backbone))
        tokens, steps = tokens + out.new_tokens - 1, steps + out.steps
    assert engines["vllm"]["mean_accepted_length"] == pytest.approx(tokens / steps)
    assert engines["tgi"]["mean_accepted_length"] == engines["vllm"]["mean_accepted_length"]
    assert engines["trtllm"]["mean_accepted_length"] == engines["native"]["mean_accepted_length"] \
        == report["mean_accepted_length"]
    assert "| vllm | top-1 chain" in render_markdown(report)


def test_heads_only_our_decoder_loads_get_no_engine_figure_and_say_why(loaded):
    from medusa_train.evaluation.engines import engine_rows

    model, _ = loaded
    reading = MedusaModel.from_backbone(model.backbone, num_heads=3, next_token_input=True)
    rows = engine_rows(reading, [], TokenTree.chain(3), 1.5, 8, [])
    for name in ("vllm", "tgi", "trtllm"):
        assert rows[name]["mean_accepted_length"] is None
        assert "read the next token's embedding (heads.next_token_input)" in rows[name]["reason"]
    assert rows["native"] == {"mean_accepted_length": 1.5, "verifies": rows["native"]["verifies"], "reason": None}


@pytest.mark.parametrize("command", ["evaluate", "build_tree", "choose_k", "export"])
def test_heads_is_drafts_other_name_on_every_command_that_reads_a_draft(command, tmp_path):
    """``heads=`` (the key's first name) reads as ``draft=``; both given and different is an error naming both."""
    import importlib

    from omegaconf import OmegaConf

    from medusa_train.config.compose import compose_config
    from medusa_train.config.paths import take_draft_alias

    OmegaConf.register_new_resolver("default_output_dir", default_output_dir, replace=True)
    schema = {"evaluate": "EvalConfig", "build_tree": "BuildTreeConfig", "choose_k": "ChooseKConfig",
              "export": "ExportConfig"}[command]
    cls = getattr(importlib.import_module(f"medusa_train.config.{command}"), schema)
    for given in (["heads=/x/run/export"], ["draft=/x/run/export"], ["heads=/x/run/export", "draft=/x/run/export"]):
        raw = OmegaConf.to_container(compose_config(command, given), resolve=True)
        c = cls(**{k: v for k, v in raw.items() if k in ("draft", "heads")})
        assert take_draft_alias(c) == [] and (c.draft, c.heads) == ("/x/run/export", None), given
    c = cls(draft="/a/export", heads="/b/export")
    assert take_draft_alias(c) == ["heads=/b/export and draft=/a/export: heads= is draft='s other name; give one"]
    if command == "evaluate":  # and the output folder is named after it either way
        assert compose_config(command, ["heads=/x/run/export"]).output_dir == os.path.join("outputs", "eval", "run")


def test_an_evaluation_sized_to_its_time_decodes_its_first_prompts_with_every_method_and_says_so(loaded):
    """``max_minutes`` stops starting prompts (the first always runs, all its turns, every method on it): the report
    holds the first prompts only and says how many of how many; without a budget every prompt runs."""
    model, tokenizer = loaded
    sized = evaluate(model, tokenizer, PROMPTS, TREE, max_new_tokens=8, progress=False, max_minutes=1e-9)
    assert [(r["id"], r["turn"]) for r in sized["per_prompt"]] == [("a", 1), ("a", 2)]
    assert sized["prompts"] == {"decoded": 1, "offered": 3, "max_minutes": 1e-9, "stopped_at_max_minutes": True}
    assert all(r["prompt_lookup_s"] is not None and r["match"] for r in sized["per_prompt"])
    assert "1 of 3 (the rest not started: max_minutes=1e-09 spent) prompts" in render_markdown(sized)
    whole = evaluate(model, tokenizer, PROMPTS, TREE, max_new_tokens=8, progress=False)
    assert whole["prompts"]["decoded"] == 3 and not whole["prompts"]["stopped_at_max_minutes"]
    assert whole["per_prompt"][:2] == [{**r, "draft_s": w["draft_s"], "plain_s": w["plain_s"],
                                        "prompt_lookup_s": w["prompt_lookup_s"], "at_s": w["at_s"]}
                                       for r, w in zip(sized["per_prompt"], whole["per_prompt"][:2])]
