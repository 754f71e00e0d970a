"""Medusa-2's ``merged/``: the LoRA update added to the ORIGINAL weights by default (``trainer.merge_into``), not
to a dequantized 4-bit copy; ``drift.original=auto`` then compares with the original model; and the vLLM serve
line of such an export names the merged folder by its absolute path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.backbones import PACKAGED_MODEL
from helpers.training import compose_config, make_chat_jsonl, make_model_dir, train_overrides

from medusa_train.backbone.load import load_backbone
from medusa_train.backbone.lora import add_lora
from medusa_train.backbone.merge import MERGED_DIR, merge_backbone, read_backbone_info
from medusa_train.cli import export as export_cli
from medusa_train.cli.train import run
from medusa_train.evaluation.drift import describe_original, original_backbone
from medusa_train.export.serve import served_base

LAYER = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("merge")
    return make_model_dir(root / "model"), make_chat_jsonl(root / "chat.jsonl", n=24)


def _trained_adapter(name_or_path, adapter_dir: Path, r: int = 4, alpha: int = 8):
    """A 4-bit backbone with LoRA whose B is non-zero (as after training), the adapter saved as training saves it."""
    quantized, _ = load_backbone(name_or_path, dtype="float32", quantization="nf4")
    peft_model = add_lora(quantized, r=r, alpha=alpha, dropout=0.0, target_modules="all-linear",
                          gradient_checkpointing=False)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    peft_model.save_pretrained(adapter_dir, save_embedding_layers=False)
    layer = peft_model.get_base_model().get_submodule(LAYER)
    update = (alpha / r) * (layer.lora_B["default"].weight @ layer.lora_A["default"].weight).detach()
    return peft_model, update


@pytest.mark.parametrize("model", ["tiny", pytest.param("packaged", marks=pytest.mark.slow)])
def test_merged_into_original_weights_is_original_plus_the_lora_update(tiny, tmp_path, model):
    name = tiny[0] if model == "tiny" else PACKAGED_MODEL
    peft_model, update = _trained_adapter(name, tmp_path / "adapter")
    original, _ = load_backbone(name, dtype="float32")
    w_original = original.get_submodule(LAYER).weight.detach()

    merged = merge_backbone(peft_model, tmp_path / "adapter", str(name), dtype="float32")  # into="original"
    torch.testing.assert_close(merged.get_submodule(LAYER).weight, w_original + update, rtol=1e-6, atol=1e-7)
    untouched = "model.embed_tokens"  # never adapted: the original's exactly
    assert torch.equal(merged.get_submodule(untouched).weight, original.get_submodule(untouched).weight)

    dequantized = merge_backbone(peft_model, tmp_path / "adapter", str(name), dtype="float32", into="dequantized")
    w_4bit = dequantized.get_submodule(LAYER).weight - update  # the degraded copy the option no longer defaults to
    quantization_error = (w_4bit - w_original).abs().max()
    assert quantization_error > 1e-3
    assert (merged.get_submodule(LAYER).weight - w_original - update).abs().max() < quantization_error / 100
    with pytest.raises(ValueError, match="trainer.merge_into='nf4'"):
        merge_backbone(peft_model, tmp_path / "adapter", str(name), into="nf4")


def _medusa2_run(model_dir, data, out, **extra):
    values = {"peft.r": 4, "peft.alpha": 8, "peft.dropout": 0.0, "loss.head_warmup_steps": 0,
              "trainer.merge_export": "true", "trainer.eval_every": 0, "trainer.save_every": 0,
              "trainer.max_steps": 2, "optim.lr": 5e-3, **extra}
    run(compose_config(train_overrides(model_dir, data, out, **values), recipe="medusa2"))
    return out / "export"


def test_export_merges_into_the_original_and_drift_compares_with_the_original(tiny, tmp_path):
    model_dir, data = tiny
    assert compose_config([], recipe="medusa2").trainer.merge_into == "original"
    export = _medusa2_run(model_dir, data, tmp_path / "run")
    info = read_backbone_info(export)
    assert info["merged"] == MERGED_DIR and info["merged_from"] == "original"

    original, _ = original_backbone(export, dtype="float32")  # drift.original=auto
    plain, _ = load_backbone(model_dir, dtype="float32")
    for (name, got), (_, want) in zip(original.state_dict().items(), plain.state_dict().items(), strict=True):
        assert torch.equal(got, want), name  # the original model itself, not a 4-bit copy
    assert describe_original(export).startswith(f"the original model {model_dir}")

    kept = _medusa2_run(model_dir, data, tmp_path / "dequantized", **{"trainer.merge_into": "dequantized"})
    assert read_backbone_info(kept)["merged_from"] == "dequantized"
    assert "4-bit base" in describe_original(kept)
    rebuilt, _ = original_backbone(kept, dtype="float32")
    differs = [n for (n, a), (_, b) in zip(rebuilt.state_dict().items(), plain.state_dict().items()) if not torch.equal(a, b)]
    assert differs  # that one is the dequantized base


def test_vllm_serve_line_of_a_medusa2_export_names_the_merged_folder_absolutely(tiny, tmp_path, capsys, monkeypatch):
    model_dir, data = tiny
    export = _medusa2_run(model_dir, data, tmp_path / "run")
    monkeypatch.chdir(tmp_path)  # relative to where the user stands, "merged" means nothing
    export_cli.run(export_cli.build_export_config({"heads": str(export.relative_to(tmp_path)), "format": "vllm",
                                                   "output": "served"}))
    serve = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("vllm serve "))
    base = Path(serve.split()[2])
    assert base.is_absolute() and base == (export / MERGED_DIR).resolve()
    assert (base / "config.json").is_file()
    assert json.loads((tmp_path / "served/config.json").read_text())["base_model_name_or_path"] == MERGED_DIR
    # without the source folder: a placeholder saying what to put there, never a bare "merged"
    assert served_base(MERGED_DIR, [tmp_path / "served"]).startswith("<the merged/ folder")
