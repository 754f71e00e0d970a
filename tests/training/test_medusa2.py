"""Medusa-2 recipe: 4-bit LoRA backbone + heads, combined loss, two stages, export and merge (tiny models)."""

import json
import os
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT
from helpers.training import compose_config as compose_train_config
from helpers.training import make_chat_jsonl, make_model_dir, read_metrics, train_overrides
from torch.utils.data import DataLoader

from medusa_train.backbone.load import load_backbone
from medusa_train.backbone.lora import add_lora
from medusa_train.backbone.merge import read_backbone_info
from medusa_train.cli.train import run
from medusa_train.config.check import ConfigError
from medusa_train.data.tokenize import IGNORE_INDEX
from medusa_train.evaluation.drift import backbone_drift
from medusa_train.families.medusa.recipe_medusa2 import Medusa2Recipe, head_weight_at
from medusa_train.model.load import load_adapted_export
from medusa_train.training.losses import depthwise_loss_naive
from medusa_train.training.targets import (
    Teacher,
    teacher_targets,
)

compose_config = partial(compose_train_config, recipe="medusa2")  # medusa1 where a test says so


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny2")
    return make_model_dir(root / "model"), make_chat_jsonl(root / "chat.jsonl")


def tiny_overrides(model_dir, data, out, **extra) -> list[str]:
    values = {"peft.r": 4, "peft.alpha": 8, "peft.dropout": 0.0, "loss.head_warmup_steps": 0,
              "trainer.merge_export": "false", "trainer.eval_every": 0, "trainer.save_every": 0, **extra}
    return train_overrides(model_dir, data, out, **values)


def make_recipe(tiny_setup, out, **extra) -> Medusa2Recipe:
    model_dir, data = tiny_setup
    recipe = Medusa2Recipe(compose_config(tiny_overrides(model_dir, data, out, **extra)))
    recipe.setup()
    return recipe


def first_batch(recipe, size: int = 4) -> dict:
    loader = DataLoader(recipe.run.data.train, batch_sampler=[list(range(size))], collate_fn=recipe.run.data.collator)
    return next(iter(loader))


def randomize_lora_b(model, seed: int = 0, std: float = 0.05) -> None:
    """LoRA B starts at zero (adapted == original); give it values so every LoRA weight gets a gradient."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def grads(recipe) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in recipe.run.parameters.items() if p.grad is not None}


def zero_grads(recipe) -> None:
    for p in recipe.run.parameters.values():
        p.grad = None


# ------------------------------------------------------------------------------------ config
def test_the_recipe_composes_with_the_smoke_trainer():
    cfg = compose_config([])
    assert cfg.method == "medusa2" and cfg.stage is None and cfg.model.quantization == "nf4"
    assert cfg.loss.base == "distill" and cfg.loss.head_weight == 0.2 and cfg.loss.head_warmup == "sine"
    assert cfg.optim.head_lr_multiplier == 5.0 and cfg.trainer.merge_export is True
    assert cfg.trainer.output_dir == "outputs/medusa2-smoke" and cfg.trainer.max_steps == 12
    assert compose_config(["stage=1"]).stage == 1


def test_stage_2_needs_stage_1_heads_and_stages_need_medusa2():
    with pytest.raises(ConfigError) as err:
        compose_config(["stage=2"])
    assert any(p.startswith("heads.init_from=None: stage=2 starts from stage 1's heads") for p in err.value.problems)
    with pytest.raises(ConfigError, match="stage=1: only applies to"):
        compose_config(["stage=1"], recipe="medusa1")


@pytest.mark.parametrize("schedule, expected", [
    ("linear", [0.0, 0.05, 0.1, 0.15, 0.2, 0.2, 0.2]),
    ("sine", [0.0, 0.2 * 0.3826834323650898, 0.2 * 0.7071067811865476, 0.2 * 0.9238795325112867, 0.2, 0.2, 0.2]),
])
def test_head_weight_warms_up_from_zero(schedule, expected):
    values = [head_weight_at(step, 0.2, 4, schedule) for step in range(7)]
    assert values == pytest.approx(expected, rel=1e-12, abs=0)
    assert values[0] == 0.0 and values[4:] == [0.2, 0.2, 0.2]
    assert head_weight_at(0, 0.2, 0, schedule) == 0.2  # no warm-up


# ------------------------------------------------------------------------------------ model
def test_lora_on_the_4bit_backbone_float32_heads_and_two_learning_rates(tiny_setup, tmp_path):
    import bitsandbytes as bnb
    from peft.tuners.tuners_utils import BaseTunerLayer

    recipe = make_recipe(tiny_setup, tmp_path, **{"optim.head_lr_multiplier": 4.0})
    model = recipe.model
    assert isinstance(model.backbone.get_base_model().model.layers[0].mlp.down_proj.base_layer, bnb.nn.Linear4bit)
    assert not isinstance(model.lm_head, BaseTunerLayer) and not model.lm_head.weight.requires_grad
    names = list(recipe.run.parameters)
    assert all(n.startswith("heads.") or ".lora_" in n for n in names)
    lora = [n for n in names if ".lora_" in n]
    assert len(lora) == 2 * 7 * 2  # A and B x 7 projections x 2 layers
    assert all(p.dtype == torch.float32 for n, p in recipe.run.parameters.items() if n.startswith("heads."))
    lrs = {g["name"]: g["lr"] for g in recipe.run.optimizer.param_groups}
    assert lrs["heads"] == pytest.approx(4 * lrs["lora"])
    with pytest.raises(ValueError, match="output layer"):
        add_lora(load_backbone(tiny_setup[0], dtype="float32", quantization="nf4")[0], 4, 8, 0.0,
                 ["q_proj", "lm_head"])
    recipe.cleanup()


def test_original_is_the_adapter_disabled_model_and_kl_starts_at_zero(tiny_setup, tmp_path):
    recipe = make_recipe(tiny_setup, tmp_path)
    batch = first_batch(recipe)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert recipe.cfg.loss.base == "distill"
    record = recipe.evaluate()
    assert record["base/kl"] == 0.0 and record["base/agreement"] == 1.0
    result = recipe.micro_step(batch, loss_scale=1.0)
    assert result.base.kl == 0.0  # LoRA B = 0 at init: the adapted model is the original

    randomize_lora_b(recipe.model)
    fresh, _ = load_backbone(tiny_setup[0], dtype="float32", quantization="nf4")
    with torch.no_grad():
        expected = fresh(ids, attention_mask=mask).logits
        original = recipe.model.base_logits(recipe.original_hidden_states(batch))
        adapted = recipe.model.base_logits(recipe.model(ids, attention_mask=mask).hidden_states)
    assert torch.equal(original, expected)  # the teacher is the original model, exactly
    assert not torch.allclose(adapted, expected, atol=1e-3)
    assert recipe.micro_step(batch, loss_scale=1.0).base.kl > 0
    recipe.cleanup()


@pytest.mark.parametrize("base, head_targets, prefix", [("ce", "text", False), ("distill", "text", False),
                                                        ("distill", "teacher", False), ("distill", "text", True)])
def test_combined_loss_gradients_equal_the_naive_all_at_once_loss(tiny_setup, tmp_path, base, head_targets, prefix):
    """With loss.targets=teacher the heads learn the adapted model's own distribution (detached); a
    prefix attention layer trains with the heads and passes their gradients on to the LoRA."""
    recipe = make_recipe(tiny_setup, tmp_path, **{"loss.base": base, "loss.chunk_size": 7, "loss.targets": head_targets,
                                                  "loss.head_warmup_steps": 4, "loss.head_warmup": "linear",
                                                  "heads.prefix_attention": str(prefix).lower()})
    recipe.run.step = 2  # lambda = 0.2 * 2 / 4
    randomize_lora_b(recipe.model)
    if prefix:  # away from its identity start, so every one of its weights gets a gradient
        with torch.no_grad():
            for p in recipe.model.prefix.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    batch = first_batch(recipe)
    result = recipe.micro_step(batch, loss_scale=0.5)
    chunked = grads(recipe)
    zero_grads(recipe)

    model, labels = recipe.model, batch["labels"]
    model.eval()
    with torch.no_grad(), model.backbone.disable_adapter():
        original_logits = model(batch["input_ids"], attention_mask=batch["attention_mask"],
                                return_base_logits=True).base_logits
    model.train()
    hidden = model(batch["input_ids"], attention_mask=batch["attention_mask"]).hidden_states
    logits = model.base_logits(hidden)[:, :-1].float()
    targets = labels[:, 1:]
    valid = targets != IGNORE_INDEX
    if base == "ce":
        base_loss = F.cross_entropy(logits[valid], targets[valid])
    else:
        log_p = original_logits[:, :-1].float().log_softmax(-1)[valid]
        base_loss = F.kl_div(logits[valid].log_softmax(-1), log_p, log_target=True, reduction="batchmean")
    teacher = Teacher(model.base_logits, hidden.detach()) if head_targets == "teacher" else None
    heads_loss, _ = depthwise_loss_naive(model.head_logits, model.head_features(hidden), teacher_targets(labels, model.num_heads, teacher), recipe.cfg.loss.head_decay)
    ((base_loss + 0.1 * heads_loss) * 0.5).backward()
    naive = grads(recipe)

    assert result.head_weight == pytest.approx(0.1)
    assert float(result.loss) == pytest.approx(base_loss.item() + 0.1 * heads_loss.item(), rel=1e-5)
    assert sorted(chunked) == sorted(naive) == sorted(recipe.run.parameters)
    assert any(".lora_A" in n and chunked[n].abs().sum() > 0 for n in chunked)
    assert not prefix or all(chunked[n].abs().sum() > 0 for n in chunked if n.startswith("prefix."))
    for name in naive:
        torch.testing.assert_close(chunked[name], naive[name], rtol=1e-4, atol=1e-7, msg=name)
    recipe.cleanup()


def test_generate_and_eval_do_not_corrupt_lora_gradients(tiny_setup, tmp_path):
    """bitsandbytes repacks 4-bit weights on the first no-grad eval forward on AVX512-BF16 CPUs."""
    recipes = [make_recipe(tiny_setup, tmp_path / name, **{"loss.base": "ce"}) for name in ("generated", "fresh")]
    for recipe in recipes:
        randomize_lora_b(recipe.model)
    used, fresh = recipes
    batch = first_batch(used)
    used.model.eval()
    with torch.no_grad():
        used.model.backbone.generate(input_ids=batch["input_ids"][:1, :12], max_new_tokens=6, do_sample=False)
    used.evaluate()
    used.micro_step(batch, loss_scale=1.0)
    fresh.micro_step(batch, loss_scale=1.0)
    a, b = grads(used), grads(fresh)
    assert sorted(a) == sorted(b) and any(".lora_A" in n for n in a)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=0, msg=name)
    for recipe in recipes:
        recipe.cleanup()


def dequantized_weights(model) -> dict[str, torch.Tensor]:
    """Every bitsandbytes layer's weight as the float matrix it stands for, by module name."""
    import bitsandbytes as bnb
    from peft.utils.integrations import dequantize_bnb_weight

    return {name: dequantize_bnb_weight(module.weight, getattr(module, "state", None)).float()
            for name, module in model.named_modules()
            if isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))}


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_quantized_lora_gradients_equal_a_dense_model_holding_the_dequantized_weights(tiny_setup, tmp_path,
                                                                                     quantization):
    """The LoRA and head gradients of a step on the quantized backbone are those of the same step on a
    dense float32 backbone whose linear layers hold the dequantized weights (same LoRA, same heads)."""
    quantized = make_recipe(tiny_setup, tmp_path / "q", **{"model.quantization": quantization, "loss.base": "ce"})
    dense = make_recipe(tiny_setup, tmp_path / "d", **{"model.quantization": "null", "loss.base": "ce"})
    randomize_lora_b(quantized.model)
    weights = dequantized_weights(quantized.model.backbone)
    assert len(weights) == 7 * 2  # every projection of both layers is quantized, each wrapped by LoRA
    with torch.no_grad():
        for name, weight in weights.items():
            dense.model.backbone.get_submodule(name).weight.copy_(weight)  # same name: both are peft-wrapped
        for name, p in dense.run.parameters.items():  # the same LoRA (B randomized) and the same heads
            p.copy_(quantized.run.parameters[name])
    assert sorted(dense.run.parameters) == sorted(quantized.run.parameters)
    batch = first_batch(quantized)
    q_result = quantized.micro_step(batch, loss_scale=1.0)
    d_result = dense.micro_step(batch, loss_scale=1.0)
    got, expected = grads(quantized), grads(dense)
    assert sorted(got) == sorted(expected) and any(".lora_A" in n for n in got)
    assert all(expected[n].abs().sum() > 0 for n in expected if ".lora_" in n)
    # both forwards dequantize and multiply in float32, so the loss is bit-identical
    assert float(q_result.loss) == float(d_result.loss)
    if quantization == "nf4":  # and the 4-bit backward multiplies by the dequantized weight: exactly the dense model
        for name in expected:
            assert torch.equal(got[name], expected[name]), name
    else:
        # In training mode bitsandbytes runs int8 layers on CPU through MatMul8bitFp: forward = dequantize
        # + F.linear (the dense forward, hence the equal loss), but its backward flattens grad_output to 2-D
        # before multiplying by the dequantized weight, so input gradients are summed in another order.
        # Measured: max |difference| <= 6e-7 of each gradient's largest entry; asserted at 1e-5.
        for name in expected:
            scale = expected[name].abs().max().item()
            err = (got[name] - expected[name]).abs().max().item()
            assert err <= 1e-5 * scale, (name, err, scale)
    for recipe in (quantized, dense):
        recipe.cleanup()


def test_backbone_drift_is_zero_at_init_and_grows_with_the_adapter(tiny_setup, tmp_path):
    recipe = make_recipe(tiny_setup, tmp_path)
    peft_model, tokenizer = recipe.model.backbone, recipe.tokenizer
    prompts = ["Count from one.", "Count from three."]
    same = backbone_drift(peft_model, peft_model, tokenizer, prompts, max_new_tokens=6)
    assert same["mean_kl"] == 0.0 and same["greedy_agreement"] == 1.0 and same["num_tokens"] > 0
    randomize_lora_b(recipe.model, std=0.5)
    original, _ = load_backbone(tiny_setup[0], dtype="float32", quantization="nf4")
    moved = backbone_drift(original, peft_model, tokenizer, prompts, max_new_tokens=6)
    assert moved["mean_kl"] > 0 and moved["num_tokens"] == same["num_tokens"]
    assert moved == backbone_drift(peft_model, peft_model, tokenizer, prompts, max_new_tokens=6)
    recipe.cleanup()


# ------------------------------------------------------------------------------------ runs and export
def test_stage_1_caches_the_quantized_backbones_own_states(tiny_setup, tmp_path):
    """The hidden-state cache is keyed by the whole model section: a stage 1 run on the 4-bit backbone
    must not reuse states an unquantized medusa1 run cached for the same data, and must train as it
    would without the cache."""
    model_dir, data = tiny_setup
    steps = {"trainer.max_steps": 2, "trainer.eval_every": 1}
    cache = {"data.cache_hidden_states": "true", "data.cache_dir": tmp_path / "hidden", **steps}
    run(compose_config(train_overrides(model_dir, data, tmp_path / "medusa1", **cache), recipe="medusa1"))
    run(compose_config(tiny_overrides(model_dir, data, tmp_path / "cached", stage=1, **cache)))
    run(compose_config(tiny_overrides(model_dir, data, tmp_path / "plain", stage=1, **steps)))
    assert len(list((tmp_path / "hidden").iterdir())) == 4  # train + eval, per backbone
    plain, cached = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "cached")
    assert [m["step"] for m in plain] == [m["step"] for m in cached]
    for a, b in zip(plain, cached):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), a["step"]


def test_stage_1_trains_heads_only_then_stage_2_starts_from_them_and_merges(tiny_setup, tmp_path):
    model_dir, data = tiny_setup
    stage1, stage2 = tmp_path / "stage1", tmp_path / "stage2"
    run(compose_config(tiny_overrides(model_dir, data, stage1, stage=1, **{"trainer.max_steps": 3})))
    checkpoint = next((stage1 / "checkpoints").iterdir()) / "trainable.safetensors"
    from safetensors.torch import load_file

    assert all(k.startswith("heads.") for k in load_file(str(checkpoint)))
    info = read_backbone_info(stage1 / "export")
    assert info["adapter"] is None and info["merged"] is None and info["quantization"] == "nf4"
    assert json.loads((stage1 / "export/config.json").read_text())["base_model_name_or_path"] == str(model_dir)

    run(compose_config(tiny_overrides(model_dir, data, stage2, stage=2, **{
        "heads.init_from": stage1 / "export", "trainer.max_steps": 3, "trainer.merge_export": "true",
        "trainer.merge_into": "dequantized"})))  # the model that trained, so the adapter form equals it
    last_stage1 = [m for m in read_metrics(stage1) if m["split"] == "eval"][-1]
    first_stage2 = [m for m in read_metrics(stage2) if m["split"] == "eval"][0]
    assert first_stage2["step"] == 0 and first_stage2["base/kl"] == 0.0
    for k in (1, 2, 3):  # stage 2 starts from stage 1's heads on the same (not yet adapted) backbone
        assert first_stage2[f"head{k}/loss"] == pytest.approx(last_stage1[f"head{k}/loss"], rel=1e-5)
    train = [m for m in read_metrics(stage2) if m["split"] == "train"]
    assert {"base/kl", "base/ce", "base/top1", "heads_loss", "head_weight", "lr_heads"} <= set(train[-1])

    export = stage2 / "export"
    assert (export / "adapter/adapter_model.safetensors").is_file() and (export / "merged/config.json").is_file()
    assert json.loads((export / "config.json").read_text())["base_model_name_or_path"] == "merged"
    merged, _ = load_adapted_export(export, "merged")
    adapted, _ = load_adapted_export(export, "adapter")
    ids = torch.tensor([[5, 17, 42, 99, 123, 7, 250, 31]])
    with torch.no_grad():
        a = merged(ids, return_base_logits=True).base_logits
        b = adapted(ids, return_base_logits=True).base_logits
        with adapted.backbone.disable_adapter():
            original = adapted(ids, return_base_logits=True).base_logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # float32: merging only reorders the sums
    assert (a - original).abs().max() > 1e-4  # the adapter did move the backbone


BLOCKED_EVALUATE = textwrap.dedent("""
    import json, runpy, sys
    for name in ("peft", "bitsandbytes"):
        sys.modules[name] = None  # import raises ModuleNotFoundError, as if not installed
    sys.argv = ["scripts/evaluate.py", *sys.argv[1:]]
    try:
        runpy.run_path("scripts/evaluate.py", run_name="__main__")
    finally:
        loaded = [k for k, v in sys.modules.items() if k.split(".")[0] in ("peft", "bitsandbytes") and v is not None]
        print(json.dumps({"loaded": loaded}))
""")


@pytest.mark.integration
def test_scripts_evaluate_reads_a_merged_export_without_peft_or_bitsandbytes_and_reports_drift(tiny_setup, tmp_path):
    model_dir, data = tiny_setup
    out = tmp_path / "run"
    run(compose_config(tiny_overrides(model_dir, data, out, **{"trainer.max_steps": 3, "trainer.merge_export": "true",
                                                               "trainer.merge_into": "dequantized", "optim.lr": 5e-3})))
    export = out / "export"
    # merged into the dequantized weights, the original a drift is measured against is the 4-bit base:
    # merged/ minus the LoRA update equals the adapter-disabled model (the default, merge_into=original:
    # tests/model/test_cuda_path_merge.py)
    from medusa_train.evaluation.drift import original_backbone

    original, _ = original_backbone(export, dtype="float32")
    adapted, _ = load_adapted_export(export, "adapter")
    ids = torch.tensor([[5, 17, 42, 99, 123, 7, 250, 31, 64, 200]])
    with torch.no_grad():
        with adapted.backbone.disable_adapter():
            expected = adapted(ids, return_base_logits=True).base_logits
        moved = (adapted(ids, return_base_logits=True).base_logits - expected).abs().max()
        rebuilt = original(ids).logits
    assert moved > 1e-3  # the adapter changed the backbone...
    torch.testing.assert_close(rebuilt, expected, rtol=1e-4, atol=1e-5)  # ...and its update is undone exactly

    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps({"turns": [t], "category": "test", "id": i}) + "\n" for i, t in
                             enumerate(["Name three colours.", "What is two plus two?"])))
    report_dir = tmp_path / "eval"
    args = [f"heads={export}", "tree=chain", f"bench.source={bench}", "bench.turns=1", "generation.max_new_tokens=8",
            "drift.original=auto", "drift.max_new_tokens=12", f"output_dir={report_dir}", "progress=false",
            "threads=1"]
    result = subprocess.run([sys.executable, "-c", BLOCKED_EVALUATE, *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["loaded"] == []
    assert "speedup: " in result.stdout
    report = json.loads((report_dir / "report.json").read_text())
    assert report["mismatches"] == 0 and report["settings"]["model"].endswith("merged")
    drift = report["drift"]
    assert drift["original"] == "the Medusa-2 export's 4-bit base (dequantized, without the adapter)"
    assert drift["prompts"] == 2 and 2 <= drift["num_tokens"] <= 24
    assert drift["mean_kl"] > 0 and 0 <= drift["greedy_agreement"] <= 1
    assert "## Backbone drift" in (report_dir / "report.md").read_text()
    # the same figures from the library, with the model rebuilt here
    merged, tokenizer = load_adapted_export(export, "merged")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=False) for t in ("Name three colours.", "What is two plus two?")]
    ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    again = backbone_drift(original, merged.backbone, tokenizer, ids, max_new_tokens=12)
    assert again["num_tokens"] == drift["num_tokens"]
    assert again["mean_kl"] == pytest.approx(drift["mean_kl"], rel=1e-4)


BLOCKED_LOAD = textwrap.dedent("""
    import json, sys
    for name in ("peft", "bitsandbytes"):
        sys.modules[name] = None  # import raises ModuleNotFoundError, as if not installed
    import torch
    from medusa_train import MedusaModel
    from medusa_train.decoding import TokenTree, tree_generate
    model = MedusaModel.from_pretrained(sys.argv[1], dtype="float32").eval()
    ids = torch.tensor([[5, 17, 42, 99, 123, 7]])
    out = tree_generate(model, ids, tree=TokenTree.chain(model.num_heads), max_new_tokens=12, eos_token_id=[])
    plain = model.backbone.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None,
                                    pad_token_id=0, min_new_tokens=12)
    loaded = [k for k, v in sys.modules.items() if k.split(".")[0] in ("peft", "bitsandbytes") and v is not None]
    print(json.dumps({"medusa": out.sequences[0].tolist(), "plain": plain[0].tolist(), "loaded": loaded,
                      "base": model.config.base_model_name_or_path}))
""")


@pytest.mark.integration
def test_smoke_run_through_accelerate_launch_exports_a_merged_backbone_that_needs_no_peft(tiny_setup, tmp_path):
    model_dir, data = tiny_setup
    accelerate = str(Path(sys.executable).parent / "accelerate")
    cmd = [accelerate, "launch", "train.py", "+recipe=medusa2", "debug=smoke",
           *train_overrides(model_dir, data, tmp_path, **{"model.dtype": "bfloat16", "trainer.max_steps": 4,
                                                          "trainer.eval_every": 0, "peft.r": 4, "peft.alpha": 8,
                                                          "loss.head_warmup_steps": 2,
                                                          "trainer.merge_into": "dequantized"})]
    env = dict(os.environ, OMP_NUM_THREADS="2")
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(tmp_path)
    evals = [m for m in metrics if m["split"] == "eval"]
    assert [m["step"] for m in evals] == [0, 4] and evals[0]["base/kl"] == 0.0
    train = [m for m in metrics if m["split"] == "train"]
    assert [m["head_weight"] for m in train] == pytest.approx([0.0, 0.2 * 0.7071067811865476, 0.2, 0.2])
    export = tmp_path / "export"
    for name in ("config.json", "model.safetensors", "adapter/adapter_config.json", "merged/config.json",
                 "merged/model.safetensors", "merged/tokenizer.json", "backbone.json", "training_config.json"):
        assert (export / name).is_file(), name
    assert "quantization_config" not in json.loads((export / "merged/config.json").read_text())

    merged, _ = load_adapted_export(export, "merged")
    adapted, _ = load_adapted_export(export, "adapter")
    ids = torch.tensor([[5, 17, 42, 99, 123, 7, 250, 31, 64, 200, 3, 150]])
    with torch.no_grad():
        a = merged(ids, return_base_logits=True).base_logits.float()
        b = adapted(ids, return_base_logits=True).base_logits.float()
        with adapted.backbone.disable_adapter():
            original = adapted(ids, return_base_logits=True).base_logits.float()
    # bf16: the merged weight W + BA is rounded once, the 4-bit path adds BAx in bf16 instead (measured: 1 ulp)
    assert (a - b).abs().max() <= 0.02 * b.abs().max()
    assert (a - b).abs().max() < 0.1 * (b - original).abs().max()  # far below what the adapter changed
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9

    blocked = subprocess.run([sys.executable, "-c", BLOCKED_LOAD, str(export)], cwd=ROOT, capture_output=True,
                             text=True, timeout=300, env=env)
    assert blocked.returncode == 0, blocked.stderr[-3000:]
    out = json.loads(blocked.stdout.strip().splitlines()[-1])
    assert out["loaded"] == [] and out["base"] == "merged"
    assert len(out["medusa"]) == 6 + 12 and out["medusa"] == out["plain"]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_resume_restores_lora_heads_optimizer_and_lambda(tiny_setup, tmp_path, dropout):
    import shutil

    model_dir, data = tiny_setup
    extra = {"peft.dropout": dropout, "loss.head_warmup_steps": 3, "trainer.save_every": 2, "trainer.max_steps": 4}
    run(compose_config(tiny_overrides(model_dir, data, tmp_path / "ref", **extra)))
    cut = tmp_path / "cut"  # the same run, stopped right after its step-2 checkpoint
    shutil.copytree(tmp_path / "ref", cut)
    shutil.rmtree(cut / "checkpoints/step-0000004")
    shutil.rmtree(cut / "export")
    kept = [m for m in read_metrics(cut) if m["step"] <= 2 and m["split"] == "train" or m["step"] == 0]
    (cut / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in kept))
    run(compose_config(tiny_overrides(model_dir, data, cut, **extra)))
    ref = {m["step"]: m for m in read_metrics(tmp_path / "ref") if m["split"] == "train"}
    resumed = {m["step"]: m for m in read_metrics(cut) if m["split"] == "train"}
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        for key in ("loss", "base/kl", "head1/loss", "head_weight", "lr", "lr_heads"):
            assert resumed[step][key] == pytest.approx(ref[step][key], rel=1e-6, abs=1e-12), (step, key)
