"""Sampled replies are checked under the backbone: a correct sampler's replies pass, replies with a stray
token after every few (what a speculative sampler that lets rejected drafts through writes) are flagged."""

from __future__ import annotations

import pytest
import torch
from helpers.backbones import PACKAGED_MODEL

from medusa_train.evaluation.sampled_check import SLACK, against_plain, describe, verdict

TEMPERATURE = 0.7
THRESHOLD = 1e-4


def test_the_verdict_allows_chance_and_no_more():
    # 3,000 tokens, 1.5 expected below the threshold: 3 is chance (within the slack), 40 is not
    assert not verdict(3000, 3, 1.5, 1.5, THRESHOLD, TEMPERATURE, 24)["flagged"]
    flagged = verdict(3000, 40, 1.5, 1.5, THRESHOLD, TEMPERATURE, 24)
    assert flagged["flagged"] and flagged["z"] > 20
    assert describe(flagged).startswith("incorrect: 1.3% of 3,000 reply tokens below p=0.0001 at T=0.7")
    # a large expected count needs a large excess: 4 standard deviations
    assert not verdict(100_000, 1_100, 1_000.0, 990.0, THRESHOLD, TEMPERATURE, 24)["flagged"]  # 3.2 sd
    assert verdict(100_000, 1_130, 1_000.0, 990.0, THRESHOLD, TEMPERATURE, 24)["flagged"]  # 4.1 sd
    assert not verdict(10, 1 + SLACK, 1.0, 0.0, THRESHOLD, TEMPERATURE, 1)["flagged"]  # one rare draw flags nothing


def test_a_share_well_above_the_plain_servers_is_flagged():
    plain = verdict(3000, 3, 2.0, 2.0, THRESHOLD, TEMPERATURE, 24)
    assert against_plain(verdict(3000, 40, 30.0, 30.0, THRESHOLD, TEMPERATURE, 24), plain)["flagged_against_plain"]
    same = against_plain(verdict(2800, 4, 2.0, 2.0, THRESHOLD, TEMPERATURE, 24), plain)
    assert not same["flagged_against_plain"] and same["plain_share_below"] == pytest.approx(0.001)
    assert "0.1% from the server without speculation" in describe({**plain, **same})


@pytest.mark.slow
def test_sampled_replies_pass_and_replies_with_stray_tokens_are_flagged():
    from medusa_train import MedusaModel, load_backbone
    from medusa_train.backbone.generation import encode_chat, eos_token_ids, plain_generate
    from medusa_train.data.benchmarks import load_benchmark
    from medusa_train.evaluation.sampled_check import score_replies

    backbone, tokenizer = load_backbone(PACKAGED_MODEL, dtype="float32")
    model = MedusaModel.from_backbone(backbone, num_heads=1).eval()
    eos = eos_token_ids(backbone)
    inputs, replies = [], []
    for i, prompt in enumerate(load_benchmark("packaged:mt-bench", 6)):
        ids = encode_chat(tokenizer, [{"role": "user", "content": prompt.turns[0]}])
        torch.manual_seed(i)
        reply, _ = plain_generate(backbone, ids, 48, eos, tokenizer.pad_token_id, temperature=TEMPERATURE)
        inputs.append(ids)
        replies.append(reply)
    right = score_replies(model, inputs, replies, TEMPERATURE, THRESHOLD)
    assert not right["flagged"], right
    assert right["tokens"] == sum(map(len, replies)) and right["replies"] == 6
    # a stray token (drawn uniformly from the vocabulary) after every 4 sampled ones
    g = torch.Generator().manual_seed(0)
    vocab = backbone.config.vocab_size
    stray = [[t for j, tok in enumerate(r) for t in ([tok] if j % 4 else [tok, int(torch.randint(vocab, (1,),
                                                                                                  generator=g))])]
             for r in replies]
    wrong = score_replies(model, inputs, stray, TEMPERATURE, THRESHOLD)
    assert wrong["flagged"], wrong
    assert wrong["share_below"] > 0.1 > right["share_below"]
    # sparse: one stray after every 16 sampled tokens (about 6% of the reply) is caught too
    sparse = [[t for j, tok in enumerate(r) for t in ([tok] if j % 16 != 15 else [tok, int(torch.randint(
        vocab, (1,), generator=g))])] for r in replies]
    assert score_replies(model, inputs, sparse, TEMPERATURE, THRESHOLD)["flagged"]
