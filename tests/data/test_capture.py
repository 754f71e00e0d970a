import json

import pytest
import torch
from helpers.backbones import CACHE_KINDS
from helpers.training import compose_config, make_chat_jsonl, make_model_dir, read_metrics, train_overrides

from medusa_train import MedusaModel, load_backbone
from medusa_train.cli.train import run
from medusa_train.data import PaddingCollator, build_datasets
from medusa_train.data.capture import (
    CaptureMismatch,
    HiddenCollator,
    capture_split,
    load_captured,
    read_index,
    write_index,
)
from medusa_train.data.capture.store import MIN_SHARED_PREFIX, shared_prefix
from medusa_train.model.contract import final_hidden_states
from medusa_train.training.losses import depthwise_loss_backward
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


def hidden_fn(model):
    return final_hidden_states(model.backbone)


SHARD_BYTES = 400 * (64 * 4 + 8)  # 400 tokens of the tiny backbone's float32 states (hidden 64) and labels


def capture_all(model, examples, folder, key="k1", shard_bytes=SHARD_BYTES, world=1):
    """Every rank's share, one after the other (as ``world`` processes would write them), then the index."""
    for rank in range(world):
        done = capture_split(hidden_fn(model), examples, folder, key, batch_size=5, rank=rank, world=world,
                             shard_bytes=shard_bytes)
    assert done["shard_tokens"] == 400 or shard_bytes != SHARD_BYTES
    write_index(folder, examples, key, {"test": True}, done["shard_tokens"])
    return folder


def test_captured_states_are_the_backbones_own_and_read_lazily(setup):
    root, model, tokenizer, train, *_ = setup
    folder = capture_all(model, train, root / "c1")
    index = json.loads((folder / "index.json").read_text())
    assert len(index["shards"]) > 2 and index["tokens"] == sum(len(e["input_ids"]) for e in train)
    assert index["bytes_per_token"] == pytest.approx(model.config.hidden_size * 4 + 8, rel=0.05)  # float32 + label
    cached = load_captured(folder, "k1")
    assert len(cached) == len(train)
    collate = HiddenCollator()
    for example, entry in zip(train, cached):
        batch = collate([entry])
        assert batch["labels"][0].tolist() == example["labels"] and len(entry["input_ids"]) == len(example["labels"])
        with torch.no_grad():
            alone = model(torch.tensor([example["input_ids"]])).hidden_states[0]
        torch.testing.assert_close(batch["hidden"][0], alone, rtol=1e-5, atol=1e-5)


def test_examples_sharing_their_start_run_it_once_and_get_their_own_states(setup):
    """A batch's shared start (a system prompt) runs once, its cache read by every example's rest: each example's
    stored states are still its own forward's; a start shared by fewer than MIN_SHARED_PREFIX tokens, or none, runs
    whole."""
    root, model, *_ = setup
    g = torch.Generator().manual_seed(1)
    start = torch.randint(5, 200, (20,), generator=g).tolist()
    examples = []
    for n in (3, 9, 17, 30, 30, 41, 52):  # 20 shared tokens, then their own
        ids = start + torch.randint(5, 200, (n,), generator=g).tolist()
        examples.append({"input_ids": ids, "labels": ids})
    short = start[:MIN_SHARED_PREFIX - 1] + [201, 202, 203]  # the shortest: shares 7 tokens with the others
    examples.append({"input_ids": short, "labels": short})
    done = capture_split(hidden_fn(model), examples, root / "shared", "k1", batch_size=5, shard_bytes=SHARD_BYTES * 10)
    # length-sorted batches: [short, 23, 29, 37, 50] share 7 < MIN_SHARED_PREFIX tokens (run whole); [50, 61, 72] 20
    assert done["shared_tokens"] == 20 * 2
    write_index(root / "shared", examples, "k1", {"test": True}, done["shard_tokens"])
    for example, entry in zip(examples, load_captured(root / "shared", "k1")):
        with torch.no_grad():
            alone = model(torch.tensor([example["input_ids"]])).hidden_states[0]
        torch.testing.assert_close(HiddenCollator()([entry])["hidden"][0], alone, rtol=1e-5, atol=1e-5)
    batch = torch.tensor([start + [1, 2], start[:10] + [3] + start[11:] + [4, 5]])
    assert shared_prefix(batch, [22, 23]) == 10 and shared_prefix(batch[:1], [22]) == 0
    assert shared_prefix(batch, [MIN_SHARED_PREFIX, 23]) == 0  # each row keeps one token of its own: 7 < 8


def test_each_process_writes_its_share_and_together_they_equal_one_process(setup):
    root, model, tokenizer, train, *_ = setup
    one, two = capture_all(model, train, root / "one"), capture_all(model, train, root / "two", world=2)
    shards = sorted(p.name for p in one.glob("shard-*.safetensors"))
    assert shards == sorted(p.name for p in two.glob("shard-*.safetensors"))
    for name in shards:  # the plan does not depend on the number of processes: same bytes
        assert (one / name).read_bytes() == (two / name).read_bytes()
    part = root / "part"
    capture_split(hidden_fn(model), train, part, "k1", batch_size=5, rank=1, world=2, shard_bytes=SHARD_BYTES)
    assert sorted(p.name for p in part.glob("shard-*.safetensors")) == shards[1::2]
    with pytest.raises(RuntimeError, match="not finished"):
        write_index(part, train, "k1", {}, 400)


def test_a_torn_shard_is_redone_and_finished_ones_are_kept(setup):
    root, model, tokenizer, train, *_ = setup
    folder = capture_all(model, train, root / "torn")
    reference = {p.name: p.read_bytes() for p in folder.glob("shard-*.safetensors")}
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.glob("shard-*.safetensors")}
    torn = folder / "shard-00001.safetensors"
    torn.write_bytes(torn.read_bytes()[:1000])  # a kill mid-write of a copy, a full disk
    (folder / "shard-00002.json").unlink()  # killed between the shard and its manifest
    assert read_index(folder, "k1") is None  # the index no longer vouches for the folder
    with pytest.raises(FileNotFoundError, match="no complete hidden-state capture"):
        load_captured(folder, "k1")  # never read
    done = capture_split(hidden_fn(model), train, folder, "k1", batch_size=5, shard_bytes=SHARD_BYTES)
    assert done["shards"] == 2 and done["kept"] == len(reference) - 2
    write_index(folder, train, "k1", {}, 400)
    assert {p.name: p.read_bytes() for p in folder.glob("shard-*.safetensors")} == reference
    for name, stamp in stamps.items():
        if name not in ("shard-00001.safetensors", "shard-00002.safetensors"):
            assert (folder / name).stat().st_mtime_ns == stamp
    assert len(load_captured(folder, "k1")) == len(train)


def test_states_captured_with_other_settings_are_refused_with_both_keys(setup):
    root, model, tokenizer, train, *_ = setup
    folder = capture_all(model, train, root / "keyed", key="aaaa")
    with pytest.raises(CaptureMismatch, match="settings key aaaa, not bbbb"):
        load_captured(folder, "bbbb")
    (folder / "index.json").unlink()
    with pytest.raises(CaptureMismatch, match="settings key aaaa, not bbbb"):
        capture_split(hidden_fn(model), train, folder, "bbbb", shard_bytes=SHARD_BYTES)


def _loss_and_grads(model, hidden, labels):
    model.zero_grad(set_to_none=True)
    result = depthwise_loss_backward(model.head_logits, hidden, text_targets(labels, model.num_heads))
    return result.loss, [p.grad.clone() for p in model.heads.parameters()]


def test_loss_and_gradients_equal_the_uncached_path(setup):
    root, model, tokenizer, train, *_ = setup
    cached = load_captured(capture_all(model, train, root / "c2"), "k1")
    picks = [0, 5, 9, 13]
    batch = PaddingCollator(tokenizer.pad_token_id)([train[i] for i in picks])
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


def test_a_second_run_on_captured_states_loads_the_backbone_without_its_layers_and_trains_the_same(setup, tmp_path,
                                                                                                    capsys):
    """The first run captures with the whole backbone; the second finds the capture, reads only what the heads
    use (embeddings for the path, LM head for the teacher) and must train the same heads, exactly."""
    from safetensors.torch import load_file

    _, _, _, _, model_dir, data = setup
    common = {"trainer.max_steps": 6, "trainer.eval_every": 3, "loss.targets": "teacher",
              "heads.next_token_input": "true", "heads.path_input": "true",
              "data.cache_hidden_states": "true", "data.cache_dir": tmp_path / "hidden"}
    run(compose_config(train_overrides(model_dir, data, tmp_path / "first", **common)))
    assert "without its decoder layers" not in capsys.readouterr().out
    run(compose_config(train_overrides(model_dir, data, tmp_path / "second", **common)))
    assert "hidden states already captured: backbone loaded without its decoder layers" in capsys.readouterr().out
    first, second = read_metrics(tmp_path / "first"), read_metrics(tmp_path / "second")
    assert [{k: v for k, v in m.items() if k not in ("seconds", "tokens_per_s", "elapsed")} for m in first] == \
        [{k: v for k, v in m.items() if k not in ("seconds", "tokens_per_s", "elapsed")} for m in second]
    a, b = load_file(tmp_path / "first/export/model.safetensors"), load_file(tmp_path / "second/export/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)



@pytest.mark.parametrize("name", list(CACHE_KINDS))
def test_a_shared_start_on_a_hybrid_or_sliding_window_backbone_leaves_each_example_its_own_states(name):
    """A shared start is repeated over the batch only where the backbone's cache holds keys and values alone: a
    sliding window's is; a hybrid's linear-attention, convolution or Mamba state is not (repeating Falcon-H1's cache
    repeats its keys and values and leaves its Mamba state one row, and the batch then fails), so that batch runs
    whole. Either way each example's states are its own forward's."""
    from helpers.backbones import make_cache_kind_backbone

    from medusa_train.data.capture.store import batch_states
    from medusa_train.model.contract import SharedStart

    backbone = make_cache_kind_backbone(name)
    fn = final_hidden_states(backbone)
    g = torch.Generator().manual_seed(1)
    start = torch.randint(5, 290, (20,), generator=g)
    rows = [torch.cat([start, torch.randint(5, 290, (n,), generator=g)]) for n in (30, 12, 25)]
    ids = torch.zeros(3, 50, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    assert shared_prefix(ids, [len(r) for r in rows]) == 20
    with torch.no_grad():
        states = batch_states(fn, ids, mask, 20)
        for i, row in enumerate(rows):
            torch.testing.assert_close(states[i, :len(row)], fn(row[None], torch.ones(1, len(row)).long())[0],
                                       rtol=1e-5, atol=1e-5)
        held = SharedStart()
        fn(ids[:1, :20], mask[:1, :20], held)
        assert held.repeat(3) is name.startswith("mistral")  # keys and values alone: repeated; else run whole
