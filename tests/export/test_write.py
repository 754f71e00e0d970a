"""Export layouts (native, medusa_v1, vllm): round trips, pinned key schemes, strict loading, the script."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT
from helpers.backbones import make_tiny_backbone
from safetensors.torch import load_file, save_file

from medusa_train import MedusaModel
from medusa_train.export.write import export_folder
from medusa_train.families.medusa.export import export_heads

HIDDEN, VOCAB = 64, 256


def _random_heads(backbone, num_heads=3, num_layers=1, share_lm_head=False, dtype="float32", seed=1):
    model = MedusaModel.from_backbone(backbone, num_heads, num_layers, share_lm_head=share_lm_head, dtype=dtype)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.normal_(std=0.05)
    return model


def _assert_same_head_logits(a, b, num_heads, dtype=torch.float32):
    hidden = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(7)).to(dtype)
    with torch.no_grad():
        for k in range(num_heads):
            assert torch.equal(a.head_logits(hidden, k), b.head_logits(hidden, k)), f"head {k}"


# ------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("share_lm_head", [False, True])
@pytest.mark.parametrize("layout", ["native", "medusa_v1", "vllm"])
def test_export_then_load_gives_bit_identical_head_logits(tmp_path, layout, share_lm_head, num_layers, dtype):
    # The backbone in the heads' dtype: a shared LM head then computes exactly what a copy of it does.
    backbone = make_tiny_backbone("llama").to(getattr(torch, dtype))
    model = _random_heads(backbone, 3, num_layers, share_lm_head, dtype)
    export_heads(model, tmp_path / "out", layout)
    loaded = MedusaModel.from_pretrained(tmp_path / "out", backbone=backbone)
    assert loaded.config.num_layers == num_layers and loaded.config.dtype == dtype
    # medusa_v1 cannot say "shared": each head comes back with its own copy of the LM head.
    assert loaded.config.share_lm_head == (share_lm_head and layout != "medusa_v1")
    assert all(p.dtype == getattr(torch, dtype) for p in loaded.heads.parameters())
    _assert_same_head_logits(model, loaded, 3, getattr(torch, dtype))


def test_export_to_every_layout_and_back_again(tmp_path, tiny_llama):
    model = _random_heads(tiny_llama, 2, 2)
    export_heads(model, tmp_path / "v1", "medusa_v1")
    again = MedusaModel.from_pretrained(tmp_path / "v1", backbone=tiny_llama)
    export_heads(again, tmp_path / "vllm", "vllm")
    export_heads(MedusaModel.from_pretrained(tmp_path / "vllm", backbone=tiny_llama), tmp_path / "native", "native")
    final = MedusaModel.from_pretrained(tmp_path / "native", backbone=tiny_llama)
    saved, back = model.heads_state_dict(), final.heads_state_dict()
    assert saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in saved)


# ------------------------------------------------------------------------------------ pinned layouts
def test_vllm_layout_is_pinned(tmp_path, tiny_llama):
    model = _random_heads(tiny_llama, num_heads=2, num_layers=2)
    export_heads(model, tmp_path, "vllm", max_paths=32, topk=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(tensors) == [
        "blocks.0.layers.0.bias", "blocks.0.layers.0.weight", "blocks.0.layers.1.bias", "blocks.0.layers.1.weight",
        "blocks.1.layers.0.bias", "blocks.1.layers.0.weight", "blocks.1.layers.1.bias", "blocks.1.layers.1.weight",
        "lm_heads.0.weight", "lm_heads.1.weight",
    ]
    assert tensors["blocks.1.layers.1.weight"].shape == (HIDDEN, HIDDEN)
    assert tensors["blocks.1.layers.1.bias"].shape == (HIDDEN,)
    assert tensors["lm_heads.1.weight"].shape == (VOCAB, HIDDEN)
    assert torch.equal(tensors["blocks.1.layers.1.weight"], model.heads[1].blocks[1].linear.weight)
    assert torch.equal(tensors["lm_heads.0.weight"], model.heads[0].lm_head.weight)
    assert json.loads((tmp_path / "config.json").read_text()) == {
        "model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": 64, "vocab_size": 256,
        "num_heads": 2, "num_hidden_layers": 2, "max_paths": 32, "topk": 5, "truncated_vocab_size": 256,
        "medusa_fc_bias": True, "original_lm_head": False, "base_model_name_or_path": "tiny-llama",
        "torch_dtype": "float32",
    }


def test_vllm_layout_with_a_shared_lm_head_stores_it_once(tmp_path, tiny_llama):
    export_heads(_random_heads(tiny_llama, num_heads=2, share_lm_head=True), tmp_path, "vllm")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(tensors) == ["blocks.0.layers.0.bias", "blocks.0.layers.0.weight",
                               "blocks.1.layers.0.bias", "blocks.1.layers.0.weight", "lm_head.weight"]
    assert torch.equal(tensors["lm_head.weight"], tiny_llama.lm_head.weight)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["original_lm_head"] is True and config["num_heads"] == 2 and config["num_hidden_layers"] == 1


@pytest.mark.parametrize("lm_head_pt", [False, True])
def test_medusa_v1_layout_is_pinned(tmp_path, tiny_llama, lm_head_pt):
    model = _random_heads(tiny_llama, num_heads=2, num_layers=2)
    export_heads(model, tmp_path, "medusa_v1", lm_head_pt=lm_head_pt)
    files = ["config.json", "medusa_lm_head.safetensors"] + (["medusa_lm_head.pt"] if lm_head_pt else [])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)
    tensors = load_file(str(tmp_path / "medusa_lm_head.safetensors"))
    assert sorted(tensors) == ["0.0.linear.bias", "0.0.linear.weight", "0.1.linear.bias", "0.1.linear.weight",
                               "0.2.weight", "1.0.linear.bias", "1.0.linear.weight", "1.1.linear.bias",
                               "1.1.linear.weight", "1.2.weight"]
    assert torch.equal(tensors["1.1.linear.bias"], model.heads[1].blocks[1].linear.bias)
    assert torch.equal(tensors["0.2.weight"], model.heads[0].lm_head.weight)
    assert json.loads((tmp_path / "config.json").read_text()) == {
        "medusa_num_heads": 2, "medusa_num_layers": 2, "base_model_name_or_path": "tiny-llama",
        "hidden_size": 64, "vocab_size": 256,
    }
    if lm_head_pt:
        pt = torch.load(tmp_path / "medusa_lm_head.pt", weights_only=True)
        assert pt.keys() == tensors.keys() and all(torch.equal(pt[k], tensors[k]) for k in pt)


def test_medusa_v1_writes_a_copy_of_the_shared_lm_head_for_every_head(tmp_path, tiny_llama):
    export_heads(_random_heads(tiny_llama, num_heads=3, share_lm_head=True), tmp_path, "medusa_v1")
    tensors = load_file(str(tmp_path / "medusa_lm_head.safetensors"))
    for h in range(3):
        assert torch.equal(tensors[f"{h}.1.weight"], tiny_llama.lm_head.weight)


# ------------------------------------------------------------------------------------ published layouts
def _silu(x):
    return x * torch.sigmoid(x)


def _original_medusa_heads(directory: Path, num_heads: int, num_layers: int, file: str) -> dict:
    """Heads as the original Medusa's training script saves them (its MedusaConfig + the head state dict)."""
    torch.manual_seed(3)
    state = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            state[f"{h}.{layer}.linear.weight"] = torch.randn(HIDDEN, HIDDEN) * 0.05
            state[f"{h}.{layer}.linear.bias"] = torch.randn(HIDDEN) * 0.05
        state[f"{h}.{num_layers}.weight"] = torch.randn(VOCAB, HIDDEN) * 0.05
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "base_model_name_or_path": "tiny-llama", "medusa_num_heads": num_heads, "medusa_num_layers": num_layers,
        "transformers_version": "4.33.1"}))
    if file == "pt":
        torch.save(state, directory / "medusa_lm_head.pt")
    else:
        save_file(state, str(directory / "medusa_lm_head.safetensors"))
    return state


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("file", ["pt", "safetensors"])
def test_original_medusa_heads_load_and_match_a_hand_computation(tmp_path, tiny_llama, file, num_layers):
    state = _original_medusa_heads(tmp_path, 3, num_layers, file)
    model = MedusaModel.from_pretrained(tmp_path, backbone=tiny_llama)
    assert (model.config.num_heads, model.config.num_layers, model.config.share_lm_head) == (3, num_layers, False)
    x = torch.randn(2, 5, HIDDEN)
    for h in range(3):
        expected = x
        for layer in range(num_layers):
            w1, b = state[f"{h}.{layer}.linear.weight"], state[f"{h}.{layer}.linear.bias"]
            expected = expected + _silu(expected @ w1.T + b)
        expected = expected @ state[f"{h}.{num_layers}.weight"].T
        with torch.no_grad():
            torch.testing.assert_close(model.head_logits(x, h), expected, rtol=1e-5, atol=1e-5)


def test_original_medusa_heads_decode(tmp_path, tiny_llama):
    try:
        from medusa_train.decoding import tree_generate
    except ImportError as err:  # pragma: no cover - the decoder is written alongside this module
        pytest.skip(f"medusa_train.decoding is not importable yet: {err}")
    _original_medusa_heads(tmp_path, 3, 1, "pt")
    model = MedusaModel.from_pretrained(tmp_path, backbone=tiny_llama)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = tree_generate(model, ids, tree="chain", max_new_tokens=8, eos_token_id=[])
        greedy = ids
        for _ in range(8):  # plain greedy decoding with the backbone alone
            greedy = torch.cat([greedy, tiny_llama(greedy).logits[:, -1:].argmax(-1)], dim=1)
    assert out.new_tokens == 8 and torch.equal(out.sequences, greedy)


def _vllm_default_heads(directory: Path, num_heads: int = 2) -> dict:
    """Heads as vLLM's own defaults describe them: no ResBlock bias, no medusa_fc_bias/original_lm_head keys."""
    torch.manual_seed(4)
    state = {f"blocks.{h}.layers.0.weight": torch.randn(HIDDEN, HIDDEN) * 0.05 for h in range(num_heads)}
    state |= {f"lm_heads.{h}.weight": torch.randn(VOCAB, HIDDEN) * 0.05 for h in range(num_heads)}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": HIDDEN, "vocab_size": VOCAB,
        "num_heads": num_heads, "num_hidden_layers": 1, "max_paths": 64, "topk": 10,
        "base_model_name_or_path": "tiny-llama"}))
    save_file(state, str(directory / "model.safetensors"))
    return state


def test_vllm_heads_without_bias_load_with_a_zero_bias(tmp_path, tiny_llama):
    state = _vllm_default_heads(tmp_path)
    model = MedusaModel.from_pretrained(tmp_path, backbone=tiny_llama)
    assert all(torch.equal(h.blocks[0].linear.bias, torch.zeros(HIDDEN)) for h in model.heads)
    x = torch.randn(3, HIDDEN)
    for h in range(2):
        expected = (x + _silu(x @ state[f"blocks.{h}.layers.0.weight"].T)) @ state[f"lm_heads.{h}.weight"].T
        with torch.no_grad():
            torch.testing.assert_close(model.head_logits(x, h), expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------ strict loading
def _edit(path: Path, edit) -> None:
    tensors = load_file(str(path)) if path.suffix == ".safetensors" else torch.load(path, weights_only=True)
    edit(tensors)
    if path.suffix == ".safetensors":
        save_file(tensors, str(path))
    else:
        torch.save(tensors, path)


@pytest.mark.parametrize("layout, share, file, edit, message", [
    ("medusa_v1", False, "medusa_lm_head.safetensors", lambda t: t.pop("1.1.weight"), "missing tensors: 1.1.weight"),
    ("medusa_v1", False, "medusa_lm_head.safetensors", lambda t: t.pop("0.0.linear.bias"),
     "missing tensors: 0.0.linear.bias"),
    ("medusa_v1", False, "medusa_lm_head.safetensors", lambda t: t.__setitem__("2.0.linear.weight", torch.zeros(64, 64)),
     "unexpected tensors: 2.0.linear.weight"),
    ("medusa_v1", False, "medusa_lm_head.pt", lambda t: t.pop("0.1.weight"), "missing tensors: 0.1.weight"),
    ("medusa_v1", False, "medusa_lm_head.safetensors", lambda t: t.__setitem__("1.0.linear.bias", torch.zeros(65)),
     "1.0.linear.bias: file (65,) vs config (64,)"),
    ("vllm", False, "model.safetensors", lambda t: t.pop("blocks.1.layers.0.bias"),
     "missing tensors: blocks.1.layers.0.bias"),
    ("vllm", False, "model.safetensors", lambda t: t.pop("lm_heads.0.weight"), "missing tensors: lm_heads.0.weight"),
    ("vllm", False, "model.safetensors", lambda t: t.__setitem__("lm_heads.2.weight", torch.zeros(256, 64)),
     "unexpected tensors: lm_heads.2.weight"),
    ("vllm", False, "model.safetensors", lambda t: t.__setitem__("token_map", torch.arange(10)),
     "unexpected tensors: token_map"),
    ("vllm", True, "model.safetensors", lambda t: t.pop("lm_head.weight"), "missing tensors: lm_head.weight"),
    ("vllm", True, "model.safetensors", lambda t: t.__setitem__("lm_heads.0.weight", torch.zeros(256, 64)),
     "unexpected tensors: lm_heads.0.weight"),
])
def test_foreign_layouts_load_strictly_and_name_the_tensor(tmp_path, tiny_llama, layout, share, file, edit, message):
    export_heads(_random_heads(tiny_llama, 2, share_lm_head=share), tmp_path, layout,
                 lm_head_pt=file.endswith(".pt"))
    if file.endswith(".pt"):
        (tmp_path / "medusa_lm_head.safetensors").unlink()  # the .pt is read only when it is the only file
    _edit(tmp_path / file, edit)
    escaped = message.replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(ValueError, match=escaped):
        MedusaModel.from_pretrained(tmp_path, backbone=tiny_llama)


def test_vllm_shared_lm_head_must_be_the_backbones(tmp_path, tiny_llama):
    export_heads(_random_heads(tiny_llama, 2, share_lm_head=True), tmp_path, "vllm")
    other = make_tiny_backbone("llama", seed=5)
    with pytest.raises(ValueError, match="lm_head.weight in .* differs from the backbone's LM head"):
        MedusaModel.from_pretrained(tmp_path, backbone=other)
    # The same LM head in another dtype passes (compared in the less precise dtype).
    loaded = MedusaModel.from_pretrained(tmp_path, backbone=make_tiny_backbone("llama").to(torch.bfloat16))
    assert loaded.config.share_lm_head


def test_vllm_truncated_vocab_without_its_token_map_is_refused(tmp_path, tiny_llama):
    export_heads(_random_heads(tiny_llama, 2), tmp_path, "vllm")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"truncated_vocab_size": 100}))
    with pytest.raises(ValueError, match=r"missing tensors: token_map; wrong shapes: lm_heads.0.weight: file \(256, 64\) "
                                         r"vs config \(100, 64\)"):
        MedusaModel.from_pretrained(tmp_path, backbone=tiny_llama)


def test_unknown_config_and_bad_options_are_errors(tmp_path, tiny_llama):
    model = _random_heads(tiny_llama, 2)
    with pytest.raises(ValueError, match="format=onnx: must be one of native, medusa_v1, vllm"):
        export_heads(model, tmp_path / "x", "onnx")
    with pytest.raises(ValueError, match="lm_head_pt=true: only format=medusa_v1"):
        export_heads(model, tmp_path / "x", "vllm", lm_head_pt=True)
    with pytest.raises(ValueError, match="topk=0: must be an integer >= 1"):
        export_heads(model, tmp_path / "x", "vllm", topk=0)
    assert not (tmp_path / "x").exists()
    (tmp_path / "y").mkdir()
    (tmp_path / "y/config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="holds no Medusa heads"):
        MedusaModel.from_pretrained(tmp_path / "y", backbone=tiny_llama)


# ------------------------------------------------------------------------------------ atomic writes
def test_export_replaces_a_folder_whole_and_a_failed_write_leaves_the_old_one(tmp_path, tiny_llama, monkeypatch):
    first = _random_heads(tiny_llama, 2, seed=1)
    export_heads(first, tmp_path / "out", "medusa_v1", lm_head_pt=True)
    second = _random_heads(tiny_llama, 2, seed=2)
    export_heads(second, tmp_path / "out", "vllm")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]

    import medusa_train.model.folder as folder

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(folder, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        export_heads(first, tmp_path / "out", "medusa_v1")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder left behind
    _assert_same_head_logits(second, MedusaModel.from_pretrained(tmp_path / "out", backbone=tiny_llama), 2)


def test_a_folder_holding_a_file_we_did_not_write_is_never_replaced(tmp_path, tiny_llama):
    heads = _random_heads(tiny_llama, 2)
    heads.save_pretrained(tmp_path / "heads")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "precious.txt").write_text("mine")
    with pytest.raises(ValueError, match=f"{mine} is not empty and holds files medusa-train did not write "
                                         r"\(precious.txt\).*choose another output="):
        export_folder(tmp_path / "heads", mine, "native")
    with pytest.raises(ValueError, match=r"precious.txt.*write to another folder"):
        export_heads(heads, mine, "vllm")
    assert [p.name for p in mine.iterdir()] == ["precious.txt"] and (mine / "precious.txt").read_text() == "mine"
    # Our own export with a file of the user's added: refused too, the whole folder as it was.
    export_heads(heads, tmp_path / "ours", "vllm")
    (tmp_path / "ours/notes.md").write_text("mine")
    with pytest.raises(ValueError, match=r"\(notes.md\)"):
        export_heads(heads, tmp_path / "ours", "vllm")
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == ["config.json", "model.safetensors", "notes.md"]
    # A model folder (its config.json is no Medusa one): every file in it is the user's.
    tiny_llama.save_pretrained(tmp_path / "model")
    with pytest.raises(ValueError, match=r"\(config.json, generation_config.json, model.safetensors\)"):
        export_heads(heads, tmp_path / "model", "native")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing half-written beside them


def test_a_re_export_over_our_own_export_keeps_the_measured_serving_json(tmp_path, tiny_llama):
    first, second = _random_heads(tiny_llama, 2, seed=1), _random_heads(tiny_llama, 2, seed=2)
    first.save_pretrained(tmp_path / "heads")
    export_folder(tmp_path / "heads", tmp_path / "vllm", "vllm")
    measured = json.dumps({"recommended_num_speculative_tokens": 2, "rows": []})
    (tmp_path / "vllm/serving.json").write_text(measured)  # what the K sweep writes there
    second.save_pretrained(tmp_path / "heads")  # over our own: replaced
    export_folder(tmp_path / "heads", tmp_path / "vllm", "vllm", topk=3)
    assert sorted(p.name for p in (tmp_path / "vllm").iterdir()) == ["config.json", "model.safetensors", "serving.json"]
    assert (tmp_path / "vllm/serving.json").read_text() == measured
    assert json.loads((tmp_path / "vllm/config.json").read_text())["topk"] == 3
    _assert_same_head_logits(second, MedusaModel.from_pretrained(tmp_path / "vllm", backbone=tiny_llama), 2)
    export_heads(first, tmp_path / "vllm", "medusa_v1")  # another layout over it: the file stays too
    assert (tmp_path / "vllm/serving.json").read_text() == measured


def test_the_chat_template_travels_into_every_layout_and_the_serve_line(tmp_path, tiny_llama):
    from medusa_train.export.serve import serve_command
    from medusa_train.model.folder import read_chat_template

    template = "{% for m in messages %}MARKER {{ m['content'] }}\n{% endfor %}"
    heads = _random_heads(tiny_llama, 2, share_lm_head=False)
    heads.save_pretrained(tmp_path / "native", chat_template=template)
    assert (tmp_path / "native/chat_template.jinja").read_text() == template
    for layout in ("medusa_v1", "vllm", "native"):
        export_folder(tmp_path / "native", tmp_path / layout / "out", layout)
        assert read_chat_template(tmp_path / layout / "out") == template, layout
    assert read_chat_template(tmp_path / "native") == template
    line = next(x for x in serve_command(tmp_path / "vllm/out").splitlines() if x.startswith("vllm serve "))
    assert f" --chat-template {(tmp_path / 'vllm/out/chat_template.jinja').resolve()} " in line
    heads.save_pretrained(tmp_path / "plain")  # no template recorded: none written, none on the serve line
    export_folder(tmp_path / "plain", tmp_path / "plain-vllm", "vllm")
    assert read_chat_template(tmp_path / "plain-vllm") is None
    assert "--chat-template" not in serve_command(tmp_path / "plain-vllm")


# ------------------------------------------------------------------------------------ the script
def _run_script(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, str(ROOT / "scripts/export.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.integration
def test_script_converts_a_native_export_end_to_end(tmp_path):
    from helpers.training import make_model_dir

    from medusa_train import load_backbone

    backbone, _ = load_backbone(make_model_dir(tmp_path / "model"), dtype="float32")
    shared = _random_heads(backbone, 2, share_lm_head=True)
    own = _random_heads(backbone, 2, num_layers=2, seed=2)
    shared.save_pretrained(tmp_path / "shared")
    own.save_pretrained(tmp_path / "own")

    # Shared LM head: the script loads the backbone named in config.json to store its LM head.
    done = _run_script(f"heads={tmp_path / 'shared'}", "format=vllm", f"output={tmp_path / 'vllm'}", "topk=4",
                       cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "wrote vllm heads" in done.stdout
    assert json.loads((tmp_path / "vllm/config.json").read_text())["topk"] == 4
    serve = next(line for line in done.stdout.splitlines() if line.startswith("vllm serve "))
    spec = json.loads(serve.split("--speculative-config ", 1)[1].strip("'"))
    # K=1 until `medusa-train choose-k` has measured one (serving.json); the base model as a folder vLLM can load
    assert spec == {"method": "medusa", "model": str((tmp_path / "vllm").resolve()), "num_speculative_tokens": 1}
    assert serve.startswith(f"vllm serve {backbone.name_or_path} --dtype float32 ")
    # the CPU build's line as the product's servers run it: every core computing (vLLM keeps one back by default)
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU=0 python -m vllm.entrypoints.openai.api_server --model " in done.stdout
    from medusa_train.export.serve import serve_command

    (tmp_path / "vllm/serving.json").write_text(json.dumps({"recommended_num_speculative_tokens": 2, "rows": []}))
    assert '"num_speculative_tokens": 2}' in serve_command(tmp_path / "vllm")
    _assert_same_head_logits(shared, MedusaModel.from_pretrained(tmp_path / "vllm", backbone=backbone), 2)

    done = _run_script(f"heads={tmp_path / 'own'}", "format=medusa_v1", f"output={tmp_path / 'v1'}", "lm_head_pt=true")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "v1").iterdir()) == [
        "config.json", "medusa_lm_head.pt", "medusa_lm_head.safetensors"]
    _assert_same_head_logits(own, MedusaModel.from_pretrained(tmp_path / "v1", dtype="float32"), 2)
    # Hydra writes nothing of its own (no outputs/, .hydra/ or log file in the working folder).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "own", "shared", "v1", "vllm"]


@pytest.mark.integration
def test_script_help_and_option_errors():
    done = _run_script("--help")
    assert done.returncode == 0 and "medusa-train export draft=<heads dir>" in done.stdout and "max_paths: 64" in done.stdout
    done = _run_script("format=onnx", "topk=0")
    assert done.returncode == 2
    assert "draft: required; pass draft=" in done.stderr and "output: required" in done.stderr
    assert "format=onnx: must be one of native, medusa_v1, vllm" in done.stderr and "topk=0" in done.stderr
