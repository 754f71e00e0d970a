"""Distill writes only files it can prove it wrote: a user's file given as ``output=`` is refused before any byte of it
changes (issue 57, probe 1), and a refused run leaves no empty files behind (probe 7)."""

from __future__ import annotations

import json

import pytest
from helpers.distill import KEEP_ALL, make_multiturn_jsonl, tiny_config
from helpers.training import make_model_dir

from medusa_train.backbone.load import load_backbone
from medusa_train.config.check import ConfigError
from medusa_train.data.distill import distill

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model_dir = make_model_dir(tmp_path_factory.mktemp("distill-own") / "model")
    return model_dir, load_backbone(model_dir, dtype="float32")


@pytest.mark.parametrize("content", [
    b'[{"messages": [{"role": "user", "content": "hi"}]}, {"messages": []}]',  # a JSON array, no newline
    b'{"id": "000000-a", "messages": []}\n{"id": "000001-b", "messages": []}',  # JSONL, last line without newline
    b'{"messages": [{"role": "user", "content": "hi"}]}\n',  # a user's chat data
], ids=["json-array", "jsonl-no-trailing-newline", "jsonl"])
def test_a_file_distill_did_not_write_is_refused_and_kept_byte_for_byte(tiny, tmp_path, content):
    model_dir, (model, tokenizer) = tiny
    source = make_multiturn_jsonl(tmp_path / "chat.jsonl", 4)
    output = tmp_path / "mine.jsonl"
    output.write_bytes(content)
    with pytest.raises(ConfigError, match="does not say medusa-train distill wrote it; nothing was changed"):
        distill(tiny_config(model_dir, source, output, **KEEP_ALL), model, tokenizer)
    assert output.read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl", "mine.jsonl"]  # no sidecars made


def test_a_stats_file_that_is_not_ours_is_not_overwritten(tiny, tmp_path):
    model_dir, (model, tokenizer) = tiny
    source = make_multiturn_jsonl(tmp_path / "chat.jsonl", 4)
    (tmp_path / "d.stats.json").write_text('{"my": "notes"}')
    with pytest.raises(ConfigError, match=r"d\.stats\.json exists"):
        distill(tiny_config(model_dir, source, tmp_path / "d.jsonl", **KEEP_ALL), model, tokenizer)
    assert (tmp_path / "d.stats.json").read_text() == '{"my": "notes"}' and not (tmp_path / "d.jsonl").exists()


def test_its_own_output_resumes_and_its_torn_line_is_cut(tiny, tmp_path):
    model_dir, (model, tokenizer) = tiny
    source = make_multiturn_jsonl(tmp_path / "chat.jsonl", 4)
    output = tmp_path / "d.jsonl"
    config = tiny_config(model_dir, source, output, batch_size=2, **KEEP_ALL)
    first = distill(config, model, tokenizer)
    assert json.loads((tmp_path / "d.stats.json").read_text())["written_by"] == "medusa-train distill"
    whole = output.read_bytes()
    output.write_bytes(whole + b'{"id": "000009-x", "mess')  # a kill mid-line
    again = distill(config, model, tokenizer)
    assert again.dropped_torn_line and again.records == first.records and output.read_bytes() == whole


def test_a_refused_run_leaves_no_empty_files(tiny, tmp_path):
    model_dir, (model, tokenizer) = tiny
    source = make_multiturn_jsonl(tmp_path / "chat.jsonl", 4)
    output = tmp_path / "d.jsonl"
    with pytest.raises(ConfigError, match="the model reads at most"):  # a refusal found after the files open
        distill(tiny_config(model_dir, source, output, max_prompt_tokens=100_000, **KEEP_ALL), model, tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl"]
