import json

import pytest
import torch
from helpers.backbones import load_with_tokenizerless, make_tiny_backbone
from safetensors.torch import load_file, save_file

from medusa_train import MedusaModel


def _randomise(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.normal_(std=0.05)
    return model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("share_lm_head", [False, True])
def test_save_load_round_trip_is_bit_exact(tmp_path, tiny_backbone, dtype, share_lm_head):
    model = _randomise(MedusaModel.from_backbone(tiny_backbone, 3, 2, share_lm_head=share_lm_head, dtype=dtype))
    model.save_pretrained(tmp_path / "heads")
    assert sorted(p.name for p in (tmp_path / "heads").iterdir()) == ["config.json", "model.safetensors"]
    loaded = MedusaModel.from_pretrained(tmp_path / "heads", backbone=tiny_backbone)
    saved, again = model.heads_state_dict(), loaded.heads_state_dict()
    assert saved.keys() == again.keys()
    assert all(torch.equal(saved[k], again[k]) and again[k].dtype == saved[k].dtype for k in saved)
    hidden = torch.randn(2, 5, 64)
    for k in range(3):
        assert torch.equal(model.head_logits(hidden, k), loaded.head_logits(hidden, k))


def test_saved_files_hold_heads_only_and_describe_them(tmp_path, tiny_llama):
    model = MedusaModel.from_backbone(tiny_llama, num_heads=2, num_layers=1)
    model.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(tensors) == ["heads.0.blocks.0.linear.bias", "heads.0.blocks.0.linear.weight", "heads.0.lm_head.weight",
                               "heads.1.blocks.0.linear.bias", "heads.1.blocks.0.linear.weight", "heads.1.lm_head.weight"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config | {} == {"format": "medusa_train", "num_heads": 2, "num_layers": 1, "hidden_size": 64,
                           "vocab_size": 256, "share_lm_head": False, "next_token_input": False, "path_input": False,
                           "prefix_attention": False, "prefix_attention_heads": 0, "prefix_intermediate_size": 0,
                           "draft_vocab_size": None,
                           "base_model_name_or_path": "tiny-llama",
                           "dtype": "float32", "format_version": 1}


def test_saving_over_an_existing_export_replaces_it_whole(tmp_path, tiny_llama):
    first = _randomise(MedusaModel.from_backbone(tiny_llama, 2))
    first.save_pretrained(tmp_path / "h")
    second = MedusaModel.from_backbone(tiny_llama, 2)
    second.save_pretrained(tmp_path / "h")
    loaded = MedusaModel.from_pretrained(tmp_path / "h", backbone=tiny_llama)
    assert torch.equal(loaded.heads[0].lm_head.weight, tiny_llama.lm_head.weight)
    assert [p.name for p in tmp_path.iterdir()] == ["h"]  # no temp folders left behind


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("heads.1.lm_head.weight"), "missing tensors: heads.1.lm_head.weight"),
    (lambda t: t.__setitem__("heads.2.lm_head.weight", torch.zeros(256, 64)), "unexpected tensors: heads.2.lm_head.weight"),
    (lambda t: t.__setitem__("heads.0.blocks.0.linear.bias", torch.zeros(65)), "heads.0.blocks.0.linear.bias: file (65,)"),
])
def test_loading_is_strict_and_names_the_tensor(tmp_path, tiny_llama, edit, message):
    MedusaModel.from_backbone(tiny_llama, 2).save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MedusaModel.from_pretrained(tmp_path, backbone=tiny_llama)


def test_refuses_a_backbone_with_another_vocab_or_hidden_size(tmp_path, tiny_llama):
    MedusaModel.from_backbone(tiny_llama, 2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocab size: heads 256, backbone 320"):
        MedusaModel.from_pretrained(tmp_path, backbone=make_tiny_backbone("llama", vocab_size=320))
    with pytest.raises(ValueError, match="hidden size: heads 64, backbone 32"):
        MedusaModel.from_pretrained(tmp_path, backbone=make_tiny_backbone("llama", hidden_size=32))


def test_from_pretrained_loads_the_backbone_named_in_config(tmp_path):
    backbone = make_tiny_backbone("qwen2")
    backbone.save_pretrained(tmp_path / "base")
    from medusa_train import load_backbone

    base, _ = load_with_tokenizerless(load_backbone, tmp_path / "base")
    model = _randomise(MedusaModel.from_backbone(base, 2))
    model.save_pretrained(tmp_path / "heads")
    assert json.loads((tmp_path / "heads/config.json").read_text())["base_model_name_or_path"] == str(tmp_path / "base")
    loaded = MedusaModel.from_pretrained(tmp_path / "heads", dtype="float32")
    ids = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        assert torch.equal(loaded.head_logits(loaded(ids).hidden_states, 1), model.head_logits(model(ids).hidden_states, 1))


def test_num_heads_and_layers_are_validated(tiny_llama):
    with pytest.raises(ValueError, match="heads.num_heads=0: must be >= 1"):
        MedusaModel.from_backbone(tiny_llama, 0)
    with pytest.raises(ValueError, match="heads.num_layers=-1"):
        MedusaModel.from_backbone(tiny_llama, 2, num_layers=-1)


@pytest.mark.slow
def test_packaged_round_trip_and_vocab_mismatch(tmp_path, packaged_backbone):
    backbone, _ = packaged_backbone
    model = _randomise(MedusaModel.from_backbone(backbone, num_heads=2, num_layers=1))
    model.save_pretrained(tmp_path)
    loaded = MedusaModel.from_pretrained(tmp_path, backbone=backbone)
    assert all(torch.equal(a, b) for a, b in zip(model.heads.state_dict().values(), loaded.heads.state_dict().values()))
    with pytest.raises(ValueError, match="vocab size: heads 49152, backbone 256"):
        MedusaModel.from_pretrained(tmp_path, backbone=make_tiny_backbone("llama", hidden_size=576))


def test_a_kv_cache_is_built_only_when_asked_for(tiny_backbone):
    """Training and capture forwards hold no K/V of every layer; decoding asks for them (``use_cache=True``)."""
    assert tiny_backbone.config.use_cache  # transformers' default would build one on every forward
    model = MedusaModel.from_backbone(tiny_backbone, num_heads=2)
    ids = torch.randint(0, tiny_backbone.config.vocab_size, (2, 12))
    with torch.no_grad():
        assert model(ids).past_key_values is None
        cache = model(ids, use_cache=True).past_key_values
    assert cache is not None and cache.get_seq_length() == 12
