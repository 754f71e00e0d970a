"""Conversations as users have them: content-part lists, tool results and tool calls, a template override.

Real templates: the packaged model's (renders any role, drops tool calls) and a tool-capable ChatML
template built here (renders calls as ``<tool_call>{json}</tool_call>``).
"""

from __future__ import annotations

import copy

import pytest
from helpers.backbones import PACKAGED_MODEL

from medusa_train.data import IGNORE_INDEX, SkipStats, load_conversations, normalise_record
from medusa_train.data.batching import tokenize_conversations
from medusa_train.data.tokenize import template_support

TOOL_TEMPLATE = (
    "{%- for m in messages -%}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- if m.tool_calls is defined and m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)

# An OpenAI-style record: content-part lists, an assistant turn that only calls a tool (content null,
# arguments as JSON text), the tool's result, then the assistant's answer.
RECORD = {"messages": [
    {"role": "system", "content": [{"type": "text", "text": "You answer with the weather."}]},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}, {"type": "text", "text": "Be brief."}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "Rain, 4 degrees."},
    {"role": "assistant", "content": [{"type": "text", "text": "It rains in Oslo: 4 degrees."}]},
]}


@pytest.fixture(scope="module")
def tokenizer():
    from medusa_train.backbone import load_tokenizer

    return load_tokenizer(PACKAGED_MODEL)


@pytest.fixture
def tool_tokenizer(tokenizer):
    tool = copy.deepcopy(tokenizer)
    tool.chat_template = TOOL_TEMPLATE
    return tool


def labelled_text(tokenizer, example) -> str:
    return tokenizer.decode([t for t, label in zip(example["input_ids"], example["labels"]) if label != IGNORE_INDEX])


def test_records_are_normalised_as_users_write_them():
    conversation = normalise_record(RECORD)
    assert conversation[1] == {"role": "user", "content": "Weather in Oslo?\nBe brief."}
    assert conversation[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    assert conversation[3] == {"role": "tool", "content": "Rain, 4 degrees.", "name": "get_weather",
                               "tool_call_id": "call_1"}
    # older forms: a function role and a function_call
    old = normalise_record({"messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
        {"role": "function", "name": "f", "content": "r"}, {"role": "assistant", "content": "a"}]})
    assert old[1]["tool_calls"] == [{"type": "function", "function": {"name": "f", "arguments": {}}}]
    assert old[2] == {"role": "tool", "content": "r", "name": "f"}


def test_non_text_parts_and_bad_parts_are_counted(tmp_path, write_jsonl):
    image = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                       {"type": "image_url", "image_url": {"url": "x"}}]},
                          {"role": "assistant", "content": "A cat."}]}
    null_user = {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "a"}]}
    only_call = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
                                                                 "tool_calls": [{"function": {"name": "f"}}]}]}
    conversations, stats = load_conversations(write_jsonl(tmp_path / "r.jsonl", [RECORD, image, null_user, only_call]))
    assert len(conversations) == 1
    assert dict(stats.skipped) == {"non_text_content": 1, "malformed": 1, "no_assistant": 1}


@pytest.mark.slow
def test_tool_capable_template_keeps_the_conversation_and_labels_only_assistant_text(tool_tokenizer):
    assert template_support(tool_tokenizer) == {"tool": True, "tool_calls": True}
    stats = SkipStats(kept=1)
    [example] = tokenize_conversations(tool_tokenizer, [normalise_record(RECORD)], 512, stats)
    text = tool_tokenizer.decode(example["input_ids"])
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert "<|im_start|>tool\nRain, 4 degrees.<|im_end|>" in text  # the tool's result is context
    assert labelled_text(tool_tokenizer, example) == "It rains in Oslo: 4 degrees.<|im_end|>"
    assert stats.kept == 1 and not stats.skipped


@pytest.mark.slow
def test_template_without_tool_calls_skips_and_counts(tokenizer):
    assert template_support(tokenizer) == {"tool": True, "tool_calls": False}
    answer_after_tool = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
        {"role": "tool", "content": "Rain, 4 degrees."},
        {"role": "assistant", "content": [{"type": "text", "text": "It rains."}]}]}
    stats = SkipStats(kept=2)
    examples = tokenize_conversations(tokenizer, [normalise_record(RECORD), normalise_record(answer_after_tool)],
                                      512, stats)
    assert dict(stats.skipped) == {"tool_calls_unsupported": 1} and stats.kept == 1
    [example] = examples  # the tool result alone renders (as a ChatML "tool" turn): kept, never labelled
    assert "<|im_start|>tool\nRain, 4 degrees.<|im_end|>" in tokenizer.decode(example["input_ids"])
    assert labelled_text(tokenizer, example) == "It rains.<|im_end|>"


@pytest.mark.slow
def test_training_reads_tool_conversations_with_the_configured_template(tmp_path, write_jsonl, capsys, monkeypatch):
    """``data.chat_template`` (a file) replaces the tokenizer's, through the training setup and its cache."""
    from accelerate import Accelerator

    from medusa_train.backbone import load_tokenizer
    from medusa_train.config.train import build_config
    from medusa_train.data.examples import load_examples

    template = tmp_path / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    source = write_jsonl(tmp_path / "tools.jsonl", [RECORD] * 6)
    cfg = build_config({"data": {"source": str(source), "chat_template": str(template), "eval_size": 2},
                        "trainer": {"output_dir": str(tmp_path / "run")}})
    tokenizer = load_tokenizer(PACKAGED_MODEL)
    monkeypatch.setenv("MEDUSA_TRAIN_CACHE", str(tmp_path / "cache"))
    train, evals = load_examples(cfg.data, tokenizer, Accelerator(cpu=True))
    assert len(train) == 4 and len(evals) == 2
    assert "<tool_call>" in tokenizer.decode(train[0]["input_ids"])
    out = capsys.readouterr().out
    assert "data: 6 of 6 conversations selected; 6 usable after tokenising: 4 train, 2 held out" in out
    assert "capped" not in out
