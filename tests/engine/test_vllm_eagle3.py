"""An EAGLE-3 draft against the real engine (vLLM's CPU build from .venv-vllm): our export loads with method eagle3,
vLLM drafts on every step, and what it accepts, position by position, is what our decoder's chain accepts on the same
prompts (float32); its greedy replies are the backbone's own.

The draft is fitted, with training-time test, to the packaged model's own greedy replies to the test prompts (as the
decoder tests' oracle heads know their text): a barely trained draft accepts near nothing on both sides, which would
hide a wrong rope, layer or alignment."""

from __future__ import annotations

import json
import time

import pytest
import torch

from medusa_train.engine import VllmServer

pytestmark = [pytest.mark.slow, pytest.mark.integration]

PROMPTS = 4  # MT-Bench first turns, spread over the categories
MAX_TOKENS = 40
K = 3
FIT_STEPS = 40


@pytest.fixture(scope="module")
def fitted(packaged_backbone, tmp_path_factory):
    """``(export folder, prompts, our chain's figures)``: a draft (a 4,096-token draft vocabulary, so ``d2t`` is
    exercised) fitted for ``FIT_STEPS`` steps on the greedy replies, and our decoder's K-long chain over the prompts."""
    from medusa_train.backbone.generation import encode_chat, eos_token_ids
    from medusa_train.data.benchmarks import load_benchmark
    from medusa_train.decoding import MedusaTree, medusa_generate
    from medusa_train.model.draft_vocab import most_frequent_tokens
    from medusa_train.model.eagle3_model import Eagle3Model
    from medusa_train.training.eagle3_loss import ttt_loss

    backbone, tokenizer = packaged_backbone
    eos = eos_token_ids(backbone, tokenizer)
    prompts = [[{"role": "user", "content": p.turns[0]}] for p in load_benchmark(limit=PROMPTS, pick="spread")]
    texts = []
    for messages in prompts:
        ids = encode_chat(tokenizer, messages)
        reply = backbone.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=MAX_TOKENS + K)[0]
        texts.append((ids.shape[1], reply))
    width = max(len(t) for _, t in texts)
    ids = torch.zeros(len(texts), width, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, (start, text) in enumerate(texts):
        ids[i, :len(text)], mask[i, :len(text)], labels[i, start:len(text)] = text, 1, text[start:]
    torch.manual_seed(0)
    model = Eagle3Model.from_backbone(backbone, token_map=most_frequent_tokens(labels, 4096, backbone.config.vocab_size),
                                      ttt_steps=K)
    with torch.no_grad():
        states = model(ids, attention_mask=mask)
    optimizer = torch.optim.AdamW(model.draft.parameters(), lr=1e-2)
    for _ in range(FIT_STEPS):
        ttt_loss(model, states.draft_inputs, states.hidden_states, ids, mask, labels, K, 0.8,
                 backward=torch.Tensor.backward)
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    export = model.save_pretrained(tmp_path_factory.mktemp("eagle3") / "draft")
    replies, depths, gained, steps = [], [], 0, 0
    for messages in prompts:
        ids = encode_chat(tokenizer, messages)
        out = medusa_generate(model, ids, MedusaTree.chain(K), max_new_tokens=MAX_TOKENS, eos_token_id=eos)
        replies.append(out.sequences[0, ids.shape[1]:].tolist())
        depths += out.accepted_depths
        gained, steps = gained + out.new_tokens - 1, steps + out.steps
    ours = {"tokens_per_step": gained / steps, "steps": steps,
            "per_position": [sum(d > k for d in depths) / len(depths) for k in range(K)]}
    return export, prompts, replies, ours, eos


def test_the_engine_loads_the_draft_and_accepts_what_our_chain_accepts(fitted, model_folder, tmp_path):
    export, prompts, ours_replies, ours, eos = fitted
    assert ours["tokens_per_step"] >= 1.5, ours  # a draft that really drafts: rope, layers and alignment matter
    config = json.loads((export / "config.json").read_text())
    assert config["draft_vocab_size"] == 4096
    spec = {"method": "eagle3", "model": str(export), "num_speculative_tokens": K}
    with VllmServer(model_folder, dtype="float32", speculative_config=spec, log_path=tmp_path / "vllm.log") as client:
        before = client.spec_counters()
        served = [client.chat(messages, max_tokens=MAX_TOKENS) for messages in prompts]
        time.sleep(1.0)  # the counters land with the engine's outputs
        counted = client.spec_counters() - before
    replies = [r.token_ids[:-1] if r.token_ids and r.token_ids[-1] in eos else r.token_ids for r in served]
    assert replies == ours_replies  # greedy: the backbone's own replies, as our decoder's
    tokens = sum(r.completion_tokens for r in served)
    assert counted.decode_steps == counted.drafts > 0  # the draft drafts on every decode step
    assert counted.draft_tokens == K * counted.drafts
    served_per_step = (tokens - len(served)) / counted.decode_steps
    assert abs(served_per_step - ours["tokens_per_step"]) <= 0.03, (served_per_step, ours)
    # vLLM's 1 + accepted / drafts also counts accepted drafts that max_tokens cut off: at most K per reply
    cut = counted.accepted - (tokens - len(served) - counted.decode_steps)
    assert 0 <= cut <= K * len(served), (counted, tokens)
    per_position = counted.per_position_acceptance
    assert len(per_position) == K
    for served_rate, our_rate in zip(per_position, ours["per_position"]):
        assert abs(served_rate - our_rate) <= 0.03, (per_position, ours)
