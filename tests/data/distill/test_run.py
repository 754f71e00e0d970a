import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT
from helpers.distill import KEEP_ALL, WORDS, make_multiturn_jsonl, read_jsonl, tiny_config
from helpers.training import make_model_dir

from medusa_train.backbone.generation import eos_token_ids
from medusa_train.backbone.load import load_backbone
from medusa_train.config.check import ConfigError
from medusa_train.config.compose import compose_config
from medusa_train.data import build_datasets, load_conversations
from medusa_train.data.benchmarks import benchmark_prompt_texts, load_benchmark, normalise_prompt
from medusa_train.data.distill import (
    FilterConfig,
    GenerationSettings,
    JsonlAppender,
    Prompt,
    build_distill_config,
    conversation_id,
    default_output,
    degenerate_reason,
    distill,
    generate_replies,
    loop_start,
    plan_batches,
    prompt_segments,
    repeated_fraction,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    model_dir = make_model_dir(root / "model")
    return model_dir, load_backbone(model_dir, dtype="float32")


# ------------------------------------------------------------------------------------ units
def test_repetition_is_measured_on_tokens_and_normal_text_passes():
    loop = list(range(20)) + [7, 8, 9] * 40
    assert repeated_fraction(loop, 8) > 0.8
    assert repeated_fraction(list(range(200)), 8) == 0.0
    assert repeated_fraction([1, 2, 3], 8) == 0.0  # too short to judge
    filters = FilterConfig()
    assert degenerate_reason("  \n", [5], True, filters) == "empty"
    assert degenerate_reason("x", loop, True, filters) == "repetition"
    assert degenerate_reason("x", list(range(50)), False, filters) == "length"
    assert degenerate_reason("x", list(range(50)), False, FilterConfig(skip_truncated=False)) is None
    assert degenerate_reason("x", loop, True, FilterConfig(max_repeated_fraction=None)) is None


def test_prompt_segments_drop_replies_keep_system_turns_and_stop_at_max_turns():
    conversation = [{"role": "assistant", "content": "a greeting before any user turn"},
                    {"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
                    {"role": "assistant", "content": "a1"}, {"role": "user", "content": "  "},
                    {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"},
                    {"role": "user", "content": "u3"}]
    assert prompt_segments(conversation, 2) == [[{"role": "system", "content": "S"}, {"role": "user", "content": "u1"}],
                                                [{"role": "user", "content": "u2"}]]
    assert len(prompt_segments(conversation, 5)) == 3
    assert prompt_segments([{"role": "assistant", "content": "only"}], 2) == []


def test_ids_are_stable_and_change_with_the_source():
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert conversation_id(3, conversation) == conversation_id(3, [dict(m) for m in conversation])
    assert conversation_id(3, conversation).startswith("000003-")
    assert conversation_id(3, conversation) != conversation_id(3, conversation[:1])


def test_benchmark_matching_ignores_case_and_whitespace(tmp_path):
    questions = tmp_path / "question.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "turns": ["Write  a Poem\nabout cats.", "Shorter."]}) + "\n")
    prompts = benchmark_prompt_texts(str(questions))
    assert normalise_prompt("  write a poem about CATS. ") in prompts and normalise_prompt("shorter.") in prompts


def test_batches_are_length_sorted_within_windows_and_a_resume_keeps_the_order():
    prompts = [Prompt(f"{i:06d}-x", [[{"role": "user", "content": "u"}]], length) for i, length in
               enumerate([5, 1, 4, 2, 3, 9, 8, 7])]
    ids = lambda batches: [[p.id[:6] for p in b] for b in batches]  # noqa: E731
    full = plan_batches(prompts, set(), batch_size=2, sort_window=2)
    assert ids(full) == [["000001", "000003"], ["000002", "000000"], ["000004", "000007"], ["000006", "000005"]]
    resumed = plan_batches(prompts, {"000001-x", "000000-x", "000004-x"}, batch_size=2, sort_window=2)
    assert ids(resumed) == [["000003", "000002"], ["000007", "000006"], ["000005"]]  # same order, minus done


def test_a_torn_last_line_is_dropped_and_finished_lines_are_kept(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"id": "000000-a", "reason": "length"}\n{"id": "000001-b", "reason": "emp')
    with JsonlAppender(path) as appender:
        appender.recover()
        assert appender.dropped_torn_line and [r["id"] for r in appender.lines] == ["000000-a"]
        appender.append({"id": "000001-b", "reason": "empty"})
    assert [r["id"] for r in read_jsonl(path)] == ["000000-a", "000001-b"]
    path.write_text('{"id": "000000-a"}\nnot json\n{"id": "000001-b"}\n')
    with JsonlAppender(path) as appender, pytest.raises(ValueError, match="line 2 is not JSON"):
        appender.recover()


def test_the_yaml_composes_and_every_invalid_value_is_reported_at_once():
    cfg = build_distill_config(compose_config("distill"))
    assert cfg.model.name_or_path == "packaged:smollm2-135m-instruct" and cfg.generation.temperature == 0.0
    assert cfg.exclude_benchmark == "packaged:mt-bench" and cfg.filters.skip_truncated
    assert default_output(cfg) == Path("outputs/distill/smollm2-135m-instruct-400.jsonl")
    with pytest.raises(ConfigError) as err:
        build_distill_config(compose_config("distill", ["batch_size=0", "generation.top_p=0", "max_turns=x",
                                                        "source=/nonexistent/chats.jsonl"]))
    problems = err.value.problems
    assert [p for p in problems if not p.startswith("source=")] == [
        "max_turns='x': expected int", "batch_size=0: must be >= 1", "generation.top_p=0.0: must be in (0, 1]"]
    assert any(p.startswith("source='/nonexistent/chats.jsonl': no such file or directory") for p in problems)


def test_engine_settings_are_checked_before_anything_starts():
    assert build_distill_config(compose_config("distill", ["engine=openai", "url=[http://a:1,http://b:2]"])).url \
        == ["http://a:1", "http://b:2"]
    assert build_distill_config(compose_config("distill", ["engine=openai", "url=http://a:1"])).url == "http://a:1"
    with pytest.raises(ConfigError) as err:
        build_distill_config(compose_config("distill", [
            "engine=openai", "concurrency=0", "server.startup_timeout=0", "model.quantization=nf4"]))
    with pytest.raises(ConfigError) as other:
        build_distill_config(compose_config("distill", ["engine=sglang", "url=http://a:1"]))
    assert err.value.problems == [
        "url=None: engine=openai needs url=http://host:port (or a list)", "concurrency=0: must be >= 1",
        "model.quantization='nf4': the server loads the model itself; quantize it there (server.args) and leave this null",
        "server.startup_timeout=0.0: must be > 0"]
    assert other.value.problems == ["engine='sglang': must be null (in-process), vllm or openai",
                                    "url='http://a:1': only engine=openai reads url"]


def test_a_resume_never_mixes_engines(tiny, tmp_path):
    """The engine is a recorded setting: an in-process output cannot be continued through a server."""
    model_dir, (model, tokenizer) = tiny
    source = make_multiturn_jsonl(tmp_path / "chat.jsonl", 4)
    output = tmp_path / "d.jsonl"
    distill(tiny_config(model_dir, source, output, batch_size=2, **KEEP_ALL), model, tokenizer)
    with pytest.raises(ConfigError, match=r"engine: None -> 'openai'"):
        distill(tiny_config(model_dir, source, output, batch_size=2, engine="openai", url="http://127.0.0.1:9",
                            **KEEP_ALL))


def test_chat_template_is_checked_before_anything_starts():
    with pytest.raises(ConfigError) as err:
        build_distill_config(compose_config("distill", ["chat_template=nope.jinja"]))
    assert err.value.problems == ["chat_template='nope.jinja': must be a Jinja template's text or a file holding one"]
    with pytest.raises(ConfigError, match="engine=openai renders with the server's own template"):
        build_distill_config({"engine": "openai", "url": "http://a:1", "chat_template": "{{ x }}"})


def test_prompts_are_rendered_with_the_given_chat_template(tiny, tmp_path):
    """A template with a long preamble makes every prompt too long: it is what prompts are rendered with. A resume
    never mixes templates."""
    from helpers.tokenizers import CHATML_TEMPLATE

    model_dir, (model, tokenizer) = tiny
    source = make_multiturn_jsonl(tmp_path / "chat.jsonl", 4)
    long = "{{ '" + "ZEBRA " * 300 + "' }}" + CHATML_TEMPLATE
    (tmp_path / "long.jinja").write_text(long)
    output = tmp_path / "d.jsonl"
    own = tokenizer.chat_template
    stats = distill(tiny_config(model_dir, source, output, chat_template=str(tmp_path / "long.jinja"), **KEEP_ALL),
                    model, tokenizer)
    assert stats.selected == 0 and stats.excluded == {"prompt_too_long": 4}
    assert stats.record_settings["chat_template"] == str(tmp_path / "long.jinja")
    assert tokenizer.chat_template == own  # the caller's tokenizer keeps its template
    stats = distill(tiny_config(model_dir, source, tmp_path / "own.jsonl", **KEEP_ALL), model, tokenizer)
    assert stats.selected == 4
    marked = "{{ 'ZEBRA ' }}" + CHATML_TEMPLATE
    assert distill(tiny_config(model_dir, source, tmp_path / "m.jsonl", chat_template=marked, **KEEP_ALL),
                   model, tokenizer).records
    with pytest.raises(ConfigError, match=r"chat_template: \"\{\{ 'ZEBRA ' \}\}.* -> None"):
        distill(tiny_config(model_dir, source, tmp_path / "m.jsonl", **KEEP_ALL), model, tokenizer)


# ------------------------------------------------------------------------------------ tiny model
def test_multiturn_records_answer_each_user_turn_with_the_models_own_context(tiny, tmp_path):
    model_dir, (model, tokenizer) = tiny
    source = make_multiturn_jsonl(tmp_path / "chat.jsonl", 10)
    output = tmp_path / "out" / "d.jsonl"
    stats = distill(tiny_config(model_dir, source, output, batch_size=1, **KEEP_ALL), model, tokenizer)
    records = read_jsonl(output)
    assert stats.records == len(records) and stats.records + sum(stats.skipped.values()) == stats.selected == 10
    assert len({r["id"] for r in records}) == len(records)
    multi = [r for r in records if sum(m["role"] == "assistant" for m in r["messages"]) == 2]
    assert multi, "some conversations have two user turns"
    for record in records:
        roles = [m["role"] for m in record["messages"] if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2)
        assert all(m["content"] != "a reply from another model" for m in record["messages"])
    # the second reply continues the model's own first reply (batch 1: no padding differences)
    first = multi[0]["messages"]
    context = first[:-1]
    again = generate_replies(model, tokenizer, [context], build_distill_config(tiny_config(
        model_dir, source, output)).generation, eos_token_ids(model, tokenizer))[0]
    assert again.text == first[-1]["content"]
    # the training loader reads the file as it is
    conversations, load_stats = load_conversations(output)
    assert len(conversations) == len(records) and load_stats.total_skipped == 0
    train, _, _ = build_datasets(tokenizer, output, max_length=128, eval_size=0)
    assert len(train) == len(records)
    saved = json.loads((tmp_path / "out" / "d.stats.json").read_text())
    assert saved["complete"] and saved["records"] == stats.records
    assert saved["tokens_per_s"] == round(saved["run_new_tokens"] / saved["run_seconds"], 2)  # this run's own rate


def test_greedy_replies_equal_model_generate_although_finished_rows_leave_the_batch(tiny, tmp_path):
    model_dir, (model, tokenizer) = tiny
    settings = GenerationSettings(max_new_tokens=40)
    contexts = [[{"role": "user", "content": " ".join(WORDS[i:i + 2 + 3 * (i % 4)])}] for i in range(6)]
    free = generate_replies(model, tokenizer, contexts, settings, [], FilterConfig(loop_window=None))
    # an end-of-turn id some rows generate and others never do: rows leave the batch at different steps
    eos = [next(t for t in free[0].tokens[5:] if any(t not in r.tokens for r in free))]
    caches = []  # every pass steps over the cache that appends in place (rows leaving it: batch_select_indices)
    hook = model.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: caches.append(type(kwargs.get("past_key_values")).__name__), with_kwargs=True)
    try:
        replies = generate_replies(model, tokenizer, contexts, settings, eos, FilterConfig(loop_window=None))
    finally:
        hook.remove()
    assert caches and set(caches) == {"AppendingCache"}, caches
    assert len({r.generated for r in replies}) >= 2 and any(not r.finished for r in replies)
    for context, reply in zip(contexts, replies):  # one at a time: no padding, no batch
        ids = tokenizer.apply_chat_template(context, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                             eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
        expected = out[:out.index(next(t for t in out if t in eos))] if any(t in eos for t in out) else out
        assert reply.tokens == expected
        assert reply.finished == any(t in eos for t in out)
        assert reply.generated == len(expected) + int(reply.finished)


def test_loops_stop_generation_early_and_keep_exactly_the_text_before_the_loop(tiny, tmp_path):
    model_dir, (model, tokenizer) = tiny
    source = make_multiturn_jsonl(tmp_path / "x.jsonl", 1)  # (the config's source must exist; unused here)
    cfg = build_distill_config(tiny_config(model_dir, source, tmp_path / "o.jsonl", generation={"max_new_tokens": 96}))
    contexts = [[{"role": "user", "content": " ".join(WORDS[i:i + 3 + i % 4])}] for i in range(8)]
    eos = eos_token_ids(model, tokenizer)
    full = generate_replies(model, tokenizer, contexts, cfg.generation, eos, FilterConfig(loop_window=None))
    loop = FilterConfig(loop_window=16)
    stopped = generate_replies(model, tokenizer, contexts, cfg.generation, eos, loop)
    looped = [i for i, r in enumerate(stopped) if r.looped]
    assert looped, "a random model loops: some rows must be stopped"
    assert sum(r.generated for r in stopped) < sum(r.generated for r in full)
    for f, s in zip(full, stopped):
        if not s.looped:
            assert (s.tokens, s.finished, s.generated) == (f.tokens, f.finished, f.generated)
            continue
        # the stopped row is the full row's start, cut where its loop (sustained for 16 n-grams) began
        assert s.generated < f.generated and s.tokens == f.tokens[:len(s.tokens)] and not s.finished
        assert loop_start(f.tokens[:s.generated], loop.repetition_ngram, 16) == len(s.tokens)
        assert loop_start(f.tokens[:s.generated - 1], loop.repetition_ngram, 16) is None
        assert s.text == tokenizer.decode(s.tokens, skip_special_tokens=True)


def test_trimmed_loops_are_kept_and_counted_or_skipped_as_repetition(tiny, tmp_path):
    model_dir, (model, tokenizer) = tiny
    source = make_multiturn_jsonl(tmp_path / "chat.jsonl", 12)
    common = {"generation": {"max_new_tokens": 96}, "max_turns": 1}
    trim = distill(tiny_config(model_dir, source, tmp_path / "trim.jsonl", **common,
                               filters={"loop_window": 16, "skip_truncated": True}), model, tokenizer)
    drop = distill(tiny_config(model_dir, source, tmp_path / "drop.jsonl", **common,
                               filters={"loop_window": 16, "trim_loops": False, "skip_truncated": True}),
                   model, tokenizer)
    trimmed = trim.stopped_early.get("loop_trimmed", 0)
    assert trimmed > 0 and trim.records == drop.records + trimmed
    assert drop.skipped.get("repetition", 0) >= trimmed and "loop_trimmed" not in drop.stopped_early
    records = read_jsonl(tmp_path / "trim.jsonl")
    assert sum(r["stopped"] == "loop_trimmed" for r in records) == trimmed
    for r in records:  # new_tokens counts the kept text, not the loop that was cut off
        reply = tokenizer(r["messages"][-1]["content"], add_special_tokens=False).input_ids
        assert r["new_tokens"] <= len(reply) + 2
    assert trim.new_tokens < trim.run_new_tokens


def test_degenerate_replies_are_skipped_counted_and_not_redone(tiny, tmp_path):
    model_dir, (model, tokenizer) = tiny
    source = make_multiturn_jsonl(tmp_path / "chat.jsonl", 12)
    output = tmp_path / "d.jsonl"
    stats = distill(tiny_config(model_dir, source, output), model, tokenizer)  # default filters
    skipped = read_jsonl(tmp_path / "d.skipped.jsonl")
    assert stats.records + len(skipped) == 12 and sum(stats.skipped.values()) == len(skipped)
    assert set(stats.skipped) <= {"empty", "length", "repetition"} and stats.skipped, \
        "a random model loops or runs on: some replies must be rejected"
    again = distill(tiny_config(model_dir, source, output), model, tokenizer)
    assert again.run_conversations == 0 and again.records == stats.records and again.resumed_records == 12
    with pytest.raises(ConfigError, match="generation"):
        distill(tiny_config(model_dir, source, output, generation={"max_new_tokens": 8}), model, tokenizer)


def test_sampling_follows_temperature_top_p_and_seed(tiny, tmp_path):
    model_dir, (model, tokenizer) = tiny
    source = make_multiturn_jsonl(tmp_path / "chat.jsonl", 6)

    def run(name: str, seed: int) -> list[dict]:
        sampling = {"generation": {"temperature": 1.0, "top_p": 0.9}, "seed": seed}
        distill(tiny_config(model_dir, source, tmp_path / name, **sampling, **KEEP_ALL), model, tokenizer)
        return read_jsonl(tmp_path / name)

    greedy = distill(tiny_config(model_dir, source, tmp_path / "greedy.jsonl", **KEEP_ALL), model, tokenizer)
    first, again, other = run("a.jsonl", 3), run("b.jsonl", 3), run("c.jsonl", 4)
    assert first == again and first != other and greedy.records == 6
    assert tokenizer.padding_side == "right"  # generation padded on the left without changing the tokenizer
    assert first != read_jsonl(tmp_path / "greedy.jsonl")


@pytest.mark.slow  # reads the packaged MT-Bench questions
def test_no_mt_bench_prompt_is_ever_distilled(tiny, tmp_path):
    model_dir, (model, tokenizer) = tiny
    questions = load_benchmark("packaged:mt-bench")
    first, second = questions[0].turns, questions[1].turns
    extra = [  # turn 1, turn 2 (after an ordinary turn), and both, with whitespace and case changed
        {"conversations": [{"from": "human", "value": "  " + first[0].upper()}, {"from": "gpt", "value": "x"}]},
        {"conversations": [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "x"},
                           {"from": "human", "value": second[1].replace(" ", "\n ")}, {"from": "gpt", "value": "y"}]},
        {"messages": [{"role": "user", "content": second[0]}, {"role": "assistant", "content": "x"},
                      {"role": "user", "content": second[1]}, {"role": "assistant", "content": "y"}]},
    ]
    source = make_multiturn_jsonl(tmp_path / "chat.jsonl", 6, extra=extra)
    output = tmp_path / "d.jsonl"
    stats = distill(tiny_config(model_dir, source, output, exclude_benchmark="packaged:mt-bench", **KEEP_ALL),
                    model, tokenizer)
    assert stats.excluded == {"benchmark_prompt": 3} and stats.benchmark_prompts_excluded == 4
    benchmark = benchmark_prompt_texts("packaged:mt-bench")
    written = [m["content"] for r in read_jsonl(output) for m in r["messages"] if m["role"] == "user"]
    assert written and not any(normalise_prompt(text) in benchmark for text in written)
    assert stats.selected == 6


def _script(model_dir: Path, source: Path, output: Path) -> list[str]:
    return [sys.executable, "scripts/distill.py", f"model.name_or_path={model_dir}", "model.dtype=float32",
            f"source={source}", f"output={output}", "num_prompts=null", "batch_size=2", "sort_window=4",
            "max_turns=2", "max_prompt_tokens=256", "generation.max_new_tokens=40", "exclude_benchmark=null",
            "filters.skip_truncated=false", "filters.max_repeated_fraction=null",
            "validation.size=0"]  # as tiny_config: the reference run holds no validation set out


@pytest.mark.integration
def test_sigkill_mid_run_then_rerun_gives_the_records_of_an_uninterrupted_run(tiny, tmp_path):
    model_dir, (model, tokenizer) = tiny
    source = make_multiturn_jsonl(tmp_path / "chat.jsonl", 64, seed=1)
    reference = distill(build_distill_config(tiny_config(
        model_dir, source, tmp_path / "ref.jsonl", batch_size=2, sort_window=4, generation={"max_new_tokens": 40},
        **KEEP_ALL)), model, tokenizer)
    assert reference.records + sum(reference.skipped.values()) == 64

    output = tmp_path / "killed" / "d.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(_script(model_dir, source, output), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline and len(read_jsonl_safely(output)) < 4:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    before = output.read_bytes()
    written = len(before.splitlines())
    assert 4 <= written < reference.records, "the run finished before it could be killed"
    with open(output, "ab") as f:  # what a kill during a write leaves behind
        f.write(b'{"id": "000047-deadbeef00", "messages": [{"role": "us')

    result = subprocess.run(_script(model_dir, source, output), cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert output.read_bytes().startswith(before)  # nothing written before the kill is lost
    records = read_jsonl(output)
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)) == reference.records
    assert set(ids) == {r["id"] for r in read_jsonl(tmp_path / "ref.jsonl")}
    stats = json.loads((tmp_path / "killed" / "d.stats.json").read_text())
    assert stats["complete"] and stats["dropped_torn_line"] and stats["resumed_records"] == written
    assert stats["records"] == reference.records and "tokens/s" in result.stdout


def read_jsonl_safely(path: Path) -> list[bytes]:
    """Finished lines of a file another process is appending to."""
    try:
        return path.read_bytes().split(b"\n")[:-1]
    except FileNotFoundError:
        return []


def test_max_minutes_sizes_the_data_to_the_time_and_a_later_run_goes_on(tiny, tmp_path):
    """A spent time budget stops between batches: the batches done are written, the stats say how many of the
    selected prompts that is, and a run without the limit on the same output distils only the rest, giving the
    records of one uninterrupted run."""
    model_dir, (model, tokenizer) = tiny
    source = make_multiturn_jsonl(tmp_path / "chat.jsonl", 12)
    whole = distill(tiny_config(model_dir, source, tmp_path / "whole.jsonl"), model, tokenizer)
    assert not whole.stopped_at_max_minutes
    output = tmp_path / "sized.jsonl"
    sized = distill(tiny_config(model_dir, source, output, max_minutes=1e-9), model, tokenizer)
    assert sized.stopped_at_max_minutes and sized.run_conversations == 4  # one batch (batch_size=4), then stop
    assert sized.records + sum(sized.skipped.values()) == 4 and sized.selected == 12
    assert "stopped at max_minutes with 4 of 12 selected prompts done" in sized.summary()
    assert json.loads((tmp_path / "sized.stats.json").read_text())["stopped_at_max_minutes"] is True
    rest = distill(tiny_config(model_dir, source, output), model, tokenizer)
    assert rest.run_conversations == 8 and not rest.stopped_at_max_minutes and rest.records == whole.records
    by_id = lambda path: sorted(read_jsonl(path), key=lambda r: r["id"])  # noqa: E731
    assert by_id(output) == by_id(tmp_path / "whole.jsonl")
    with pytest.raises(ConfigError, match="max_minutes"):
        distill(tiny_config(model_dir, source, output, max_minutes=0), model, tokenizer)
