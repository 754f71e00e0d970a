"""Self-distillation: the backbone answers the training prompts itself.

Heads learn to predict what *this* backbone will say, so the best training data is the
backbone's own replies (the Medusa paper's self-distillation). ``distill`` takes the user
turns of any conversation source, regenerates every assistant turn with the model (its own
earlier replies as context), and appends one ``{"messages": [...]}`` line per finished
conversation to a jsonl that ``data.source=`` reads directly::

    python scripts/distill.py num_prompts=400 generation.max_new_tokens=256

Files written for ``output=X.jsonl``:

- ``X.jsonl``: the records, each tagged with the ``id`` of its source conversation (index in
  the source + a hash of it), appended and flushed one finished conversation at a time.
- ``X.skipped.jsonl``: ``{"id", "reason"}`` of conversations whose first reply was degenerate,
  so a re-run does not regenerate them.
- ``X.stats.json``: the settings (written first) and the counts (rewritten at the end).

Re-running with the same output continues where it stopped: finished ids are skipped, and a
line torn by a kill is dropped before appending. Conversations that quote an evaluation
benchmark's prompts (MT-Bench by default, both turns) are never distilled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from medusa_train.config.paths import CONFIG_DIR
from medusa_train.config.train import ConfigError, ModelConfig, check_model, parse_config
from medusa_train.data.benchmarks import benchmark_prompt_texts, normalise_prompt
from medusa_train.data.distill.repetition import LoopTracker, repeated_fraction

Message = dict[str, str]

# Settings that change what a record contains: resuming an output made with others is refused.
RECORD_SETTINGS = ("model.name_or_path", "model.dtype", "model.quantization", "source", "max_turns",
                   "max_prompt_tokens", "seed", "exclude_benchmark", "generation", "filters")


@dataclass
class GenerationSettings:
    max_new_tokens: int = 256  #: tokens per reply at most
    temperature: float = 0.0  #: 0 = greedy (the default: the heads learn the greedy continuation)
    top_p: float = 1.0  #: nucleus sampling (only when temperature > 0)


@dataclass
class FilterConfig:
    skip_truncated: bool = True  #: drop replies with no end-of-turn token within max_new_tokens
    repetition_ngram: int = 8  #: n-gram size (tokens) of the repetition test
    max_repeated_fraction: float | None = 0.5  #: drop replies whose repeated n-grams cover this share (null = off)
    #: stop a reply once its last ``loop_window`` n-grams all repeat earlier ones (null = generate on to the limit)
    loop_window: int | None = 64
    trim_loops: bool = True  #: keep a stopped reply's text before its loop (else skip it as ``repetition``)


@dataclass
class DistillConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    source: str = "packaged:sharegpt-v3"  #: conversations whose user turns are the prompts (any data.source)
    num_prompts: int | None = 400  #: conversations to distill, after exclusions (null = all)
    max_turns: int = 2  #: user turns answered per conversation (system turns are kept)
    max_prompt_tokens: int = 512  #: longer first prompts are not selected; longer later contexts end the conversation
    batch_size: int = 8  #: conversations generated together (left-padded)
    sort_window: int = 8  #: batches per window inside which prompts are sorted by length
    seed: int = 0  #: sampling seed (greedy ignores it)
    output: str | None = None  #: jsonl to write (default: outputs/distill/<model>-<num_prompts>.jsonl)
    exclude_benchmark: str | None = "packaged:mt-bench"  #: benchmark (any bench.source) whose prompts are never distilled
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    filters: FilterConfig = field(default_factory=FilterConfig)
    progress: bool = True  #: tqdm bar with tokens/s


def build_distill_config(raw: Any) -> DistillConfig:
    """A validated ``DistillConfig`` (see ``config.parse_config``)."""
    return parse_config(DistillConfig, raw, check_distill_config)


def check_distill_config(c: DistillConfig) -> list[str]:
    """Range checks; returns every problem found, each naming its key."""
    p: list[str] = []

    def need(ok: bool, key: str, value, rule: str):
        if not ok:
            p.append(f"{key}={value!r}: {rule}")

    p += check_model(c.model)
    need(bool(c.source), "source", c.source, "must name a conversation source")
    need(c.num_prompts is None or c.num_prompts >= 1, "num_prompts", c.num_prompts, "must be >= 1 or null (all)")
    need(c.max_turns >= 1, "max_turns", c.max_turns, "must be >= 1")
    need(c.max_prompt_tokens >= 8, "max_prompt_tokens", c.max_prompt_tokens, "must be >= 8")
    need(c.batch_size >= 1, "batch_size", c.batch_size, "must be >= 1")
    need(c.sort_window >= 1, "sort_window", c.sort_window, "must be >= 1")
    need(c.output is None or bool(c.output), "output", c.output, "must be a path or null")
    g, f = c.generation, c.filters
    need(g.max_new_tokens >= 1, "generation.max_new_tokens", g.max_new_tokens, "must be >= 1")
    need(g.temperature >= 0, "generation.temperature", g.temperature, "must be >= 0 (0 = greedy)")
    need(0 < g.top_p <= 1, "generation.top_p", g.top_p, "must be in (0, 1]")
    need(f.repetition_ngram >= 1, "filters.repetition_ngram", f.repetition_ngram, "must be >= 1")
    need(f.loop_window is None or f.loop_window >= 1, "filters.loop_window", f.loop_window, "must be >= 1 or null (off)")
    need(f.max_repeated_fraction is None or 0 < f.max_repeated_fraction <= 1, "filters.max_repeated_fraction",
         f.max_repeated_fraction, "must be in (0, 1] or null (off)")
    return p


# ------------------------------------------------------------------------------------ prompts
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

    want = cfg.num_prompts
    to_read = None if want is None else max(2 * want, want + 64)
    while True:
        conversations, load_stats = load_conversations(cfg.source, max_samples=to_read)
        selection = _select(conversations, cfg, tokenizer, benchmark, want)
        if to_read is None or len(selection.prompts) == want or len(conversations) < to_read:
            selection.source_summary = load_stats.summary()
            return selection
        to_read *= 4


def _select(conversations, cfg: DistillConfig, tokenizer, benchmark: set[str], want: int | None) -> Selection:
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


# ------------------------------------------------------------------------------------ replies
def degenerate_reason(text: str, tokens: Sequence[int], finished: bool, filters: FilterConfig,
                      looped: bool = False) -> str | None:
    """Why a reply should not be trained on (``empty``, ``repetition``, ``length``), or ``None``.

    ``looped``: generation was stopped in a sustained loop; ``tokens`` then end where it began
    (kept with ``filters.trim_loops``, else the reply counts as ``repetition``).
    """
    if not text.strip():
        return "empty"
    if looped and not filters.trim_loops:
        return "repetition"
    if filters.max_repeated_fraction is not None and \
            repeated_fraction(tokens, filters.repetition_ngram) >= filters.max_repeated_fraction:
        return "repetition"
    if not finished and not looped and filters.skip_truncated:
        return "length"
    return None


@dataclass
class Reply:
    text: str
    tokens: list[int]  # the reply's tokens, before the end-of-turn token (or before its loop)
    finished: bool  # an end-of-turn token was generated within max_new_tokens
    generated: int  # tokens generated for it (with the end-of-turn token and any cut-off loop)
    looped: bool = False  # stopped in a sustained loop; ``tokens`` end where the loop began


def eos_token_ids(model, tokenizer) -> list[int]:
    """End-of-turn ids: the model's generation config and the tokenizer's eos."""
    ids = model.generation_config.eos_token_id
    ids = list(ids) if isinstance(ids, (list, tuple)) else [] if ids is None else [ids]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("neither the model's generation config nor the tokenizer names an eos token")
    return ids


def next_tokens(logits: torch.Tensor, settings: GenerationSettings) -> torch.Tensor:
    """(rows,) next token per row: the argmax, or a draw from the temperature / top-p distribution."""
    if settings.temperature <= 0:
        return logits.argmax(-1)
    probs = (logits.float() / settings.temperature).softmax(-1)
    if settings.top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= settings.top_p  # the most likely token always stays
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    return torch.multinomial(probs, 1).squeeze(-1)


@torch.inference_mode()
def generate_replies(model, tokenizer, contexts: list[list[Message]], settings: GenerationSettings,
                     eos_ids: list[int], filters: FilterConfig | None = None) -> list[Reply]:
    """One reply per context, generated together from one left-padded batch.

    A row leaves the batch (and its KV cache) as soon as it is done: it generated an end-of-turn
    token, reached ``max_new_tokens``, or (with ``filters.loop_window``) got stuck in a loop, in
    which case its tokens end where the loop began. So no compute goes to finished rows, and
    long-looping rows do not hold the batch up. Greedy replies equal ``model.generate``'s.
    """
    from transformers import DynamicCache

    filters = filters or FilterConfig()
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in contexts]
    # generation continues from the last column, so pad on the left (the tokenizer's own setting is left alone)
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left",
                      add_special_tokens=False).to(model.device)
    mask = batch["attention_mask"]
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                   past_key_values=cache, use_cache=True).logits[:, -1]
    window = filters.loop_window or settings.max_new_tokens + 1  # (no loop can last longer: never stops)
    trackers = [LoopTracker(filters.repetition_ngram, window) for _ in contexts]
    replies: list[Reply | None] = [None] * len(contexts)
    rows = list(range(len(contexts)))  # the context of each batch row
    eos = set(eos_ids)
    for step in range(1, settings.max_new_tokens + 1):
        keep = []
        for position, (row, token) in enumerate(zip(rows, next_tokens(logits, settings).tolist())):
            tracker = trackers[row]
            if token in eos:
                replies[row] = Reply(_decode(tokenizer, tracker.tokens), list(tracker.tokens), True, step)
            elif tracker.push(token):
                tokens = tracker.tokens[:tracker.loop_start]
                replies[row] = Reply(_decode(tokenizer, tokens), tokens, False, step, looped=True)
            elif step == settings.max_new_tokens:
                replies[row] = Reply(_decode(tokenizer, tracker.tokens), list(tracker.tokens), False, step)
            else:
                keep.append(position)
        if not keep:
            break
        if len(keep) < len(rows):  # finished rows leave the batch and the cache
            index = torch.tensor(keep, device=mask.device)
            cache.batch_select_indices(index)
            mask, rows = mask[index], [rows[i] for i in keep]
        tokens = torch.tensor([[trackers[row].tokens[-1]] for row in rows], device=mask.device)
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
        logits = model(input_ids=tokens, attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1,
                       past_key_values=cache, use_cache=True).logits[:, -1]
    return replies


def _decode(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)


@dataclass
class Outcome:
    """What became of one conversation: a record to write, or a skip reason."""

    id: str
    messages: list[Message]
    new_tokens: int  # tokens of the kept replies (with their end-of-turn tokens)
    stopped: str | None  # why fewer turns than asked were answered (None: all answered)
    generated: int = 0  # tokens generated, kept or not

    def line(self) -> dict:
        if not any(m["role"] == "assistant" for m in self.messages):
            return {"id": self.id, "reason": self.stopped}
        return {"id": self.id, "messages": self.messages, "new_tokens": self.new_tokens, "stopped": self.stopped}


def distill_batch(model, tokenizer, prompts: list[Prompt], cfg: DistillConfig, eos_ids: list[int]) -> list[Outcome]:
    """Answer every turn of a batch of conversations, turn by turn, each with its own earlier replies."""
    outcomes = [Outcome(p.id, [], 0, None) for p in prompts]
    active = list(range(len(prompts)))
    for turn in range(max(len(p.segments) for p in prompts)):
        ready = []
        for i in active:
            if turn >= len(prompts[i].segments):
                continue
            context = outcomes[i].messages + prompts[i].segments[turn]
            if turn and render_length(tokenizer, context) > cfg.max_prompt_tokens:
                outcomes[i].stopped = "prompt_too_long"
                continue
            ready.append((i, context))
        if not ready:
            break
        replies = generate_replies(model, tokenizer, [c for _, c in ready], cfg.generation, eos_ids, cfg.filters)
        active = []
        for (i, context), reply in zip(ready, replies):
            outcomes[i].generated += reply.generated
            reason = degenerate_reason(reply.text, reply.tokens, reply.finished, cfg.filters, reply.looped)
            if reason:
                outcomes[i].stopped = reason
                continue
            outcomes[i].new_tokens += len(reply.tokens) + int(reply.finished)
            outcomes[i].messages = context + [{"role": "assistant", "content": reply.text}]
            if reply.looped:  # its text was cut where the loop began: the conversation ends here
                outcomes[i].stopped = "loop_trimmed"
            else:
                active.append(i)
    return outcomes


# ------------------------------------------------------------------------------------ files
class JsonlAppender:
    """An append-only jsonl with one ``id`` per line; a torn last line (from a kill) is dropped on open."""

    def __init__(self, path: Path):
        self.path = path
        self.lines: list[dict] = []
        self.dropped_torn_line = False
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "ab")  # O_APPEND: every write lands at the end

    def lock(self) -> None:
        """Refuse a second process writing the same file (released by the OS even on SIGKILL)."""
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            raise RuntimeError(f"output={self.path}: another distill process is writing it") from err

    def recover(self) -> None:
        """Read the finished lines; truncate a last line that has no newline or is not valid JSON."""
        data = self.path.read_bytes()
        keep = data.rfind(b"\n") + 1
        lines = data[:keep].splitlines()
        if lines:
            try:
                json.loads(lines[-1])
            except json.JSONDecodeError:  # a torn line that happened to end at a newline byte
                keep -= len(lines.pop()) + 1
        if keep < len(data):
            os.truncate(self.path, keep)
            self.dropped_torn_line = True
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"output={self.path}: line {number} is not JSON; not a distill output?") from err
            if not isinstance(record, dict) or "id" not in record:
                raise ValueError(f"output={self.path}: line {number} has no id; not a distill output?")
            self.lines.append(record)

    def append(self, record: dict) -> None:
        self.file.write((json.dumps(record, ensure_ascii=False) + "\n").encode())
        self.file.flush()
        os.fsync(self.file.fileno())
        self.lines.append(record)

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def default_output(cfg: DistillConfig) -> Path:
    """``outputs/distill/<model label>-<num_prompts>.jsonl``."""
    name = str(cfg.model.name_or_path)
    label = name.split(":", 1)[1] if name.startswith("packaged:") else Path(name.rstrip("/")).name
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", label.removesuffix(".gguf")) or "model"
    return Path("outputs/distill") / f"{label}-{cfg.num_prompts or 'all'}.jsonl"


def sidecar(output: Path, suffix: str) -> Path:
    """``X.jsonl`` -> ``X<suffix>`` (``.skipped.jsonl``, ``.stats.json``)."""
    return output.with_name(output.name.removesuffix(".jsonl") + suffix)


def _flat_settings(cfg: DistillConfig) -> dict:
    data = dataclasses.asdict(cfg)
    flat = {}
    for key in RECORD_SETTINGS:
        value = data
        for part in key.split("."):
            value = value[part]
        flat[key] = value
    return flat


def _check_same_settings(stats_path: Path, cfg: DistillConfig) -> None:
    if not stats_path.exists():
        return
    before = json.loads(stats_path.read_text()).get("record_settings", {})
    now = _flat_settings(cfg)
    changed = [f"{k}: {before[k]!r} -> {now[k]!r}" for k in now if k in before and before[k] != now[k]]
    if changed:
        raise ConfigError([f"output={cfg.output}: it was made with other settings ({'; '.join(changed)}); "
                           "delete it or write to another output="])


def _write_json(path: Path, data: dict) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    os.replace(partial, path)


def _check_ids(lines: list[dict], known_ids: dict[int, str], path: Path) -> None:
    for record in lines:
        prefix = str(record["id"]).split("-", 1)[0]
        if not prefix.isdigit():
            raise ValueError(f"output={path}: id {record['id']!r} is not a distill id; not a distill output?")
        index = int(prefix)
        if index in known_ids and known_ids[index] != record["id"]:
            raise ValueError(f"output={path}: record {record['id']} does not match conversation {index} of the "
                             f"source ({known_ids[index]}); it was made from another source. Delete it or set output=")


# ------------------------------------------------------------------------------------ stats
@dataclass
class DistillStats:
    """Counts of a distilled file (all its records, also those of earlier interrupted runs)."""

    output: str
    complete: bool
    source: str
    source_summary: str
    considered: int
    excluded: dict[str, int]  # conversations not selected, by reason (benchmark_prompt, prompt_too_long, ...)
    benchmark_prompts_excluded: int
    selected: int
    records: int  # conversations written
    skipped: dict[str, int]  # conversations with no usable reply, by reason
    replies: int  # assistant turns written
    stopped_early: dict[str, int]  # records with fewer turns than asked, by reason
    new_tokens: int  # tokens of the written replies (the training text)
    resumed_records: int  # records (+ skips) found in the files when this run started
    dropped_torn_line: bool
    run_conversations: int  # conversations generated by this run
    run_new_tokens: int  # tokens generated by this run (kept or not)
    run_seconds: float
    run_cpu_seconds: float  # CPU time of all threads: on a shared machine, seconds / cpu_seconds shows contention
    threads: int  # torch threads
    record_settings: dict

    @property
    def tokens_per_s(self) -> float:
        return self.run_new_tokens / self.run_seconds if self.run_seconds else 0.0

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "tokens_per_s": round(self.tokens_per_s, 2)}

    def summary(self) -> str:
        def reasons(counts: dict) -> str:
            return " (" + ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items())) + ")" if counts else ""

        return (f"{self.records:,} conversations / {self.replies:,} replies in {self.output}; "
                f"skipped {sum(self.skipped.values()):,}{reasons(self.skipped)}; "
                f"excluded {sum(self.excluded.values()):,} of {self.considered:,} read{reasons(self.excluded)}, "
                f"{self.benchmark_prompts_excluded:,} benchmark prompts; "
                f"this run: {self.run_conversations:,} conversations, {self.run_new_tokens:,} tokens "
                f"in {self.run_seconds:.1f} s ({self.tokens_per_s:.1f} tokens/s)")


# ------------------------------------------------------------------------------------ run
def distill(config: DistillConfig | dict, model=None, tokenizer=None) -> DistillStats:
    """Write (or continue) a self-distilled jsonl; returns its stats (also saved to ``<output>.stats.json``).

    Args:
        config: a ``DistillConfig``, or a mapping validated with ``build_distill_config``.
        model: an already loaded backbone (default: load ``config.model``).
        tokenizer: its tokenizer (required with ``model``).

    Returns:
        The counts of the whole output file and the speed of this run.
    """
    from tqdm.auto import tqdm

    if (model is None) != (tokenizer is None):
        raise ValueError("pass both model and tokenizer, or neither (then config.model is loaded)")
    cfg = config if isinstance(config, DistillConfig) else build_distill_config(config)
    cfg.output = str(cfg.output or default_output(cfg))
    output = Path(cfg.output)
    stats_path = sidecar(output, ".stats.json")
    with contextlib.ExitStack() as stack:
        records_file = stack.enter_context(JsonlAppender(output))
        records_file.lock()  # the skipped file and the stats go with it
        skipped_file = stack.enter_context(JsonlAppender(sidecar(output, ".skipped.jsonl")))
        records_file.recover()
        skipped_file.recover()
        if records_file.lines or skipped_file.lines:
            _check_same_settings(stats_path, cfg)
        if model is None:
            model, tokenizer = _load(cfg)
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit and cfg.max_prompt_tokens + cfg.generation.max_new_tokens > limit:
            raise ConfigError([f"max_prompt_tokens + generation.max_new_tokens = "
                               f"{cfg.max_prompt_tokens + cfg.generation.max_new_tokens}: the model reads at most "
                               f"{limit} tokens"])
        benchmark = benchmark_prompt_texts(cfg.exclude_benchmark) if cfg.exclude_benchmark else set()
        selection = select_prompts(cfg, tokenizer, benchmark)
        for appender in (records_file, skipped_file):
            _check_ids(appender.lines, selection.known_ids, appender.path)
        resumed = len(records_file.lines) + len(skipped_file.lines)
        done = {r["id"] for r in records_file.lines} | {r["id"] for r in skipped_file.lines}
        _write_json(stats_path, {"complete": False, "record_settings": _flat_settings(cfg)})

        eos_ids = eos_token_ids(model, tokenizer)
        batches = plan_batches(selection.prompts, done, cfg.batch_size, cfg.sort_window)
        run_tokens, run_conversations = 0, 0
        started, cpu_started = time.perf_counter(), time.process_time()
        bar = tqdm(total=sum(map(len, batches)), desc="distill", unit="conv", disable=not cfg.progress,
                   dynamic_ncols=True)
        for number, batch in enumerate(batches):
            if cfg.generation.temperature > 0:
                torch.manual_seed(cfg.seed * 1_000_003 + number)
            for outcome in distill_batch(model, tokenizer, batch, cfg, eos_ids):
                line = outcome.line()
                (records_file if "messages" in line else skipped_file).append(line)
                run_tokens += outcome.generated
            run_conversations += len(batch)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{run_tokens / (time.perf_counter() - started):.1f}",
                            kept=len(records_file.lines), skipped=len(skipped_file.lines))
        bar.close()
        stats = _stats(cfg, selection, records_file, skipped_file, resumed, run_conversations, run_tokens,
                       time.perf_counter() - started, time.process_time() - cpu_started)
        _write_json(stats_path, stats.to_dict())
        return stats


def _load(cfg: DistillConfig):
    from medusa_train.backbone.load import load_backbone

    m = cfg.model
    model, tokenizer = load_backbone(m.name_or_path, dtype=m.dtype, quantization=m.quantization,
                                     trust_remote_code=m.trust_remote_code, attn_implementation=m.attn_implementation,
                                     bnb_compute_dtype=m.bnb_compute_dtype, bnb_double_quant=m.bnb_double_quant)
    if torch.cuda.is_available() and not m.quantization:
        model.to("cuda")
    return model, tokenizer


def _stats(cfg, selection: Selection, records_file: JsonlAppender, skipped_file: JsonlAppender, resumed: int,
           run_conversations: int, run_tokens: int, seconds: float, cpu_seconds: float) -> DistillStats:
    records = records_file.lines
    return DistillStats(
        output=cfg.output, complete=True, source=cfg.source, source_summary=selection.source_summary,
        considered=selection.considered, excluded=dict(selection.excluded),
        benchmark_prompts_excluded=selection.benchmark_prompts_excluded, selected=len(selection.prompts),
        records=len(records), skipped=dict(Counter(r["reason"] for r in skipped_file.lines)),
        replies=sum(m["role"] == "assistant" for r in records for m in r["messages"]),
        stopped_early=dict(Counter(r["stopped"] for r in records if r.get("stopped"))),
        new_tokens=sum(r.get("new_tokens", 0) for r in records), resumed_records=resumed,
        dropped_torn_line=records_file.dropped_torn_line or skipped_file.dropped_torn_line,
        run_conversations=run_conversations, run_new_tokens=run_tokens, run_seconds=round(seconds, 3),
        run_cpu_seconds=round(cpu_seconds, 3), threads=torch.get_num_threads(),
        record_settings=_flat_settings(cfg))


def report(cfg: DistillConfig) -> DistillStats:
    """Distill and print the summary line (what ``scripts/distill.py`` runs)."""
    stats = distill(cfg)
    print(f"[medusa_train] distilled: {stats.summary()}", flush=True)
    return stats


def main() -> None:
    """Hydra entry point (``scripts/distill.py`` calls this)."""
    from medusa_train.config.evaluate import hydra_entry

    hydra_entry("distill", build_distill_config, report, {})
