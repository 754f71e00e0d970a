"""Writing a heads folder: only our own folders are replaced (serving.json kept), and the chat template travels."""

from __future__ import annotations

import json

import pytest

from medusa_train import MedusaModel
from medusa_train.config.check import ConfigError
from medusa_train.model.folder import foreign_entries, output_problem, read_chat_template

TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"


def test_save_pretrained_refuses_a_folder_with_a_file_it_did_not_write_and_replaces_its_own(tmp_path, tiny_llama):
    heads = MedusaModel.from_backbone(tiny_llama, 2, 1)
    target = tmp_path / "heads"
    target.mkdir()
    (target / "precious.txt").write_text("mine")
    with pytest.raises(ValueError, match=f"{target} is not empty and holds files medusa-train did not write "
                                         r"\(precious.txt\)"):
        heads.save_pretrained(target)
    assert [p.name for p in target.iterdir()] == ["precious.txt"]

    (target / "precious.txt").unlink()  # an empty folder is fine; then it is ours, and replaced
    heads.save_pretrained(target, chat_template=TEMPLATE)
    (target / "serving.json").write_text('{"recommended_num_speculative_tokens": 1}')
    heads.save_pretrained(target)
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors", "serving.json"]
    assert read_chat_template(target) is None  # this save records no template: the old one is not kept
    assert [p.name for p in tmp_path.iterdir()] == ["heads"]  # no temporary folder left behind


def test_what_counts_as_ours(tmp_path):
    assert foreign_entries(tmp_path / "absent") == [] and foreign_entries(tmp_path) == []
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    for name in ("medusa_lm_head.safetensors", "training_config.json", "backbone.json", "serving.json",
                 "chat_template.jinja"):
        (ours / name).write_text("")
    (ours / "merged").mkdir()
    assert foreign_entries(ours) == []
    (ours / ".DS_Store").write_text("")  # strict: anything else is the user's
    assert foreign_entries(ours) == [".DS_Store"]
    only_ours_by_name = tmp_path / "no-config"
    only_ours_by_name.mkdir()
    (only_ours_by_name / "model.safetensors").write_text("")  # without a Medusa config.json nothing is ours
    assert foreign_entries(only_ours_by_name) == ["model.safetensors"]
    (tmp_path / "file").write_text("")
    assert output_problem(tmp_path / "file", "output") == f"{tmp_path / 'file'} is a file, not a folder: " \
                                                          "choose another output="


def test_the_export_command_refuses_such_an_output_before_loading_anything(tmp_path):
    from medusa_train.cli.export import build_export_config

    (tmp_path / "precious.txt").write_text("mine")
    with pytest.raises(ConfigError) as err:
        build_export_config({"heads": str(tmp_path / "heads"), "format": "vllm", "output": str(tmp_path)})
    assert any("precious.txt" in p and "choose another output=" in p for p in err.value.problems)


def test_read_chat_template_reads_the_file_or_an_older_exports_training_config(tmp_path):
    assert read_chat_template(tmp_path) is None
    (tmp_path / "training_config.json").write_text(json.dumps({"data": {"chat_template": None}}))
    assert read_chat_template(tmp_path) is None
    (tmp_path / "training_config.json").write_text(json.dumps({"data": {"chat_template": TEMPLATE}}))
    assert read_chat_template(tmp_path) == TEMPLATE  # inline, as training read it
    (tmp_path / "t.jinja").write_text(TEMPLATE + "file")
    (tmp_path / "training_config.json").write_text(json.dumps({"data": {"chat_template": str(tmp_path / "t.jinja")}}))
    assert read_chat_template(tmp_path) == TEMPLATE + "file"
    (tmp_path / "t.jinja").unlink()
    with pytest.raises(ValueError, match="data.chat_template=.*cannot be read here.*chat_template.jinja"):
        read_chat_template(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)  # the file wins
    assert read_chat_template(tmp_path) == TEMPLATE
