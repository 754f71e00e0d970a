import json

import pytest
import torch
from helpers.training import compose_config, make_chat_jsonl, make_model_dir, read_metrics, train_overrides

from medusa_train import MedusaModel, load_backbone
from medusa_train.cli.train import run
from medusa_train.data import MedusaCollator, build_datasets
from medusa_train.data.capture import HiddenCollator, build_hidden_cache, load_hidden_cache
from medusa_train.training.losses import medusa_loss_backward
from medusa_train.training.targets import (
    text_targets,
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    model_dir, data = make_model_dir(root / "model"), make_chat_jsonl(root / "chat.jsonl", n=24)
    backbone, tokenizer = load_backbone(model_dir, dtype="float32")
    model = MedusaModel.from_backbone(backbone, num_heads=3)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.normal_(std=0.02)
    train, _, _ = build_datasets(tokenizer, data, max_length=96, eval_size=0)
    return root, model, tokenizer, train, model_dir, data


def test_cached_states_are_the_backbones_own(setup):
    root, model, tokenizer, train, *_ = setup
    folder = build_hidden_cache(model, train, root / "c1", batch_size=5)
    cached = load_hidden_cache(folder)
    assert len(cached) == len(train)
    for example, entry in zip(train, cached):
        assert entry["labels"].tolist() == example["labels"]
        with torch.no_grad():
            alone = model(torch.tensor([example["input_ids"]])).hidden_states[0]
        torch.testing.assert_close(entry["hidden"], alone, rtol=1e-5, atol=1e-5)
    stamp = (folder / "index.json").stat().st_mtime_ns
    assert build_hidden_cache(model, train, folder) == folder  # complete: reused, not rebuilt
    assert (folder / "index.json").stat().st_mtime_ns == stamp


def _loss_and_grads(model, hidden, labels):
    model.zero_grad(set_to_none=True)
    result = medusa_loss_backward(model.head_logits, hidden, text_targets(labels, model.num_heads))
    return result.loss, [p.grad.clone() for p in model.heads.parameters()]


def test_loss_and_gradients_equal_the_uncached_path(setup):
    root, model, tokenizer, train, *_ = setup
    cached = load_hidden_cache(build_hidden_cache(model, train, root / "c2", batch_size=3))
    picks = [0, 5, 9, 13]
    batch = MedusaCollator(tokenizer.pad_token_id)([train[i] for i in picks])
    with torch.no_grad():
        hidden = model(batch["input_ids"], attention_mask=batch["attention_mask"]).hidden_states
    loss_a, grads_a = _loss_and_grads(model, hidden, batch["labels"])
    cached_batch = HiddenCollator()([cached[i] for i in picks])
    assert torch.equal(cached_batch["labels"], batch["labels"])
    loss_b, grads_b = _loss_and_grads(model, cached_batch["hidden"], cached_batch["labels"])
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def self_distilled_jsonl(model_dir, data, path):
    """The fixture's prompts answered by the tiny backbone itself (greedy), as a user would distil them."""
    from medusa_train.backbone.generation import eos_token_ids
    from medusa_train.data.distill import GenerationSettings, generate_replies

    backbone, tokenizer = load_backbone(model_dir, dtype="float32")
    prompts = [json.loads(line)["messages"][:1] for line in open(data)]
    replies = generate_replies(backbone, tokenizer, prompts, GenerationSettings(max_new_tokens=24),
                               eos_token_ids(backbone, tokenizer))
    with open(path, "w") as f:
        for prompt, reply in zip(prompts, replies):
            f.write(json.dumps({"messages": prompt + [{"role": "assistant", "content": reply.text}]}) + "\n")
    return path


@pytest.mark.parametrize("targets, reads", [("text", "hidden"), ("greedy", "hidden"), ("text", "next_token"),
                                            ("text", "path"), ("teacher", "path"),
                                            ("text", "prefix")])
def test_training_from_the_cache_matches_training_without_it(setup, tmp_path, targets, reads):
    _, _, _, _, model_dir, data = setup
    if targets == "greedy":  # greedy targets need text the backbone wrote, or nothing is kept
        data = self_distilled_jsonl(model_dir, data, tmp_path / "distilled.jsonl")
    next_token, path = reads != "hidden", reads in ("path", "prefix")
    common = {"trainer.max_steps": 12, "trainer.eval_every": 6, "trainer.epochs": 3, "loss.targets": targets,
              "heads.next_token_input": str(next_token).lower(), "heads.path_input": str(path).lower(),
              "heads.prefix_attention": str(reads == "prefix").lower()}
    run(compose_config(train_overrides(model_dir, data, tmp_path / "plain", **common)))
    run(compose_config(train_overrides(model_dir, data, tmp_path / "cached", **common, **{
        "data.cache_hidden_states": "true", "data.cache_dir": tmp_path / "hidden"})))
    plain, cached = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "cached")
    assert [m["step"] for m in plain] == [m["step"] for m in cached]
    for a, b in zip(plain, cached):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), a["step"]
        assert b.get("head3/kept") == a.get("head3/kept")
    if targets == "greedy":  # the random model writes broken UTF-8, so re-tokenised replies agree only in part
        assert all(0.1 < m[f"head{k}/kept"] < 1.0 for m in plain if m["split"] == "eval" for k in (1, 2, 3))
    assert len(list((tmp_path / "hidden").iterdir())) == 2  # train + eval
    exported = MedusaModel.from_pretrained(tmp_path / "cached" / "export", backbone=load_backbone(model_dir)[0])
    config = exported.config
    assert (config.next_token_input, config.path_input, config.prefix_attention) == (next_token, path, reads == "prefix")
    if next_token:  # the token's projection was trained, not left at its zero start
        assert all(head.blocks[0].token.weight.abs().sum() > 0 for head in exported.heads)
    if reads == "prefix":  # so was the prefix attention layer (its output projections start at zero)
        assert exported.prefix.out.weight.abs().sum() > 0 and exported.prefix.down.weight.abs().sum() > 0
    assert json.loads(next((tmp_path / "hidden").glob("*-train/index.json")).read_text())["examples"] > 0
