"""Sources that leave nothing to train on are refused with the key to change; data.eval_size=0 trains on all."""

from __future__ import annotations

import json
import random

import pytest
from helpers.tokenizers import write_jsonl

from medusa_train.config.check import ConfigError
from medusa_train.data import build_datasets
from medusa_train.data.cache import tokenized_splits


def chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": f"Hello {i} !"}]}


def users_only() -> dict:
    return {"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "there"}]}


def splits(tokenizer, path, tmp_path, **kw):
    kw = {"max_length": 64, "eval_size": 64, **kw}
    return tokenized_splits(tokenizer, str(path), kw.pop("max_length"), num_proc=1, cache_root=tmp_path / "cache", **kw)


def refusal(call) -> str:
    """The one problem of the ConfigError ``call()`` raises."""
    with pytest.raises(ConfigError) as info:
        call()
    [problem] = info.value.problems
    return problem


def cached_folders(tmp_path) -> list:
    root = tmp_path / "cache"
    return [p.name for p in root.iterdir()] if root.exists() else []


def test_eval_size_zero_trains_on_every_conversation_and_says_no_evaluation(word_tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", [chat(i) for i in range(5)])
    for from_cache in (False, True):
        data = splits(word_tokenizer, path, tmp_path, eval_size=0)
        assert data.from_cache is from_cache
        assert (len(data.train), len(data.evals)) == (5, 0)
        assert data.notes == ["data: data.eval_size=0: nothing held out; training on all 5 conversations, no evaluation"]
    train, evals, stats = build_datasets(word_tokenizer, path, max_length=64, eval_size=0)
    assert (len(train), evals, stats.kept) == (5, [], 5)


def test_fewer_conversations_than_eval_size_are_refused_before_tokenising(word_tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", [chat(i) for i in range(50)] + [users_only()])
    expected = ("data.eval_size=64: holds out 64 conversations for evaluation, but "
                f"data.source='{path}' has only 50 usable conversations, which leaves none to train on; 1 record "
                "was skipped: no_assistant 1 (no assistant turn with text). To train, set data.eval_size=5 "
                "(anything below 50) to keep a held-out set, or data.eval_size=0 to train on all 50 with no evaluation")
    assert refusal(lambda: splits(word_tokenizer, path, tmp_path)) == expected
    assert "data.eval_size=50: holds out 50 conversations" in refusal(lambda: splits(word_tokenizer, path, tmp_path,
                                                                                      eval_size=50))
    assert cached_folders(tmp_path) == []  # refused before anything was tokenised or cached
    assert refusal(lambda: build_datasets(word_tokenizer, path, max_length=64, eval_size=64)) == expected
    data = splits(word_tokenizer, path, tmp_path, eval_size=49)  # one left to train on is enough
    assert (len(data.train), len(data.evals), data.notes) == (1, 49, [])


def test_max_samples_below_eval_size_is_named(word_tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", [chat(i) for i in range(20)])
    problem = refusal(lambda: splits(word_tokenizer, path, tmp_path, eval_size=10, max_samples=10))
    assert problem.startswith("data.eval_size=10: holds out 10 conversations")
    assert "only 10 usable conversations (data.max_samples=10 selected them)" in problem


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.json"])
def test_an_empty_file_is_refused_naming_data_source(word_tokenizer, tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b"")
    problem = refusal(lambda: splits(word_tokenizer, path, tmp_path))
    assert problem.startswith(f"data.source='{path}': no conversation to train on: it holds no records")
    assert refusal(lambda: build_datasets(word_tokenizer, path, max_length=64)) == problem
    assert cached_folders(tmp_path) == []


def test_a_file_whose_every_record_is_skipped_is_refused_with_counts_by_reason(word_tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "users.jsonl", [users_only()] * 7 + ["{not json", '{"messages": 3}'])
    problem = refusal(lambda: splits(word_tokenizer, path, tmp_path, eval_size=0))
    assert problem.startswith(f"data.source='{path}': no conversation to train on: all 9 records were skipped: "
                              "malformed 2 (not JSON, or not a conversation record), "
                              "no_assistant 7 (no assistant turn with text). ")


def test_every_conversation_dropped_by_tokenising_is_refused_and_not_cached(word_tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", [chat(i) for i in range(6)])
    # 8 tokens hold the default system prompt only: no assistant token is left in any conversation.
    problem = refusal(lambda: splits(word_tokenizer, path, tmp_path, max_length=8, eval_size=2))
    assert problem.startswith(f"data.source='{path}': no conversation to train on: all 6 records were skipped: "
                              "no_assistant_after_truncation 6 (no assistant token within data.max_length)")
    assert cached_folders(tmp_path) == []


def test_random_bytes_are_counted_as_undecodable_and_refused(word_tokenizer, tmp_path):
    path = tmp_path / "noise.jsonl"
    path.write_bytes(random.Random(0).randbytes(20_000))
    problem = refusal(lambda: splits(word_tokenizer, path, tmp_path))
    assert problem.startswith(f"data.source='{path}': no conversation to train on: all ")
    assert "not_utf8 " in problem and "(bytes that are not UTF-8 text)" in problem


def test_undecodable_lines_are_skipped_and_the_rest_trains(word_tokenizer, tmp_path):
    path = tmp_path / "mixed.jsonl"
    good = "".join(json.dumps(chat(i)) + "\n" for i in range(4)).encode()
    path.write_bytes(b"\xff\xfe\x00garbage\n{not json\n" + good + b'{"messages": [{"role": "user", "content": "\xc3"}]}\n')
    data = splits(word_tokenizer, path, tmp_path, eval_size=1)
    assert (len(data.train), len(data.evals)) == (3, 1)
    assert dict(data.stats.skipped) == {"not_utf8": 2, "malformed": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from helpers.training import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.mark.parametrize("case", ["empty", "fewer_than_eval_size"])
def test_the_train_command_refuses_with_exit_2_and_no_traceback(case, model_dir, tmp_path, monkeypatch, capfd):
    from helpers.training import run_train_command, train_overrides

    monkeypatch.setenv("MEDUSA_TRAIN_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "chats.jsonl"
    data.write_text("" if case == "empty" else "".join(json.dumps(chat(i)) + "\n" for i in range(50)))
    overrides = train_overrides(model_dir, data, tmp_path / "run", **{"data.eval_size": 64})
    assert run_train_command(overrides, monkeypatch) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err
    if case == "empty":
        assert f"data.source='{data}': no conversation to train on: it holds no records" in err
    else:
        assert "data.eval_size=64: holds out 64 conversations for evaluation" in err
        assert "only 50 usable conversations" in err and "data.eval_size=0 to train on all 50" in err
    assert not (tmp_path / "run" / "export").exists()
