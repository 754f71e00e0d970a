"""``+recipe=eagle3``: the real training config trains an EAGLE-3 draft on a tiny real backbone, it learns, its
export is vLLM's layout and decodes losslessly, a changed draft setting is never resumed into, and every setting it
cannot run with is reported before anything loads. Training-time test's loss: step s scores what a chain's step s
sees, and its chunked logits give the gradients of the unchunked loss."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.backbones import make_tiny_backbone
from helpers.training import compose_config, make_chat_jsonl, make_model_dir, read_metrics, train_overrides

from medusa_train.config.check import ConfigError
from medusa_train.families.eagle3.loss import ttt_loss
from medusa_train.families.eagle3.model import Eagle3Model

DRAFT = {"eagle3.aux_layer_ids": "[0,1,3]", "eagle3.ttt_steps": 3}


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-eagle3")
    return make_model_dir(root / "model", layers=4), make_chat_jsonl(root / "chat.jsonl")


def eagle3_config(tiny_setup, output_dir, **extra):
    model_dir, data = tiny_setup
    return compose_config(train_overrides(model_dir, data, output_dir, **{**DRAFT, **extra}), recipe="eagle3")


def test_the_recipe_trains_a_draft_that_learns_and_exports_what_vllm_loads(tiny_setup, tmp_path):
    from medusa_train import load_backbone
    from medusa_train.cli.train import run
    from medusa_train.decoding import TokenTree, tree_generate

    cfg = eagle3_config(tiny_setup, tmp_path / "run", **{"eagle3.draft_vocab_size": 40, "trainer.max_steps": 16,
                                                          "trainer.eval_every": 16, "optim.lr": 0.02})
    assert cfg.method == "eagle3" and cfg.loss.targets == "teacher"
    run(cfg)
    evals = [r for r in read_metrics(tmp_path / "run") if r.get("split") == "eval"]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 16
    assert evals[-1]["loss"] < evals[0]["loss"] and evals[-1]["head1/top1"] > evals[0]["head1/top1"]
    assert {"head1/top1", "head2/top1", "head3/top1"} <= set(evals[-1])  # one figure per chained step
    export = tmp_path / "run" / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 40
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]
    assert (export / "training_config.json").is_file() and (export / "chat_template.jinja").is_file()
    backbone, tokenizer = load_backbone(tiny_setup[0], dtype="float32")
    draft = Eagle3Model.from_pretrained(export, backbone=backbone).eval()
    ids = tokenizer("one two three four", return_tensors="pt").input_ids
    out = tree_generate(draft, ids, TokenTree.chain(3), max_new_tokens=16, eos_token_id=[])
    plain = backbone.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                              eos_token_id=[], pad_token_id=0)
    assert torch.equal(out.sequences, plain)


def test_a_changed_draft_setting_is_not_resumed_into(tiny_setup, tmp_path):
    from medusa_train.cli.train import build, run
    from medusa_train.config.compose import compose_config as compose_raw

    run(eagle3_config(tiny_setup, tmp_path / "run", **{"trainer.max_steps": 2, "data.max_samples": 16}))
    overrides = train_overrides(*tiny_setup, tmp_path / "run", **{**DRAFT, "trainer.max_steps": 4,
                                                                  "data.max_samples": 16, "eagle3.ttt_steps": 2})
    with pytest.raises(ConfigError, match="eagle3.ttt_steps"):  # checked under the run folder's lock, before loading
        run(build(compose_raw("train", ["+recipe=eagle3", "debug=smoke", *overrides])))


def test_by_default_the_draft_vocabulary_is_chosen_from_the_data_and_the_step_cost(tiny_setup, tmp_path, capsys):
    """``eagle3.draft_vocab_size=auto`` (the default): replies that count in ten words fill few of the ~300 tokens,
    so a small draft vocabulary covers them and wins; the log says what each size covers and costs."""
    from safetensors.torch import load_file

    from medusa_train.cli.train import run

    run(eagle3_config(tiny_setup, tmp_path / "run", **{"trainer.max_steps": 2, "data.max_samples": 16}))
    line = next(x for x in capsys.readouterr().out.splitlines() if "eagle3.draft_vocab_size=auto:" in x)
    config = json.loads((tmp_path / "run" / "export" / "config.json").read_text())
    assert config["draft_vocab_size"] < config["vocab_size"]
    assert f"auto: {config['draft_vocab_size']:,} tokens" in line and f"{config['vocab_size']:,}: 100.0%" in line
    d2t = load_file(tmp_path / "run" / "export" / "model.safetensors")["d2t"]
    assert len(d2t) == config["draft_vocab_size"]


def test_what_the_recipe_cannot_run_with_is_reported_up_front(tiny_setup, tmp_path):
    with pytest.raises(ConfigError) as err:
        eagle3_config(tiny_setup, tmp_path, **{"model.quantization": "nf4", "model.fsdp": "true",
                                               "loss.targets": "text", "eagle3.aux_layer_ids": "[1,1,2]",
                                               "eagle3.ttt_steps": 0})
    problems = "\n".join(err.value.problems)
    for key in ("model.quantization", "model.fsdp", "loss.targets", "eagle3.aux_layer_ids",
                "eagle3.ttt_steps"):
        assert key in problems, key


def test_training_on_captured_states_is_training_online(tiny_setup, tmp_path):
    """``data.cache_hidden_states=true``: the backbone runs once and stores, per token, the three states the draft
    reads, the final one and the token id (in a capture keyed apart from Medusa's); training on them gives the
    online run's losses step by step, and a second run reads the capture without the backbone's layers."""
    import json as _json

    from medusa_train.cli.train import run

    common = {"trainer.max_steps": 3, "data.max_samples": 24, "trainer.eval_every": 0, "trainer.save_every": 0,
              "data.cache_dir": str(tmp_path / "cache")}
    run(eagle3_config(tiny_setup, tmp_path / "online", **common))
    run(eagle3_config(tiny_setup, tmp_path / "captured", **common, **{"data.cache_hidden_states": "true"}))
    losses = {name: [r["loss"] for r in read_metrics(tmp_path / name) if r.get("split") == "train"]
              for name in ("online", "captured")}
    assert len(losses["online"]) == 3 and losses["captured"] == pytest.approx(losses["online"], rel=1e-5, abs=1e-6)
    index = _json.loads(next((tmp_path / "cache").glob("*-train/index.json")).read_text())
    assert index["settings"]["states"].startswith("eagle3") and index["settings"]["aux_layer_ids"] == [0, 1, 3]
    assert index["bytes_per_token"] > 4 * 64 * 4  # aux (3H) + final (H) float32, a label and a token id
    run(eagle3_config(tiny_setup, tmp_path / "again", **common, **{"data.cache_hidden_states": "true"}))
    again = [r["loss"] for r in read_metrics(tmp_path / "again") if r.get("split") == "train"]
    assert again == pytest.approx(losses["online"], rel=1e-5, abs=1e-6)


def test_chunked_logits_give_the_gradients_of_the_whole_loss():
    """The loss at ``chunk_size=3`` (logits recomputed in the backward pass) equals ``chunk_size=10**6`` in value
    and in every gradient."""
    backbone = make_tiny_backbone("llama", layers=4)
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100
    results = []
    for chunk in (3, 10**6):
        torch.manual_seed(0)
        model = Eagle3Model.from_backbone(backbone, token_map=torch.arange(0, 256, 2), aux_layer_ids=[0, 1, 3])
        with torch.no_grad():
            out = model(ids, attention_mask=mask)
        result = ttt_loss(model, out.draft_inputs, out.hidden_states, ids, mask, labels, 4, 0.8, chunk_size=chunk,
                          backward=torch.Tensor.backward)
        results.append((result, {n: p.grad.clone() for n, p in model.draft.named_parameters()}))
    (a, grads_a), (b, grads_b) = results
    assert torch.allclose(a.loss, b.loss, atol=1e-6) and [h.count for h in a.per_head] == [h.count for h in b.per_head]
    assert all(h.count > 0 for h in a.per_head)
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], atol=1e-6), name
