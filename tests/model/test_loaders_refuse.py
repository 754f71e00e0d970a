"""Loaders and writers check what they need (issue 57, probes 6 and 7): a draft vocabulary without its map, a
``config.json`` that is not JSON, an in-place conversion that would drop the run's record, a relative backbone path,
a tree or report file someone else wrote, a folder that cannot be written: each refused in one line naming the file
(and key) before any work, or kept."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers.backbones import make_tiny_backbone
from helpers.training import make_model_dir
from safetensors.torch import load_file, save_file

from medusa_train.backbone.load import load_backbone
from medusa_train.config.check import FileProblem
from medusa_train.config.model import EvalModelConfig
from medusa_train.data.distill.writer import ownership_problem
from medusa_train.evaluation.report import report_output_problem
from medusa_train.export.write import export_folder
from medusa_train.families.eagle3.model import Eagle3Model
from medusa_train.families.medusa.model import MedusaModel
from medusa_train.model.load import load_exported_draft, read_exported_draft
from medusa_train.tree.calibrate import TREE_MARK, tree_output_problem, write_tree

pytestmark = pytest.mark.usefixtures("one_thread")


def _eagle3(tmp_path):
    backbone = make_tiny_backbone("llama", layers=4)
    model = Eagle3Model.from_backbone(backbone, token_map=torch.arange(0, 256, 2), aux_layer_ids=[0, 1, 3], ttt_steps=2)
    return backbone, model.save_pretrained(tmp_path / "draft")


def test_a_draft_vocabulary_without_its_map_is_refused_naming_the_file_and_key(tmp_path):
    backbone, folder = _eagle3(tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["d2t"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(FileProblem, match=r"model\.safetensors: no d2t, the map of its 128-token draft vocabulary"):
        Eagle3Model.from_pretrained(folder, backbone=backbone)
    with pytest.raises(FileProblem, match="no d2t"):
        export_folder(folder, tmp_path / "out", "vllm")
    assert not (tmp_path / "out").exists()
    whole = Eagle3Model.from_backbone(backbone, aux_layer_ids=[0, 1, 3], ttt_steps=2).save_pretrained(tmp_path / "w")
    assert "d2t" not in load_file(str(whole / "model.safetensors"))  # the whole vocabulary needs none: it loads
    Eagle3Model.from_pretrained(whole, backbone=backbone)


def test_a_config_json_that_is_not_json_is_named(tmp_path):
    _, folder = _eagle3(tmp_path)
    (folder / "config.json").write_text("{ not json")
    with pytest.raises(FileProblem, match=rf"^{folder / 'config.json'}: cannot be read as JSON"):
        export_folder(folder, tmp_path / "out", "vllm")
    with pytest.raises(FileProblem, match="config.json: cannot be read as JSON"):
        read_exported_draft(folder)


def test_an_in_place_conversion_keeps_the_runs_record(tmp_path):
    backbone = make_tiny_backbone("llama")
    folder = MedusaModel.from_backbone(backbone, num_heads=2).save_pretrained(tmp_path / "export")
    record = {"training_config.json": '{"data": {"source": "mine.jsonl"}}\n', "validation.json": '{"K1": 1.2}\n'}
    for name, text in record.items():
        (folder / name).write_text(text)
    export_folder(folder, folder, "vllm")  # in place
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["MedusaModel"]
    assert {name: (folder / name).read_text() for name in record} == record
    other = export_folder(folder, tmp_path / "native", "native")  # and into another folder
    assert {name: (other / name).read_text() for name in record} == record


def test_a_draft_records_its_backbone_as_an_absolute_path(tmp_path, monkeypatch):
    make_model_dir(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    backbone, _ = load_backbone("model", dtype="float32")
    folder = MedusaModel.from_backbone(backbone, num_heads=2).save_pretrained(tmp_path / "heads")
    recorded = json.loads((folder / "config.json").read_text())["base_model_name_or_path"]
    assert recorded == str((tmp_path / "model").resolve())
    monkeypatch.chdir(tmp_path / "heads")  # another folder: the draft still finds its backbone
    model, _ = load_exported_draft(folder, EvalModelConfig(dtype="float32"), "cpu")
    assert model.config.base_model_name_or_path == recorded


def test_a_tree_file_build_tree_did_not_write_is_kept(tmp_path):
    notes = tmp_path / "notes.yaml"
    notes.write_text("my: notes\n")
    with pytest.raises(FileProblem, match="exists and build-tree did not write it; nothing was changed"):
        write_tree(notes, [[0.5, 0.2]], 2, 1.5)
    assert notes.read_text() == "my: notes\n"
    path, _ = write_tree(tmp_path / "t.yaml", [[0.5, 0.2]], 2, 1.5)
    assert path.read_text().splitlines()[0] == TREE_MARK
    assert tree_output_problem(path) is None and write_tree(path, [[0.6, 0.1]], 2, 1.6)[0] == path  # ours: replaced
    assert "is a folder" in tree_output_problem(tmp_path)


def test_a_place_that_cannot_be_written_is_said_before_any_work(tmp_path):
    (tmp_path / "a-file").write_text("")
    assert tree_output_problem(tmp_path / "a-file" / "t.yaml") == (
        f"output={tmp_path / 'a-file' / 't.yaml'}: {tmp_path / 'a-file'} cannot be written; choose another output=")
    assert "cannot be written" in report_output_problem(tmp_path / "a-file" / "eval")
    with pytest.raises(ValueError, match=f"{tmp_path / 'a-file'} cannot be written; choose another output="):
        export_folder(_eagle3(tmp_path)[1], tmp_path / "a-file" / "export", "vllm")
    assert ownership_problem(tmp_path / "a-file" / "d.jsonl") == (
        f"output={tmp_path / 'a-file' / 'd.jsonl'}: {tmp_path / 'a-file'} cannot be written; choose another output=")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_said_before_any_work(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert tree_output_problem(locked / "trees" / "t.yaml") == (
            f"output={locked / 'trees' / 't.yaml'}: {locked} cannot be written; choose another output=")
        assert "cannot be written" in report_output_problem(locked / "eval")
    finally:
        locked.chmod(0o700)
