"""Loading an export's config: the one reader of a heads folder's ``config.json`` and the checks built on it."""

from __future__ import annotations

import json

import pytest

from medusa_train.config.check import Problems
from medusa_train.model.files import read_config_json
from medusa_train.model.load import check_draft_folder, read_export_config


def test_read_export_config_gives_the_head_count_and_resolves_a_base_beside_the_heads(tmp_path):
    (tmp_path / "merged").mkdir()
    (tmp_path / "merged" / "config.json").write_text("{}")
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "base_model_name_or_path": "merged"}))
    assert read_export_config(tmp_path) == (3, str(tmp_path / "merged"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "medusa", "num_heads": 2,
                                                      "base_model_name_or_path": "org/model"}))
    assert read_export_config(tmp_path) == (2, "org/model")


def test_check_heads_names_a_missing_folder_and_a_config_without_a_head_count(tmp_path):
    p = Problems()
    assert check_draft_folder(str(tmp_path), p) == (None, None)
    assert "no config.json" in str(p)
    (tmp_path / "config.json").write_text(json.dumps({"base_model_name_or_path": "org/model"}))
    p = Problems()
    assert check_draft_folder(str(tmp_path), p) == (None, None)
    assert "not a draft we know" in str(p)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "medusa", "base_model_name_or_path": "org/model"}))
    p = Problems()
    assert check_draft_folder(str(tmp_path), p) == (None, None)
    assert "how many heads" in str(p)


def test_read_config_json_says_which_folder_has_no_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="folder of exported heads"):
        read_config_json(tmp_path)
