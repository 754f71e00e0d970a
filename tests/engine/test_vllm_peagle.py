"""A P-EAGLE draft against the real engine (vLLM's CPU build from .venv-vllm): our export loads with method eagle3 and
``parallel_drafting`` (``families/peagle``: the mask token in config.json, ``mask_hidden`` in the weights), vLLM
drafts K tokens in one draft pass on every step, and what it accepts, position by position, is what our decoder's
chain accepts and what the training log's walk predicts on the same prompts (float32).

The draft is fitted, masked slots included, to the packaged model's own greedy replies to the test prompts (as the
EAGLE-3 engine test's is): a barely trained draft accepts near nothing past its first slot on either side, which
would hide a wrong mask feature, mask token or slot position. At K=1 a parallel draft has no masked slot and vLLM runs
its plain EAGLE-3 step, which ``test_vllm_eagle3.py`` checks."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]

PROMPTS = 3  # MT-Bench first turns, spread over the categories
MAX_TOKENS = 32
K = 3
FIT_STEPS = 100


def test_the_engine_drafts_k_tokens_in_one_pass_and_accepts_what_the_walk_predicts(packaged_backbone, free_servers,
                                                                                    tmp_path):
    """``evaluate draft=<the P-EAGLE export> engine=vllm`` with K=3: vLLM starts with ``parallel_drafting``, drafts on
    every step, and accepts per step and per position what our chain accepts and the walk predicts (within 0.03;
    the walk and our chain equal), replying with the backbone's own tokens."""
    import torch

    from benchmarks.bench_eagle3_served import chain_figures, fit_draft
    from medusa_train.backbone.generation import encode_chat, eos_token_ids
    from medusa_train.cli.evaluate import build_eval_config, run
    from medusa_train.data.benchmarks import load_benchmark
    from medusa_train.families.peagle.model import PEagleModel
    from medusa_train.model.walk import walk_figures

    backbone, tokenizer = packaged_backbone
    eos = eos_token_ids(backbone, tokenizer)
    prompts = [[{"role": "user", "content": p.turns[0]}] for p in load_benchmark(limit=PROMPTS, pick="spread")]
    model = fit_draft(backbone, tokenizer, prompts, MAX_TOKENS, K, FIT_STEPS, model_class=PEagleModel)
    export = model.save_pretrained(tmp_path / "draft")
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["mask_token_id"] == model.config.mask_token_id
    replies, ours = chain_figures(model, tokenizer, prompts, MAX_TOKENS, eos)
    sequences = [(torch.cat([encode_chat(tokenizer, m)[0], torch.tensor(r)])[None], encode_chat(tokenizer, m).shape[1])
                 for m, r in zip(prompts, replies)]
    walk = walk_figures(model, sequences, chains=[K])[f"chain{K}"]
    assert walk == pytest.approx(ours["tokens_per_step"], abs=1e-9), (walk, ours)
    assert ours["per_position"][1] > 0.03, ours  # a masked slot that guesses: its feature and position matter

    report = run(build_eval_config({
        "draft": str(export), "engine": "vllm", "tree": "chain", "model": {"dtype": "float32"},
        "bench": {"limit": PROMPTS, "turns": 1}, "generation": {"max_new_tokens": MAX_TOKENS}, "warmup": False,
        "progress": False, "output_dir": str(tmp_path / "report"), "baselines": {"prompt_lookup": False},
        "served": {"concurrency": 1, "sampled_temperature": 0, "ngram": False, "suffix": False,
                   "plain_url": free_servers["plain"]}}))
    row = report["served"]["rows"]["draft"]
    assert "P-EAGLE" in row["decodes_with"]
    assert row["speculative_config"] == {"method": "eagle3", "parallel_drafting": True, "model": str(export),
                                         "num_speculative_tokens": K}
    assert row["drafts"] == row["decode_steps"] > 0 and row["drafted_share"] == 1.0  # it drafts on every step
    print(f"K={K}: walk {walk:.4f}, our chain {ours['tokens_per_step']:.4f} {ours['per_position']}, served "
          f"{row['tokens_per_step']:.4f} {row['per_position_acceptance']}")
    assert abs(row["tokens_per_step"] - walk) <= 0.03, (row, ours)
    for served_rate, our_rate in zip(row["per_position_acceptance"], ours["per_position"], strict=True):
        assert abs(served_rate - our_rate) <= 0.03, (row["per_position_acceptance"], ours)
    assert row["outputs"]["compared"] == PROMPTS and row["outputs"]["identical"] == PROMPTS, row["outputs"]
    assert report["mismatches"] == 0
