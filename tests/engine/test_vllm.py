"""The real engine (vLLM's CPU build from .venv-vllm, started as users start theirs): our export loads and
accepts what our decoder simulates, greedy output is the engine's own, and distillation through it writes
what the in-process path writes and survives the server being killed.

Each server takes ~90 s to answer /health here; the tests start as few as the claims need."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from medusa_train.config.check import ConfigError
from medusa_train.engine import EngineError, VllmServer

pytestmark = [pytest.mark.slow, pytest.mark.integration]  # vLLM servers: processes of their own

PROMPTS = 6  # MT-Bench first turns, spread over the categories
MAX_TOKENS = 48


def test_the_draft_vocabulary_export_serves_accepts_what_we_simulate_and_keeps_greedy_output(trained_heads, tmp_path):
    """``scripts/evaluate.py heads=<native heads> engine=vllm`` as a user runs it: heads with a 4,096-token
    draft vocabulary sharing the LM head, exported for vLLM (whole LM head, no token_map) and served on
    the packaged model's folder with and without speculation in float32: served acceptance > 1 and within
    0.03 of our decoder's top-1 chain on the same prompts, greedy replies identical to the engine's own."""
    from medusa_train.cli.evaluate import build_eval_config, run

    cfg = build_eval_config({
        "heads": trained_heads, "engine": "vllm", "tree": "chain", "model": {"dtype": "float32"},
        "bench": {"limit": PROMPTS, "turns": 1}, "generation": {"max_new_tokens": MAX_TOKENS}, "warmup": False,
        "progress": False, "output_dir": str(tmp_path / "report"),
        "served": {"concurrency": 3, "sampled_temperature": 0.7, "ngram": False}})
    report = run(cfg)
    row = report["engines"]["vllm"]
    got = row["served"]
    heads = json.loads((Path(trained_heads) / "config.json").read_text())
    assert heads["draft_vocab_size"] == 4096 and heads["share_lm_head"]
    export = json.loads((tmp_path / "report" / "vllm-export" / "config.json").read_text())
    assert export["truncated_vocab_size"] == export["vocab_size"] and export["original_lm_head"]
    # the server started on the base model's folder with the export as its speculator, K = every head
    assert got["speculative_config"] == {"method": "medusa", "num_speculative_tokens": heads["num_heads"],
                                         "model": str((tmp_path / "report" / "vllm-export").resolve())}
    assert not got["settings"]["base_model"].startswith("packaged:")
    assert got["drafts"] > 0 and len(got["per_position_acceptance"]) == heads["num_heads"]
    assert got["mean_acceptance_length"] > 1.0
    assert abs(got["mean_acceptance_length"] - row["mean_accepted_length"]) <= 0.03, (got, row)
    assert got["prompts_tokenised_alike"] == PROMPTS  # the engine's chat template gave our input ids' length
    o = got["outputs"]
    assert o["compared"] == PROMPTS and o["unexplained"] == 0 and o["identical"] + o["at_rounding"] == PROMPTS, o
    assert set(got["phases"]) == {"greedy_c3", "sampled"}
    assert got["phases"]["sampled"]["mean_acceptance_length"] >= 1.0
    written = json.loads((tmp_path / "report" / "report.json").read_text())
    assert written["engines"]["vllm"]["served"] == json.loads(json.dumps(got))
    assert "acceptance length" in (tmp_path / "report" / "report.md").read_text()
    assert "--speculative-config" in (tmp_path / "report" / "vllm-medusa.log").read_text()
    assert "--speculative-config" not in (tmp_path / "report" / "vllm-plain.log").read_text()


def _distill_cfg(output, **extra):
    from medusa_train.config.distill import build_distill_config

    return build_distill_config({"model": {"name_or_path": "packaged:smollm2-135m-instruct", "dtype": "float32"},
                                 "num_prompts": 16, "max_turns": 2, "max_prompt_tokens": 256, "batch_size": 8,
                                 "generation": {"max_new_tokens": MAX_TOKENS}, "output": str(output),
                                 "filters": {"skip_truncated": False},  # replies cut at 48 tokens are records too
                                 "progress": False, **extra})


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_distillation_through_the_server_survives_its_kill_and_writes_the_in_process_records(
        model_folder, tmp_path):
    """engine=openai against a server killed mid-run: the run stops with the engine's error, every line on
    disk whole; resuming with another engine is refused; the rerun against a new server completes, and the
    file accounts for the same conversations as the in-process path, with the same replies but for near-ties."""
    from medusa_train.data.distill import distill

    output = tmp_path / "served.jsonl"
    server = VllmServer(model_folder, dtype="float32", log_path=tmp_path / "vllm-a.log")
    client = server.start()
    try:
        def kill_after_some_records():
            while len(_lines(output)) < 3 and server.process is not None:
                time.sleep(0.2)
            os.killpg(server.process.pid, signal.SIGKILL)  # the engine dies as in an OOM kill

        killer = threading.Thread(target=kill_after_some_records, daemon=True)
        killer.start()
        with pytest.raises(EngineError, match="did not answer|HTTP 5"):
            distill(_distill_cfg(output, engine="openai", url=client.url, concurrency=4))
        killer.join(30)
    finally:
        server.stop()
    written = _lines(output)
    skipped = _lines(output.with_name("served.skipped.jsonl"))
    assert 3 <= len(written) < 16 and all("messages" in r for r in written)  # stopped mid-run, every line whole
    stats = json.loads(output.with_name("served.stats.json").read_text())
    assert stats["complete"] is False and stats["record_settings"]["engine"] == "openai"

    with pytest.raises(ConfigError, match="engine: 'openai' -> 'vllm'"):  # a resume never mixes engines
        distill(_distill_cfg(output, engine="vllm"))

    with VllmServer(model_folder, dtype="float32", log_path=tmp_path / "vllm-b.log") as client:
        resumed = distill(_distill_cfg(output, engine="openai", url=client.url, concurrency=4))
    assert resumed.complete and resumed.resumed_records == len(written) + len(skipped)
    assert resumed.records + sum(resumed.skipped.values()) == resumed.selected == 16

    local = distill(_distill_cfg(tmp_path / "local.jsonl"))
    by_id = {r["id"]: r for r in _lines(output)}
    local_by_id = {r["id"]: r for r in _lines(tmp_path / "local.jsonl")}
    skipped_ids = {r["id"] for r in _lines(output.with_name("served.skipped.jsonl"))}
    local_skipped = {r["id"] for r in _lines(tmp_path / "local.skipped.jsonl")}
    assert set(by_id) | skipped_ids == set(local_by_id) | local_skipped  # the same conversations accounted for
    same = [i for i in by_id if i in local_by_id and by_id[i]["messages"] == local_by_id[i]["messages"]]
    first_turn = [i for i in by_id if i in local_by_id
                  and by_id[i]["messages"][:2] == local_by_id[i]["messages"][:2]]
    # float32 in both (15 of 15 identical here); other kernels may part a reply at a near-tie, no more
    assert len(first_turn) >= 0.9 * len(local_by_id), (len(first_turn), len(local_by_id))
    assert len(same) >= 0.8 * len(local_by_id), (len(same), len(local_by_id))
    assert local.records == len(local_by_id)


def test_heads_with_their_own_output_layers_load_and_propose(model_folder, tmp_path):
    """The other layout vLLM accepts from us: plain heads with their own (whole-vocabulary) output layers
    (``lm_heads.{h}.weight``, ``original_lm_head: false``). The engine loads them and proposes K tokens a step."""
    from medusa_train import MedusaModel, load_backbone
    from medusa_train.export.write import export_heads

    backbone, _ = load_backbone(model_folder, dtype="float32")
    heads = MedusaModel.from_backbone(backbone, num_heads=2, share_lm_head=False)  # each head a copy of the LM head
    export = export_heads(heads, tmp_path / "vllm", "vllm")
    assert not json.loads((export / "config.json").read_text())["original_lm_head"]
    del backbone, heads
    spec = {"method": "medusa", "model": str(export), "num_speculative_tokens": 2}
    with VllmServer(model_folder, dtype="float32", speculative_config=spec, log_path=tmp_path / "vllm.log") as client:
        before = client.spec_counters()
        reply = client.chat([{"role": "user", "content": "Name three colors."}], max_tokens=24)
        time.sleep(1.0)  # the counters land with the engine's outputs
        counted = client.spec_counters() - before
    assert reply.completion_tokens > 0 and reply.text
    assert counted.drafts > 0 and counted.draft_tokens == 2 * counted.drafts
    assert len(counted.per_position) == 2
