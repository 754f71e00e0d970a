"""``medusa-train choose-k``: its config composes and is checked (K within the heads' count, every problem with its
key), and what it does with the measured rows: the fastest K kept, ``serving.json`` written whole and read back by
the serve line ``medusa-train export`` prints. The served sweep itself (one vLLM server per K, ~90 s each on a CPU)
is not run here: the rows are the demo's measured ones (docs/results.md, K chosen by measurement)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT
from helpers.training import make_model_dir

from medusa_train.cli.choose_k import build_choose_k_config
from medusa_train.cli.main import COMMANDS, usage
from medusa_train.config.check import ConfigError
from medusa_train.config.choose_k import ChooseKConfig
from medusa_train.config.compose import compose_config
from medusa_train.evaluation.choose_k import (
    SERVING_NAME,
    choose,
    format_row,
    ks_to_serve,
    serving_record,
    verdict,
    vllm_export,
    with_earlier,
    write_json,
)
from medusa_train.export.serve import serve_command

# docs/results.md's sweep on the demo's heads (bf16, 16 MT-Bench first turns, 2-core CPU)
ROWS = [{"k": 0, "startup_s": 88.0, "tokens_per_s": 22.6, "tokens_per_s_c8": 142.4, "mean_acceptance_length": None,
         "per_position_acceptance": [], "tokens": 2048},
        {"k": 1, "startup_s": 91.0, "tokens_per_s": 23.7, "tokens_per_s_c8": 139.2, "mean_acceptance_length": 1.234,
         "per_position_acceptance": [0.234], "tokens": 2048},
        {"k": 2, "startup_s": 93.0, "tokens_per_s": 20.1, "tokens_per_s_c8": 103.7, "mean_acceptance_length": 1.271,
         "per_position_acceptance": [0.236, 0.035], "tokens": 2048}]
SETTINGS = {"dtype": "bfloat16", "limit": 16, "max_tokens": 128, "concurrency": 8, "benchmark": "packaged:mt-bench"}


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """``(native heads folder, its vllm export)``: two heads with their own output layers on a tiny saved backbone."""
    from medusa_train import MedusaModel, load_backbone
    from medusa_train.export.write import export_folder

    root = tmp_path_factory.mktemp("choose_k")
    backbone, _ = load_backbone(make_model_dir(root / "model"), dtype="float32")
    MedusaModel.from_backbone(backbone, 2, 1, share_lm_head=False, dtype="float32").save_pretrained(root / "native")
    return root / "native", export_folder(root / "native", root / "vllm", "vllm")


def test_the_fastest_k_at_concurrency_1_is_kept_and_the_serve_line_uses_it(heads):
    _, export = heads
    best, plain, faster = choose(ROWS)
    assert (best["k"], plain["k"], faster) == (1, 0, True)
    record = serving_record(ROWS, SETTINGS, "base", export, "test CPU, 2 cores")
    assert record["recommended_num_speculative_tokens"] == record["fastest_num_speculative_tokens"] == 1
    assert record["rows"] == ROWS and record["settings"] == SETTINGS and record["export"] == str(export)
    write_json(export / SERVING_NAME, record)
    assert json.loads((export / SERVING_NAME).read_text()) == record
    assert not [p.name for p in export.iterdir() if p.name.endswith(".tmp")]

    line = serve_command(export)
    spec = json.loads(line.split("--speculative-config '", 1)[1].split("'", 1)[0])
    assert spec == {"method": "medusa", "model": str(export.resolve()), "num_speculative_tokens": 1}
    assert "--dtype bfloat16 " in line and "K=1: the fastest of K=1, K=2 measured on test CPU, 2 cores" in line
    # the line names the K that were served, not every K the heads allow
    write_json(export / SERVING_NAME, serving_record(ROWS[:2], SETTINGS, "base", export, "test CPU, 2 cores"))
    assert "K=1: the fastest of K=1 measured on" in serve_command(export)
    write_json(export / SERVING_NAME, record)
    assert verdict(record) == "fastest at concurrency 1: K=1 (23.7 tokens/s, 1.05x without speculation)"
    assert format_row({**ROWS[1], "tokens_per_step": 1.2}, 8) == (
        "K=1: 23.7 tokens/s at concurrency 1, 139.2 at 8; 1.200 tokens per step (vLLM's acceptance length per "
        "drafted step 1.234); start-up 91 s")
    assert "- tokens per step (vLLM's acceptance length per drafted step -)" in format_row(ROWS[0], 8)
    # where the engine clocks its steps, the line says what a step took, and the verdict why the kept K is faster
    assert format_row({**ROWS[1], "tokens_per_step": 1.2, "step_ms": 42.5}, 8).endswith(
        "drafted step 1.234); a step 42.5 ms; start-up 91 s")
    timed = [dict(ROWS[0], step_ms=44.2, tokens_per_step=1.0), dict(ROWS[1], step_ms=50.8, tokens_per_step=1.2),
             ROWS[2]]
    assert verdict(serving_record(timed, SETTINGS, "base", export, "cpu")) == (
        "fastest at concurrency 1: K=1 (23.7 tokens/s, 1.05x without speculation: 1.200 tokens per step, a step "
        "1.15x the plain one)")


def test_when_no_k_beats_serving_without_speculation_none_is_recommended(heads):
    _, export = heads
    rows = [dict(ROWS[0], tokens_per_s=30.0), *ROWS[1:]]
    record = serving_record(rows, SETTINGS, "base", export, "cpu")
    assert (record["recommended_num_speculative_tokens"], record["fastest_num_speculative_tokens"]) == (None, 1)
    assert verdict(record).startswith("no K beats serving without speculation here (best K=1: 0.79x)")
    write_json(export / SERVING_NAME, record)
    assert "no K is faster than serving" in serve_command(export)
    # without a K=0 row the fastest K is recommended; with no K >= 1 there is nothing to choose
    assert serving_record(ROWS[1:], SETTINGS, "base", export, "cpu")["recommended_num_speculative_tokens"] == 1
    with pytest.raises(ValueError, match="no K >= 1"):
        choose(ROWS[:1])


def test_serving_json_is_replaced_whole_or_not_at_all(tmp_path):
    path = write_json(tmp_path / SERVING_NAME, {"recommended_num_speculative_tokens": 2, "rows": []})
    with pytest.raises(TypeError):
        write_json(path, {"rows": [object()]})  # fails half-way through the JSON
    assert json.loads(path.read_text()) == {"recommended_num_speculative_tokens": 2, "rows": []}
    assert os.listdir(tmp_path) == [SERVING_NAME]


def test_a_run_on_other_prompts_keeps_the_earlier_runs_record_and_the_newest_decides(heads):
    """A second choose-k on the same export (MT-Bench after the validation prompts) replaced serving.json whole
    before: the first run's figures were lost. Each other benchmark's newest record stays under ``earlier``."""
    _, export = heads
    validation = serving_record(ROWS, {**SETTINGS, "benchmark": "validation"}, "base", export, "cpu")
    mt_bench = serving_record(ROWS[:2], SETTINGS, "base", export, "cpu")
    kept = with_earlier(mt_bench, validation)
    assert kept["earlier"] == {"validation": validation}
    assert {key: value for key, value in kept.items() if key != "earlier"} == mt_bench
    write_json(export / SERVING_NAME, kept)
    assert "K=1: the fastest of K=1 measured on" in serve_command(export)  # the newest run's K values
    # validation again: its own record is replaced, MT-Bench's kept; the same prompts twice keep nothing
    again = serving_record(ROWS[1:], {**SETTINGS, "benchmark": "validation"}, "base", export, "cpu")
    assert with_earlier(again, kept)["earlier"] == {"packaged:mt-bench": mt_bench}
    assert with_earlier(mt_bench, mt_bench) == mt_bench == with_earlier(mt_bench, None)
    write_json(export / SERVING_NAME, validation)


def test_an_output_file_choose_k_did_not_write_is_refused_before_any_server_starts(heads, tmp_path):
    """Issue 57: ``output=`` naming someone's file is a config problem; the file is kept."""
    _, export = heads
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}')
    with pytest.raises(ConfigError) as err:
        build_choose_k_config(compose_config("choose_k", [f"draft={export}", f"output={notes}"]))
    assert err.value.problems == [f"output={notes}: exists and is not a record choose-k wrote; nothing was changed: "
                                  "choose another output= (or move the file away)"]
    with pytest.raises(ValueError, match="is not a record choose-k wrote"):
        write_json(notes, {"rows": []})
    assert notes.read_text() == '{"mine": true}'


def test_ks_default_to_every_k_from_no_speculation_to_every_head():
    assert ks_to_serve(None, 3) == [0, 1, 2, 3]
    assert ks_to_serve([2, 0], 3) == [2, 0]


def test_heads_not_in_the_vllm_layout_are_exported_beside_them(heads):
    native, export = heads
    assert vllm_export(ChooseKConfig(draft=str(export))) == export
    written = vllm_export(ChooseKConfig(draft=str(native), dtype="float32"))
    assert written == native.parent / "vllm-export-float32"
    assert json.loads((written / "config.json").read_text())["num_heads"] == 2


def test_config_composes_and_refuses_k_above_the_heads(heads):
    native, export = heads
    cfg = build_choose_k_config(compose_config("choose_k", [f"draft={export}", "ks=[0,2]", "server.kv_cache_gib=4"]))
    assert (cfg.draft, cfg.ks, cfg.dtype, cfg.server.kv_cache_gib) == (str(export), [0, 2], "bfloat16", 4)
    for folder in (native, export):
        with pytest.raises(ConfigError) as err:
            build_choose_k_config(compose_config("choose_k", [f"draft={folder}", "ks=[0,1,3]"]))
        assert err.value.problems == ["ks=[0, 1, 3]: [3] above the heads' 2 (vLLM fails to load more)"]


def test_heads_vllm_cannot_serve_get_the_free_servers_measured_and_the_fastest_named(heads, tmp_path):
    """A draft vLLM cannot serve (the demo's heads, say): choose-k serves the base model without speculation and the
    free baselines for it, and its record names the fastest of those with the reason the draft was not served; asking
    for K values, or for no free baselines, is refused naming why, before any server starts."""
    from medusa_train import MedusaModel, load_backbone
    from medusa_train.config.check import ConfigError
    from medusa_train.evaluation.choose_k import served_problem
    from medusa_train.export.serve import fastest_free_command

    native, _ = heads
    backbone, _ = load_backbone(str(native.parent / "model"), dtype="float32")
    reading = MedusaModel.from_backbone(backbone, 2, next_token_input=True).save_pretrained(tmp_path / "reading")
    why = "the heads also read the next token's embedding (heads.next_token_input): only the native layout holds that"
    assert served_problem(reading) == why and served_problem(native) is None
    assert build_choose_k_config(compose_config("choose_k", [f"draft={reading}"])).ks is None
    for overrides, problem in ((["free=false"], f"draft={reading}: vLLM cannot serve these heads: {why}; with "
                                "free=true choose-k serves the base model without speculation and the free baselines "
                                "for them"),
                               (["ks=[0,1]"], f"ks=[0, 1]: vLLM cannot serve these heads ({why}): leave ks out "
                                "(choose-k serves the base model without speculation and the free baselines for them)")):
        with pytest.raises(ConfigError) as err:
            build_choose_k_config(compose_config("choose_k", [f"draft={reading}", *overrides]))
        assert err.value.problems == [problem]

    rows = [FREE_ROWS[0], *FREE_ROWS[2:]]  # no draft row
    record = serving_record(rows, SETTINGS, "base", reading, "test CPU", {"draft": why})
    assert (record["recommended_num_speculative_tokens"], record["fastest_num_speculative_tokens"],
            record["fastest_draft"]) == (None, None, None)
    assert record["fastest_server"]["server"] == "suffix" and record["best_free"]["server"] == "suffix"
    assert verdict(record) == (f"the draft was not served: {why}\nthe fastest server here is suffix (74.3 tokens/s, "
                               "1.28x without speculation; no training)")
    lines = fastest_free_command(record, "/models/base", reading).splitlines()
    assert lines[0] == "serve the base model with suffix (the fastest measured here):"
    assert lines[1].startswith("vllm serve /models/base --dtype bfloat16 --speculative-config ")
    assert json.loads(lines[1].split("--speculative-config '", 1)[1].split("'", 1)[0]) == \
        FREE_ROWS[3]["speculative_config"]
    slow = [FREE_ROWS[0], dict(FREE_ROWS[2], tokens_per_s=50.0)]
    record = serving_record(slow, SETTINGS, "base", reading, "test CPU", {"draft": why})
    assert verdict(record).splitlines()[1] == "no free baseline beats serving without speculation here (58.2 tokens/s)"
    assert fastest_free_command(record, "/models/base", reading).splitlines()[1] == \
        "vllm serve /models/base --dtype bfloat16"


def test_every_bad_key_is_named():
    overrides = ["dtype=fp8", "limit=0", "source=packaged:nothing", "max_tokens=0", "concurrency=0", "ks=[0]",
                 "server.port=70000", "+colour=red"]
    with pytest.raises(ConfigError) as err:
        build_choose_k_config(compose_config("choose_k", overrides))
    keys = [p.split("=")[0].split(":")[0] for p in err.value.problems]
    assert keys == ["colour", "draft", "dtype", "limit", "max_tokens", "concurrency", "server.port", "source", "ks"], keys
    with pytest.raises(ConfigError, match="ks=\\[-1, 'x'\\]: must list whole numbers"):
        build_choose_k_config(compose_config("choose_k", ["draft=nowhere", "ks=[-1,x]"]))


def test_medusa_train_lists_the_command():
    assert COMMANDS["choose-k"][0] == "medusa_train.cli.choose_k"
    assert "\n  choose-k " in usage()


@pytest.mark.integration
def test_the_command_checks_before_it_serves(heads):
    """From the command line: K above the heads' count exits 2 naming ``ks``, before any server starts."""
    _, export = heads
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MEDUSA_TRAIN_VLLM_PYTHON": "/nonexistent/python"}
    run = [sys.executable, "-m", "medusa_train", "choose-k"]
    done = subprocess.run([*run, f"draft={export}", "ks=[1,5]"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "ks=[1, 5]: [5] above the heads' 2" in done.stderr
    helped = subprocess.run([*run, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert helped.returncode == 0 and "medusa-train choose-k draft=<heads dir>" in helped.stdout
    assert all(f"\n{key}:" in helped.stdout for key in ("draft", "dtype", "ks", "limit", "concurrency", "server"))


# docs/results.md's suffix-decoding table (BF16 CPU, bf16, 12 MT-Bench first turns): the free baselines beside the
# EAGLE-3 draft at K=1
FREE_ROWS = [
    {"server": "plain", "k": 0, "startup_s": 60.0, "tokens_per_s": 58.2, "tokens_per_s_c8": 58.2, "mean_acceptance_length": None,
     "tokens_per_step": 1.0, "speculative_config": None},
    {"server": "draft", "k": 1, "startup_s": 60.0, "tokens_per_s": 62.0, "tokens_per_s_c8": 62.0, "mean_acceptance_length": 1.292,
     "tokens_per_step": 1.288, "speculative_config": {"method": "medusa", "num_speculative_tokens": 1}},
    {"server": "ngram", "k": None, "startup_s": 60.0, "tokens_per_s": 66.0, "tokens_per_s_c8": 66.0, "mean_acceptance_length": 2.572,
     "tokens_per_step": 1.309, "speculative_config": {"method": "ngram", "num_speculative_tokens": 4}},
    {"server": "suffix", "k": None, "startup_s": 60.0, "tokens_per_s": 74.3, "tokens_per_s_c8": 74.3, "mean_acceptance_length": 1.91,
     "tokens_per_step": 1.476, "speculative_config": {"method": "suffix", "suffix_decoding_max_cached_requests": 0}},
]


def test_serving_json_names_the_fastest_server_of_all_free_baselines_included(heads):
    """Where a free baseline serves fastest, serving.json says so (no K recommended), with the figures behind it, and
    the serve line serves it first, the draft after; where the draft wins, the line says by how much it beats the
    best free one."""
    _, export = heads
    record = serving_record(FREE_ROWS, SETTINGS, "base", export, "test CPU", {"other": "why"})
    assert record["fastest_server"] == {"server": "suffix", "num_speculative_tokens": None, "tokens_per_s": 74.3,
                                        "tokens_per_step": 1.476,
                                        "speculative_config": FREE_ROWS[3]["speculative_config"]}
    assert record["best_free"]["server"] == "suffix" and record["not_served"] == {"other": "why"}
    assert (record["fastest_draft"]["num_speculative_tokens"], record["fastest_draft"]["tokens_per_s"]) == (1, 62.0)
    assert (record["recommended_num_speculative_tokens"], record["fastest_num_speculative_tokens"]) == (None, 1)
    assert verdict(record).splitlines()[1] == ("the fastest server here is suffix (74.3 tokens/s, no training): 1.20x "
                                               "the draft's best, K=1")
    # what the draft would need to pass it: its step costs what it cost (62.0 tokens/s at 1.288 tokens a step)
    assert record["to_pass_best_free"] == {"server": "suffix", "tokens_per_s": 74.3,
                                           "by_k": {"1": {"has": 1.288, "needs": round(1.288 * 74.3 / 62.0, 4)}}}
    assert verdict(record).splitlines()[2] == ("to pass suffix at K=1 the draft needs 1.544 tokens per step (it has "
                                               "1.288): more data (python -m benchmarks curve says how much)")
    assert format_row(FREE_ROWS[2], 8).startswith("ngram: 66.0 tokens/s at concurrency 1")
    write_json(export / SERVING_NAME, record)
    lines = serve_command(export).splitlines()
    first = next(i for i, x in enumerate(lines) if x.startswith("vllm serve "))
    assert json.loads(lines[first].split("--speculative-config '", 1)[1].split("'", 1)[0]) == \
        FREE_ROWS[3]["speculative_config"]
    assert "is suffix, which needs no training: 74.3 tokens/s, 1.20x the draft's best (K=1)" in lines[first - 1]
    assert lines[first + 1] == "or the draft, slower here:" and '"num_speculative_tokens": 1}' in lines[first + 2]

    faster = [*FREE_ROWS[:1], dict(FREE_ROWS[1], tokens_per_s=80.0), *FREE_ROWS[2:]]
    record = serving_record(faster, SETTINGS, "base", export, "test CPU")
    assert record["fastest_server"]["server"] == "draft" and record["recommended_num_speculative_tokens"] == 1
    assert verdict(record).splitlines()[1] == ("the draft at K=1 beats the best free baseline, suffix (74.3 tokens/s), "
                                               "by 1.08x")
    write_json(export / SERVING_NAME, record)
    assert "it beats the best free baseline there, suffix (74.3 tokens/s), by 1.08x" in serve_command(export)
    # rows written before free baselines were served (no "server") read as before
    assert serving_record(ROWS, SETTINGS, "base", export, "cpu")["best_free"] is None


def test_each_servers_replies_are_checked_against_k0_and_a_wrong_one_is_never_chosen(heads, tmp_path):
    """choose-k compares every row's greedy replies with the server without speculation's on the same prompts:
    identical, or where one parts, the base model's logits there say whether rounding explains it (float32 here:
    nothing does). A faster K whose replies part beyond rounding is not chosen, nor named the fastest server; the
    replies themselves are not kept in serving.json's rows."""
    from medusa_train import load_backbone
    from medusa_train.backbone.generation import encode_chat, eos_token_ids, plain_generate
    from medusa_train.evaluation.served_replies import REPLIES, compare_replies, replies_line

    native, export = heads
    base = str(native.parent / "model")
    backbone, tokenizer = load_backbone(base, dtype="float32")
    conversations = [[{"role": "user", "content": text}] for text in ("count up", "and down again")]
    prompts = [encode_chat(tokenizer, c) for c in conversations]
    eos = eos_token_ids(backbone, tokenizer)
    replies = [plain_generate(backbone, ids, 12, eos, tokenizer.pad_token_id)[0] for ids in prompts]
    assert all(len(r) > 4 for r in replies)
    parted = [replies[0], replies[1][:4] + [(replies[1][4] + 1) % backbone.config.vocab_size] + replies[1][5:]]
    counts = [ids.shape[1] for ids in prompts]

    def row(k, speed, out, server=None):
        return {**ROWS[min(k or 0, 2)], "k": k, "server": server, "tokens_per_s": speed, REPLIES: out,
                "prompt_tokens": list(counts)}

    rows = [row(0, 20.0, replies), row(1, 25.0, list(replies)), row(2, 30.0, parted),
            row(None, 35.0, parted, "ngram")]
    compare_replies(rows, base, export, conversations, "float32")
    assert "outputs" not in rows[0]  # the reference
    assert all(REPLIES not in r and "prompt_tokens" not in r for r in rows)
    assert (rows[1]["outputs"]["identical"], rows[1]["outputs"]["compared"], rows[1]["outputs"]["details"]) == (2, 2, [])
    wrong = rows[2]["outputs"]
    assert (wrong["identical"], wrong["unexplained"], wrong["at_rounding"]) == (1, 1, 0)
    assert wrong["details"][0]["index"] == 1 and wrong["details"][0]["position"] == 4
    assert wrong["details"][0]["plain_token"] == replies[1][4] and wrong["details"][0]["tolerance"] == 0.0
    assert replies_line(rows[2]) == "  K=2: 1 of 2 replies identical to K=0's; 1 part beyond rounding (not chosen)"
    best, plain, faster = choose(rows)
    assert (best["k"], faster) == (1, True)
    record = serving_record(rows, SETTINGS, base, export, "test CPU")
    assert record["fastest_server"]["server"] == "draft" and record["recommended_num_speculative_tokens"] == 1
    assert record["best_free"] is None  # the only free row parted from plain greedy

    # a server that counted another prompt length is not classified, only counted
    rows = [row(0, 20.0, replies), dict(row(2, 30.0, parted), prompt_tokens=[counts[0], counts[1] + 1])]
    compare_replies(rows, base, export, conversations, "float32")
    assert rows[1]["outputs"]["details"] == [{"index": 1, "position": 4, "kind": "prompt_differs"}]
    # without a server without speculation nothing is compared
    rows = [row(1, 25.0, replies)]
    compare_replies(rows, base, export, conversations, "float32")
    assert rows[0]["outputs"] is None and REPLIES not in rows[0]
