"""Which conversations are distilled, as what, and in which order.

A source conversation becomes a ``Prompt``: a stable id (its index in the source + a hash of it) and
its system/user turns cut into one segment per reply to generate. ``select_prompts`` takes the first
``num_prompts`` usable ones (not quoting the evaluation benchmark, holding no validation prompt, first prompt short
enough), and
``plan_batches`` orders those not yet done into length-sorted batches that a resumed run writes in
the same order as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from medusa_train.config.distill import DistillConfig
from medusa_train.data.benchmarks import normalise_prompt

Message = dict[str, str]


@dataclass
class Prompt:
    """One conversation to distill: its id and its turns, cut into one segment per reply to generate."""

    id: str
    segments: list[list[Message]]  # each: the system/user messages before one reply, ending with a user turn
    length: int  # tokens of the first prompt (for length-sorted batching)


def conversation_id(index: int, conversation: list[Message]) -> str:
    """Stable id of a source conversation: its index in the source and a hash of its content."""
    digest = hashlib.sha1(json.dumps(conversation, ensure_ascii=False, sort_keys=True).encode()).hexdigest()
    return f"{index:06d}-{digest[:10]}"


def prompt_segments(conversation: list[Message], max_turns: int) -> list[list[Message]]:
    """Drop the assistant turns and cut the rest after each of the first ``max_turns`` user turns."""
    segments: list[list[Message]] = []
    current: list[Message] = []
    for message in conversation:
        if message["role"] == "assistant" or (message["role"] == "user" and not message["content"].strip()):
            continue
        current.append({"role": message["role"], "content": message["content"]})
        if message["role"] == "user":
            segments.append(current)
            current = []
            if len(segments) == max_turns:
                break
    return segments


@dataclass
class Selection:
    """The conversations chosen for distillation and why the others were not."""

    prompts: list[Prompt]
    known_ids: dict[int, str]  # index -> id of every conversation looked at
    source_summary: str = ""
    considered: int = 0
    excluded: Counter = field(default_factory=Counter)  # reason -> conversations
    benchmark_prompts_excluded: int = 0  # user turns that matched the benchmark


def render_length(tokenizer, messages: list[Message]) -> int:
    """Tokens of ``messages`` rendered with the chat template and the generation prompt."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def select_prompts(cfg: DistillConfig, tokenizer, benchmark: set[str]) -> Selection:
    """The first ``num_prompts`` usable conversations of ``cfg.source`` (reading further as needed)."""
    from medusa_train.data import load_conversations
    from medusa_train.data.validation import held_out, validation_prompts

    v = cfg.validation
    validation = held_out(validation_prompts(v.source or cfg.source, v.size, v.seed))
    want = cfg.num_prompts
    to_read = None if want is None else max(2 * want, want + 64)
    while True:
        conversations, load_stats = load_conversations(cfg.source, max_samples=to_read)
        selection = _select(conversations, cfg, tokenizer, benchmark, want, validation)
        if to_read is None or len(selection.prompts) == want or len(conversations) < to_read:
            selection.source_summary = load_stats.summary()
            return selection
        to_read *= 4


def _select(conversations, cfg: DistillConfig, tokenizer, benchmark: set[str], want: int | None,
            validation: frozenset[str] = frozenset()) -> Selection:
    from jinja2 import TemplateError

    selection = Selection(prompts=[], known_ids={})
    for index, conversation in enumerate(conversations):
        if want is not None and len(selection.prompts) == want:
            break
        selection.considered += 1
        selection.known_ids[index] = conversation_id(index, conversation)
        segments = prompt_segments(conversation, cfg.max_turns)
        if not segments:
            selection.excluded["no_user_turn"] += 1
            continue
        if validation and any(normalise_prompt(s[-1]["content"]) in validation for s in segments):
            selection.excluded["validation_prompt"] += 1  # held out: the validation set (config/validation.py)
            continue
        matches = sum(normalise_prompt(s[-1]["content"]) in benchmark for s in segments)
        if matches:
            selection.excluded["benchmark_prompt"] += 1
            selection.benchmark_prompts_excluded += matches
            continue
        try:
            length = render_length(tokenizer, segments[0])
        except TemplateError:  # the template refused this conversation (e.g. its role order)
            selection.excluded["template_error"] += 1
            continue
        if length > cfg.max_prompt_tokens:
            selection.excluded["prompt_too_long"] += 1
            continue
        selection.prompts.append(Prompt(selection.known_ids[index], segments, length))
    return selection


def plan_batches(selected: Sequence[Prompt], done: set[str], batch_size: int, sort_window: int) -> list[list[Prompt]]:
    """Length-sorted batches of the prompts not yet done.

    Windows of ``batch_size * sort_window`` prompts are cut from the whole selection (done ones
    included), so a resumed run writes the remaining records in the order an uninterrupted run would.
    """
    window = batch_size * sort_window
    batches: list[list[Prompt]] = []
    for start in range(0, len(selected), window):
        todo = [p for p in selected[start:start + window] if p.id not in done]
        todo.sort(key=lambda p: p.length)  # stable: ties keep source order
        batches += [todo[i:i + batch_size] for i in range(0, len(todo), batch_size)]
    return batches
