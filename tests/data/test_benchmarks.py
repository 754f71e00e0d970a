"""Benchmark prompt sets: every accepted record shape, broken lines counted, packaged MT-Bench."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from medusa_train.data.benchmarks import (
    BenchPrompt,
    benchmark_prompt_texts,
    load_benchmark,
    normalise_prompt,
)
from medusa_train.data.sources import SkipStats

RECORDS = [
    {"prompt": "What is 2 + 2?"},
    {"turns": ["Write a poem.", "Now shorten it."], "category": "writing", "id": 7},
    {"turns": ["Solve x + 1 = 3."], "question_id": 99, "category": "math"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]},
    {"conversations": [{"from": "human", "value": "Tell me a joke."}, {"from": "gpt", "value": "No."}]},
]


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_every_record_shape(tmp_path):
    path = write_lines(tmp_path / "bench.jsonl", [json.dumps(r) for r in RECORDS])
    prompts = load_benchmark(path)
    assert prompts == [
        BenchPrompt("1", "uncategorized", ["What is 2 + 2?"]),
        BenchPrompt("7", "writing", ["Write a poem.", "Now shorten it."]),
        BenchPrompt("99", "math", ["Solve x + 1 = 3."]),
        BenchPrompt("4", "uncategorized", ["Hi", "Bye"]),  # user turns only
        BenchPrompt("5", "uncategorized", ["Tell me a joke."]),
    ]


def test_broken_lines_are_counted_and_skipped(tmp_path):
    lines = [json.dumps(RECORDS[0]), "{not json", "", json.dumps({"text": "unknown shape"}),
             json.dumps({"turns": ["ok", 3]}), json.dumps({"prompt": "   "}), json.dumps(RECORDS[1])]
    path = write_lines(tmp_path / "bench.jsonl", lines)
    stats = SkipStats()
    with pytest.warns(UserWarning, match=r"skipped 4 broken record\(s\) \(line 2, 4, 5, 6\)"):
        prompts = load_benchmark(path, stats=stats)
    assert [p.id for p in prompts] == ["1", "7"]
    assert stats.kept == 2
    assert stats.skipped == Counter(malformed=3, empty=1)  # the blank line is not a record


def test_limit_and_errors(tmp_path):
    path = write_lines(tmp_path / "bench.jsonl", [json.dumps(r) for r in RECORDS])
    assert [p.id for p in load_benchmark(path, limit=2)] == ["1", "7"]
    with pytest.raises(ValueError, match="bench.limit=0"):
        load_benchmark(path, limit=0)
    with pytest.raises(FileNotFoundError, match="bench.source"):
        load_benchmark(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="not a packaged benchmark"):
        load_benchmark("packaged:sharegpt-v3")


def test_json_array_file(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(RECORDS[:2]))
    assert [p.turns for p in load_benchmark(path)] == [["What is 2 + 2?"], ["Write a poem.", "Now shorten it."]]


def test_prompt_texts_are_normalised(tmp_path):
    path = write_lines(tmp_path / "bench.jsonl", [json.dumps(r) for r in RECORDS])
    texts = benchmark_prompt_texts(path)
    assert normalise_prompt("  write A   poem.\n") in texts
    assert normalise_prompt("Now shorten it.") in texts
    assert "hello!" not in texts  # assistant turns are not prompts


@pytest.mark.slow
def test_packaged_mt_bench():
    prompts = load_benchmark("packaged:mt-bench")
    assert len(prompts) == 80
    assert len({p.id for p in prompts}) == 80
    assert Counter(p.category for p in prompts) == {c: 10 for c in Counter(p.category for p in prompts)}
    assert len({p.category for p in prompts}) == 8
    assert all(len(p.turns) == 2 for p in prompts)
    assert len(benchmark_prompt_texts()) >= 159  # 160 turns; identical turns collapse


def test_spread_takes_prompts_round_robin_over_categories():
    everything = load_benchmark("packaged:mt-bench")
    spread = load_benchmark("packaged:mt-bench", limit=20, pick="spread")
    first = load_benchmark("packaged:mt-bench", limit=20, pick="first")
    assert set(Counter(p.category for p in first)) == {"writing", "roleplay"}  # the file is sorted by category
    assert Counter(p.category for p in spread) == {c: 3 if i < 4 else 2 for i, c in enumerate(
        dict.fromkeys(p.category for p in everything))}
    for category in {p.category for p in spread}:  # each category's own first prompts, in file order
        mine = [p.id for p in spread if p.category == category]
        assert mine == [p.id for p in everything if p.category == category][:len(mine)]
    assert [p.id for p in load_benchmark("packaged:mt-bench", limit=None, pick="spread")] == \
        [p.id for p in everything]
    with pytest.raises(ValueError, match="bench.pick='random'"):
        load_benchmark("packaged:mt-bench", limit=3, pick="random")
