"""The commands given an EAGLE-3 draft's folder: export writes it unchanged as vLLM's layout (and refuses the
original Medusa layout), the serve line says method eagle3, and choose-k lets K pass the trained depth (vLLM chains
any K for a draft, where Medusa heads fail to load past their count)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.backbones import make_tiny_backbone
from safetensors.torch import load_file

from medusa_train.config.check import ConfigError
from medusa_train.families.eagle3.model import Eagle3Model


@pytest.fixture
def draft_folder(tmp_path):
    backbone = make_tiny_backbone("llama", layers=4)
    model = Eagle3Model.from_backbone(backbone, token_map=torch.arange(0, 256, 2), aux_layer_ids=[0, 1, 3], ttt_steps=3)
    return model.save_pretrained(tmp_path / "draft", chat_template="{{ messages }}")


def test_export_writes_the_draft_as_it_is_and_refuses_the_medusa_layout(draft_folder, tmp_path):
    from medusa_train.export.write import export_folder

    out = export_folder(draft_folder, tmp_path / "vllm", "vllm")
    assert json.loads((out / "config.json").read_text()) == json.loads((draft_folder / "config.json").read_text())
    a, b = load_file(str(out / "model.safetensors")), load_file(str(draft_folder / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (out / "chat_template.jinja").read_text() == "{{ messages }}"
    with pytest.raises(ValueError, match="format=medusa_v1: .* EAGLE-3 draft"):
        export_folder(draft_folder, tmp_path / "v1", "medusa_v1")
    assert not (tmp_path / "v1").exists()


def test_the_serve_line_and_choose_k_speak_eagle3(draft_folder):
    from medusa_train.cli.choose_k import build_choose_k_config
    from medusa_train.export.serve import serve_command

    line = serve_command(draft_folder)
    assert '"method": "eagle3"' in line and "choose K in 1..3" in line
    assert build_choose_k_config({"heads": str(draft_folder), "model": "tiny", "ks": [0, 1, 5]}).ks == [0, 1, 5]
    with pytest.raises(ConfigError, match="at least one K >= 1"):
        build_choose_k_config({"heads": str(draft_folder), "model": "tiny", "ks": [0]})
