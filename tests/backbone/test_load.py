import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.backbones import PACKAGED_MODEL, load_with_tokenizerless, make_tiny_backbone

from medusa_train import load_backbone
from medusa_train.backbone import assets
from medusa_train.backbone.load import resolve_dtype


def test_offline_hub_id_gives_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="Point model.name_or_path at a local Hugging Face folder"):
        load_backbone("some-org/some-model-that-is-not-here")


def test_missing_local_path_is_not_mistaken_for_a_hub_id(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_backbone(tmp_path / "not-there")


def test_folder_without_config_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_backbone(tmp_path)


def test_missing_gguf_and_bad_options_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        load_backbone(tmp_path / "model.gguf")
    with pytest.raises(ValueError, match="model.quantization='nf8'"):
        load_backbone(tmp_path, quantization="nf8")
    with pytest.raises(ValueError, match="dtype='half-ish'"):
        resolve_dtype("half-ish")
    with pytest.raises(ValueError, match="unknown packaged model 'packaged:nope'"):
        load_backbone("packaged:nope")


def test_local_folder_loads_frozen_with_pad_token(tmp_path):

    make_tiny_backbone("gpt_neox").save_pretrained(tmp_path)
    model, tokenizer = load_with_tokenizerless(load_backbone, tmp_path)
    assert type(model).__name__ == "GPTNeoXForCausalLM"
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.training and tokenizer.pad_token is not None
    assert model.dtype == torch.float32


@pytest.mark.slow
def test_packaged_model_loads_offline_from_cache(monkeypatch, packaged_backbone):
    model, tokenizer = packaged_backbone  # converted (or already cached) once
    assert model.config.vocab_size == 49152 and model.config.num_hidden_layers == 30
    assert tokenizer.chat_template and tokenizer.pad_token == "<|im_end|>"

    def no_network(*args, **kwargs):
        raise AssertionError("a cached packaged model must not be downloaded again")

    monkeypatch.setattr(assets, "_download_wheel", no_network)
    again, _ = load_backbone(PACKAGED_MODEL, dtype="bfloat16")
    assert again.dtype == torch.bfloat16
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        answer = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tokenizer.decode(answer[0, ids.shape[1]:])


@pytest.mark.integration
@pytest.mark.slow
def test_concurrent_first_conversions_do_not_corrupt_the_cache(tmp_path, packaged_backbone):
    gguf = assets.packaged_model_file(PACKAGED_MODEL)  # the downloaded file, shared
    link = tmp_path / "SmolLM2.gguf"
    os.symlink(gguf, link)
    env = dict(os.environ, MEDUSA_TRAIN_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    code = ("import sys; from medusa_train.backbone.load import resolve_model_path; "
            f"print(resolve_model_path({str(link)!r})[0])")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=600)[0].strip().splitlines()[-1] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1]
    folder = Path(outs[0])
    leftovers = [p.name for p in folder.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []
    converted, _ = load_backbone(folder, dtype="float32")
    reference, _ = packaged_backbone
    for (name, a), (_, b) in zip(converted.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("arch, tie, shards", [("llama", False, "1"), ("llama", True, "8KB"), ("qwen2", False, "8KB")],
                         ids=["llama", "llama-tied-sharded-index", "qwen2-sharded-index"])
def test_a_backbone_without_layers_holds_exactly_what_lies_outside_them(tmp_path, arch, tie, shards):
    """What the heads read (embeddings, final norm, LM head) equals a whole load; the layers take no memory."""
    from transformers import AutoModelForCausalLM

    from medusa_train.backbone.without_layers import decoder_layers, load_without_layers

    make_tiny_backbone(arch, tie=tie).save_pretrained(tmp_path, max_shard_size="8KB" if shards == "8KB" else "1GB")
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shards == "8KB")
    whole = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    part = load_without_layers(tmp_path, "float32")
    layers = decoder_layers(part)
    assert len(layers) == 2 and all(p.is_meta for layer in layers for p in layer.parameters())
    assert not any(p.requires_grad for p in part.parameters())
    inside = {id(p) for layer in layers for p in layer.parameters()}
    outside = [(n, p) for n, p in part.named_parameters(remove_duplicate=False) if id(p) not in inside]
    assert {n for n, _ in outside} >= {"lm_head.weight", "model.norm.weight", "model.embed_tokens.weight"}
    for name, param in outside:
        assert torch.equal(param, whole.get_parameter(name)), name
    assert (part.get_output_embeddings().weight is part.get_input_embeddings().weight) == tie


def test_a_checkpoint_naming_its_tensors_otherwise_is_loaded_whole_instead(tmp_path):
    """transformers renames GPT-NeoX's ``embed_out`` to ``lm_head`` at load time: not guessed, refused (None)."""
    from safetensors import safe_open

    from medusa_train.backbone.without_layers import load_without_layers

    make_tiny_backbone("gpt_neox").save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert "embed_out.weight" in f.keys() and "lm_head.weight" not in f.keys()
    assert load_without_layers(tmp_path, "float32") is None


@pytest.mark.parametrize("arch, tie", [("llama", True), ("qwen2", False), ("gpt_neox", False)])
def test_an_empty_backbone_has_the_loaded_ones_modules_and_buffers_but_no_weights(tmp_path, arch, tie):
    """What the processes that receive process 0's weights build (model.fsdp): every parameter the loaded model
    has, by the same name, shape and dtype, on the meta device; the buffers (rotary frequencies) computed as a
    load computes them; weights tied as the loaded model ties them."""
    from medusa_train.backbone.without_layers import empty_backbone

    make_tiny_backbone(arch, tie=tie).save_pretrained(tmp_path)
    whole, _ = load_with_tokenizerless(load_backbone, tmp_path)  # what process 0 loads
    empty = empty_backbone(tmp_path, "float32", pad_token_id=whole.config.pad_token_id)
    loaded = dict(whole.named_parameters(remove_duplicate=False))
    built = dict(empty.named_parameters(remove_duplicate=False))
    assert built.keys() == loaded.keys()
    for name, param in built.items():
        assert param.is_meta and (param.shape, param.dtype) == (loaded[name].shape, loaded[name].dtype), name
        assert not param.requires_grad
    buffers = dict(whole.named_buffers())
    assert dict(empty.named_buffers()).keys() == buffers.keys() and buffers
    for name, buffer in empty.named_buffers():
        assert not buffer.is_meta and torch.equal(buffer, buffers[name]), name
    assert (empty.get_output_embeddings().weight is empty.get_input_embeddings().weight) == tie
    assert type(empty) is type(whole) and not empty.training
