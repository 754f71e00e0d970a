"""An EAGLE-3 draft against the real engine (vLLM's CPU build from .venv-vllm): our export loads with method eagle3,
vLLM drafts on every step, and what it accepts, position by position, is what our decoder's chain accepts on the same
prompts (float32); its greedy replies are the backbone's own.

The draft is fitted, with training-time test, to the packaged model's own greedy replies to the test prompts (as the
decoder tests' oracle heads know their text): a barely trained draft accepts near nothing on both sides, which would
hide a wrong rope, layer or alignment."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]

PROMPTS = 3  # MT-Bench first turns, spread over the categories
MAX_TOKENS = 32
K = 3
FIT_STEPS = 40
K1_PROMPTS, K1_TOKENS = 6, 48  # the K=1 test's: the 3 fitted prompts and 3 the draft never saw


@pytest.fixture(scope="module")
def fitted(packaged_backbone, tmp_path_factory):
    """``(export folder, prompts, our chain's figures)``: a draft (a 4,096-token draft vocabulary, so ``d2t`` is
    exercised) fitted for ``FIT_STEPS`` steps on the greedy replies, and our decoder's K-long chain over the prompts."""
    from benchmarks.bench_eagle3_served import chain_figures, fit_draft
    from medusa_train.backbone.generation import eos_token_ids
    from medusa_train.data.benchmarks import load_benchmark

    backbone, tokenizer = packaged_backbone
    eos = eos_token_ids(backbone, tokenizer)
    prompts = [[{"role": "user", "content": p.turns[0]}] for p in load_benchmark(limit=PROMPTS, pick="spread")]
    model = fit_draft(backbone, tokenizer, prompts, MAX_TOKENS, K, FIT_STEPS)
    export = model.save_pretrained(tmp_path_factory.mktemp("eagle3") / "draft")
    replies, ours = chain_figures(model, tokenizer, prompts, MAX_TOKENS, eos)
    ours["walk"] = walked(model, tokenizer, prompts, replies)
    return export, prompts, replies, ours, eos


def walked(model, tokenizer, prompts, replies) -> dict:
    """What training logs for the draft (``model.walk``): its chains walked along the backbone's replies."""
    import torch

    from medusa_train.backbone.generation import encode_chat
    from medusa_train.model.walk import walk_figures

    sequences = []
    for messages, reply in zip(prompts, replies):
        ids = encode_chat(tokenizer, messages)
        sequences.append((torch.cat([ids[0], torch.tensor(reply)])[None], ids.shape[1]))
    return walk_figures(model, sequences, chains=range(1, model.config.depth + 1))


def test_the_engine_serves_the_draft_and_accepts_what_our_chain_accepts(fitted, free_servers, tmp_path):
    """``medusa-train evaluate heads=<the draft> engine=vllm`` beside the running server without speculation (the
    free rows' figures are the Medusa engine tests' claim): vLLM starts with method eagle3, drafts K tokens on every
    decode step, accepts per step and per position what our chain accepts (float32, within 0.03), and replies with
    the backbone's own tokens."""
    from medusa_train.cli.evaluate import build_eval_config, run

    export, prompts, ours_replies, ours, eos = fitted
    assert ours["tokens_per_step"] >= 1.5, ours  # a draft that really drafts: rope, layers and alignment matter
    # the training log's walk along the same replies is our chain's figure, the last step of each reply included
    assert ours["walk"][f"chain{K}"] == pytest.approx(ours["tokens_per_step"], abs=1e-9), (ours["walk"], ours)
    assert json.loads((export / "config.json").read_text())["draft_vocab_size"] == 4096
    report = run(build_eval_config({
        "heads": str(export), "engine": "vllm", "tree": "chain", "model": {"dtype": "float32"},
        "bench": {"limit": PROMPTS, "turns": 1}, "generation": {"max_new_tokens": MAX_TOKENS}, "warmup": False,
        "progress": False, "output_dir": str(tmp_path / "report"),
        "baselines": {"prompt_lookup": False},  # the free rows are test_vllm.py's claim
        "served": {"concurrency": 1, "sampled_temperature": 0, "ngram": False, "suffix": False, "plain_url": free_servers["plain"]}}))
    row = report["served"]["rows"]["draft"]
    assert list(report["served"]["rows"]) == ["plain", "draft"] and "EAGLE-3" in row["decodes_with"]
    assert row["speculative_config"]["method"] == "eagle3" and row["speculative_config"]["model"] == str(export)
    assert row["speculative_config"]["num_speculative_tokens"] == K
    assert row["drafts"] == row["decode_steps"] > 0 and row["drafted_share"] == 1.0  # it drafts on every step
    assert abs(row["tokens_per_step"] - ours["tokens_per_step"]) <= 0.03, (row, ours)
    assert abs(row["tokens_per_step"] - row["simulated_tokens_per_step"]) <= 0.03, row
    # vLLM's 1 + accepted / drafts also counts accepted drafts that max_tokens cut off: at most K per reply
    assert 0 <= row["decode_steps"] - row["steps_from_accepted"] <= K * row["replies"], row
    assert len(row["per_position_acceptance"]) == K
    for served_rate, our_rate in zip(row["per_position_acceptance"], ours["per_position"]):
        assert abs(served_rate - our_rate) <= 0.03, (row["per_position_acceptance"], ours)
    outputs = row["outputs"]
    assert outputs["compared"] == PROMPTS and outputs["identical"] == PROMPTS, outputs  # the plain server's replies
    assert report["mismatches"] == 0  # and our decoder's, in the same report


def test_the_logged_one_token_figure_is_what_the_engine_serves_at_k1(fitted, packaged_backbone, free_servers,
                                                                      tmp_path):
    """``served.num_speculative_tokens=1`` on 6 MT-Bench first turns, 48 tokens (the draft fitted on 3 of them: it
    accepts on all, less on the 3 it never saw; 8 prompts of 64 tokens took 264 s of the suite's 24 minutes): vLLM
    serves the draft one token a step and accepts what the walk (the training log's validation/K1 figure) says it
    will, within 0.03 tokens per step (float32), as does our decoder's 1-chain (the same text: equal)."""
    from benchmarks.bench_eagle3_served import chain_figures
    from medusa_train.cli.evaluate import build_eval_config, run
    from medusa_train.data.benchmarks import load_benchmark
    from medusa_train.families.eagle3.model import Eagle3Model

    export, _, _, _, eos = fitted
    backbone, tokenizer = packaged_backbone
    model = Eagle3Model.from_pretrained(export, backbone=backbone)
    model.config.ttt_steps = 1  # the 1-chain
    prompts = [[{"role": "user", "content": p.turns[0]}] for p in load_benchmark(limit=K1_PROMPTS, pick="spread")]
    replies, ours = chain_figures(model, tokenizer, prompts, K1_TOKENS, eos)
    walk = walked(model, tokenizer, prompts, replies)["chain1"]
    report = run(build_eval_config({
        "heads": str(export), "engine": "vllm", "tree": "chain", "model": {"dtype": "float32"},
        "bench": {"limit": K1_PROMPTS, "turns": 1}, "generation": {"max_new_tokens": K1_TOKENS}, "warmup": False,
        "progress": False, "output_dir": str(tmp_path / "report"), "baselines": {"prompt_lookup": False},
        "served": {"concurrency": 1, "sampled_temperature": 0, "ngram": False, "suffix": False, "num_speculative_tokens": 1,
                   "plain_url": free_servers["plain"]}}))
    row = report["served"]["rows"]["draft"]
    assert row["speculative_config"]["num_speculative_tokens"] == 1
    assert walk > 1.08, walk  # it accepts (on the prompts it was fitted to, most): the comparison can fail
    print(f"K=1: walk {walk:.4f}, our 1-chain {ours['tokens_per_step']:.4f}")
    assert walk == pytest.approx(ours["tokens_per_step"], abs=1e-9), (walk, ours)
    print(f"K=1: served {row['tokens_per_step']:.4f}")
    assert abs(walk - row["tokens_per_step"]) <= 0.03, (walk, row["tokens_per_step"], ours)
