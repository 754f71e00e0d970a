"""Reading conversation records: formats, role names, counted skips, errors, packaged data."""

from __future__ import annotations

import json

import pytest

from medusa_train.data import SkipStats, load_conversations
from medusa_train.data import sources as sources_module


def sharegpt(*turns: tuple[str, str]) -> dict:
    """A ShareGPT record from ``(from, value)`` pairs."""
    return {"id": "x", "conversations": [{"from": who, "value": text} for who, text in turns]}


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def test_sharegpt_roles_are_normalised(tmp_path, write_jsonl):
    path = write_jsonl(tmp_path / "a.jsonl", [
        sharegpt(("system", "Be brief."), ("human", "Hi"), ("gpt", "Hello")),
        sharegpt(("user", "a"), ("chatgpt", "b"), ("human", "c"), ("bing", "d"), ("human", "e"), ("bard", "f")),
        sharegpt(("Human", "x"), ("assistant", "y")),  # case-insensitive
    ])
    conversations, stats = load_conversations(path)
    assert conversations == [
        [{"role": "system", "content": "Be brief."}, user("Hi"), assistant("Hello")],
        [user("a"), assistant("b"), user("c"), assistant("d"), user("e"), assistant("f")],
        [user("x"), assistant("y")],
    ]
    assert stats.kept == 3 and stats.total_skipped == 0


def test_messages_records(tmp_path, write_jsonl):
    record = {"messages": [{"role": "system", "content": "S"}, user("q"), assistant("a")]}
    conversations, stats = load_conversations(write_jsonl(tmp_path / "m.jsonl", [record]))
    assert conversations == [record["messages"]]
    assert stats.kept == 1


def test_bad_records_are_counted_not_fatal(tmp_path, write_jsonl):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        sharegpt(("human", "ok"), ("gpt", "fine")),
        '{"conversations": [{"from": "human", "value": "cut o',  # broken JSON line
        sharegpt(),  # empty conversation
        sharegpt(("human", "   "), ("gpt", "")),  # only whitespace: empty too
        sharegpt(("human", "only"), ("human", "user turns")),
        sharegpt(("human", "q"), ("gpt", "  ")),  # the assistant says nothing
        sharegpt(("human", "q"), ("narrator", "who?"), ("gpt", "a")),
        {"conversations": [{"from": "human", "value": ["not", "a", "string"]}, {"from": "gpt", "value": "a"}]},
        {"no_turns_here": 1},
        [1, 2, 3],
        "",  # blank lines are ignored, not counted
        sharegpt(("human", "second"), ("gpt", "kept")),
    ])
    conversations, stats = load_conversations(path)
    assert conversations == [[user("ok"), assistant("fine")], [user("second"), assistant("kept")]]
    assert stats.kept == 2
    assert dict(stats.skipped) == {"malformed": 4, "empty": 2, "no_assistant": 2, "unknown_role": 1}
    assert stats.total_skipped == 9


def test_max_samples_keeps_the_first(tmp_path, write_jsonl):
    records = [sharegpt(("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(10)]
    records.insert(3, sharegpt(("human", "no answer")))
    conversations, stats = load_conversations(write_jsonl(tmp_path / "r.jsonl", records), max_samples=4)
    assert [c[0]["content"] for c in conversations] == ["q0", "q1", "q2", "q3"]
    assert stats.kept == 4 and dict(stats.skipped) == {"no_assistant": 1}


def test_json_array_and_truncated_json_array(tmp_path):
    records = [sharegpt(("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(3)]
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps(records, indent=2))
    conversations, stats = load_conversations(whole)
    assert len(conversations) == 3 and stats.total_skipped == 0

    text = whole.read_text()
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.rindex('"a2"') + 2])  # cut inside the last string, like packaged ShareGPT
    conversations, stats = load_conversations(cut)
    assert [c[1]["content"] for c in conversations] == ["a0", "a1"]
    assert stats.kept == 2 and dict(stats.skipped) == {"truncated_source": 1}


def test_json_lines_under_a_json_name(tmp_path, write_jsonl):
    path = tmp_path / "lines.json"
    write_jsonl(path, [sharegpt(("human", "q"), ("gpt", "a")), "{broken", sharegpt(("human", "q2"), ("gpt", "a2"))])
    conversations, stats = load_conversations(path)
    assert len(conversations) == 2 and dict(stats.skipped) == {"malformed": 1}


def test_undecodable_lines_are_counted_not_fatal(tmp_path):
    good = json.dumps(sharegpt(("human", "q"), ("gpt", "a"))).encode()
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(b"\n".join([
        b"\xef\xbb\xbf" + good,  # a byte-order mark on the first line is not an error
        b"\xff\xfe\x00\x01 random bytes",  # not UTF-8
        "caf\xe9".encode("latin-1"),  # another encoding
        b'{"messages": [{"role": "user", "content": "\xc3"}, {"role": "assistant", "content": "a"}]}',  # bad byte inside JSON
        b'{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "a"}]}',  # lone surrogate
        b"{not json",
        b"[" * 100_000,  # nesting too deep to parse
        good,
    ]) + b"\n")
    conversations, stats = load_conversations(path)
    assert conversations == [[user("q"), assistant("a")]] * 2
    assert dict(stats.skipped) == {"not_utf8": 4, "malformed": 2}


@pytest.mark.parametrize("name", ["noise.jsonl", "noise.json", "noise.txt", "noise"])
def test_random_bytes_under_any_name_are_counted_skips(tmp_path, name):
    import random

    path = tmp_path / name
    path.write_bytes(random.Random(0).randbytes(5_000))
    conversations, stats = load_conversations(path)
    assert conversations == [] and stats.kept == 0
    assert stats.total_skipped > 0 and set(stats.skipped) <= {"not_utf8", "malformed"} and stats.skipped["not_utf8"]


def test_a_json_array_with_bytes_that_are_not_utf8_skips_only_that_item(tmp_path):
    ok = json.dumps(sharegpt(("human", "q"), ("gpt", "a"))).encode()
    path = tmp_path / "array.json"
    path.write_bytes(b"[" + ok + b", " + ok.replace(b'"a"', b'"\xff\xfe"') + b", " + ok + b"]")
    conversations, stats = load_conversations(path)
    assert len(conversations) == 2 and dict(stats.skipped) == {"not_utf8": 1}


def test_a_broken_parquet_file_names_data_source(tmp_path):
    from medusa_train.config.check import ConfigError

    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(ConfigError) as info:
        load_conversations(path)
    [problem] = info.value.problems
    assert problem.startswith(f"data.source='{path}': could not be read as a dataset (")


def test_parquet_goes_through_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    records = [
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
        {"conversations": [{"from": "human", "value": "only a question"}]},
    ]
    path = tmp_path / "r.parquet"
    datasets.Dataset.from_list(records).to_parquet(str(path))
    conversations, stats = load_conversations(str(path))
    assert conversations == [[user("q"), assistant("a")]]
    assert stats.kept == 1 and dict(stats.skipped) == {"no_assistant": 1}


def test_missing_file_names_path_and_config_key(tmp_path):
    missing = tmp_path / "nope" / "train.jsonl"
    with pytest.raises(FileNotFoundError) as info:
        load_conversations(missing)
    assert str(missing) in str(info.value) and "data.source" in str(info.value)


def test_hub_id_offline_says_to_use_a_local_file(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ConnectionError, match=r"data\.source=.*local \.json/\.jsonl file"):
        load_conversations("someone/some-sharegpt-set")


def test_unknown_packaged_name():
    with pytest.raises(ValueError, match="packaged:sharegpt-v3"):
        load_conversations("packaged:mt-bench")


def test_summary_is_one_line():
    stats = SkipStats(kept=17528)
    stats.skip("empty", 126)
    stats.skip("truncated_source")
    assert stats.summary() == "kept 17,528 conversations, skipped 127 (empty 126, truncated_source 1)"
    assert SkipStats(kept=3).summary() == "kept 3 conversations, skipped 0"


def test_packaged_source_is_converted_once(tmp_path, monkeypatch):
    records = [sharegpt(("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(5)]
    records.insert(1, sharegpt(("human", "unanswered")))
    text = json.dumps(records, indent=1)
    source = tmp_path / "ShareGPT.json"
    source.write_text(text[: text.rindex('"a4"') + 2])  # cut off mid-string
    monkeypatch.setattr(sources_module, "packaged_data_file", lambda name: source)

    conversations, stats = load_conversations("packaged:sharegpt-v3")
    cached = sources_module.normalised_cache_path(source)
    assert cached.is_file() and not list(tmp_path.glob(".*partial"))
    assert [c[0]["content"] for c in conversations] == ["q0", "q1", "q2", "q3"]
    assert stats.kept == 4 and dict(stats.skipped) == {"no_assistant": 1, "truncated_source": 1}

    # The second load reads the converted file only: the source is not parsed again.
    def fail(*args, **kwargs):
        raise AssertionError("the packaged source was parsed again")

    monkeypatch.setattr(sources_module, "_iter_json_file", fail)
    again, again_stats = load_conversations("packaged:sharegpt-v3")
    assert again == conversations and again_stats == stats
    # A capped read still counts the whole source: what was left out, and every skip.
    first_two, partial_stats = load_conversations("packaged:sharegpt-v3", max_samples=2)
    assert first_two == conversations[:2] and partial_stats.kept == 2 and partial_stats.capped == 2
    assert dict(partial_stats.skipped) == {"no_assistant": 1, "truncated_source": 1}


@pytest.mark.slow
def test_packaged_sharegpt_v3():
    conversations, stats = load_conversations("packaged:sharegpt-v3")
    assert len(conversations) > 17_000
    assert stats.kept == len(conversations)
    assert stats.skipped["truncated_source"] >= 1
    assert "truncated_source" in stats.summary()
    roles = {m["role"] for c in conversations for m in c}
    assert roles == {"system", "user", "assistant"}
    assert all(any(m["role"] == "assistant" and m["content"].strip() for m in c) for c in conversations)
