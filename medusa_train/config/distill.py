"""Configuration of ``medusa-train distill``: self-distilled training data, checked before anything loads.

Hydra composes ``configs/commands/distill.yaml``; ``build_distill_config`` turns it into these
dataclasses and reports every problem at once, each with the key to change. The limit that needs
the loaded model (prompt + reply within its context) is checked by ``data.distill.run.distill``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from medusa_train.config.chat_template import chat_template_problem
from medusa_train.config.check import Problems, data_source_problem, parse_config
from medusa_train.config.engine import ServerConfig, check_server
from medusa_train.config.model import ModelConfig, check_model
from medusa_train.config.validation import ValidationConfig, check_validation

# Settings that change what a record contains: resuming an output made with others is refused.
# The engine too: another engine's numerics give other greedy replies, so a resume never mixes them.
RECORD_SETTINGS = ("model.name_or_path", "model.dtype", "model.quantization", "chat_template", "source", "max_turns",
                   "max_prompt_tokens", "seed", "exclude_benchmark", "generation", "filters", "engine")


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
    #: the chat template prompts are rendered with: a Jinja template's text or a file holding one (null: the
    #: tokenizer's); the one training's data.chat_template will use, so the replies are those it trains on
    chat_template: str | None = None
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
    #: stop starting conversations once the command has run this many minutes, loading the model or starting a
    #: server included (what the user waits for; those in flight finish): the data sized to the machine. What was
    #: written is kept, the stats say how many of the selected prompts were done (``stopped_at_max_minutes``), and
    #: a later run on the same output goes on from there (null: no limit)
    max_minutes: float | None = None
    #: null: generate in-process (Hugging Face, batch_size at a time) | vllm: start a vLLM server on model.name_or_path
    #: for the run | openai: the OpenAI-compatible server(s) at url (data parallelism over several)
    engine: str | None = None
    url: str | list[str] | None = None  #: engine=openai: http://host:port, or a list of them
    concurrency: int = 64  #: engine=vllm|openai: conversations in flight at once, over all servers
    server: ServerConfig = field(default_factory=ServerConfig)  #: engine=vllm: how the server is started
    #: the validation set held out of the distilled data: every conversation holding one of its prompts is passed
    #: over (the set training's data.validation draws: keep size and seed the same; source null: ``source``)
    validation: ValidationConfig = field(default_factory=ValidationConfig)


def build_distill_config(raw: Any) -> DistillConfig:
    """A validated ``DistillConfig`` (see ``config.check.parse_config``)."""
    return parse_config(DistillConfig, raw, check_distill_config)


def check_distill_config(c: DistillConfig) -> list[str]:
    """Range checks; returns every problem found, each naming its key."""
    p = Problems(check_model(c.model))
    p.need(bool(c.source), "source", c.source, "must name a conversation source")
    if problem := data_source_problem("source", c.source):
        p.append(problem)
    p.need(c.num_prompts is None or c.num_prompts >= 1, "num_prompts", c.num_prompts, "must be >= 1 or null (all)")
    p.need(c.max_turns >= 1, "max_turns", c.max_turns, "must be >= 1")
    p.need(c.max_prompt_tokens >= 8, "max_prompt_tokens", c.max_prompt_tokens, "must be >= 8")
    p.need(c.batch_size >= 1, "batch_size", c.batch_size, "must be >= 1")
    p.need(c.sort_window >= 1, "sort_window", c.sort_window, "must be >= 1")
    p.need(c.output is None or bool(c.output), "output", c.output, "must be a path or null")
    p.need(c.engine in (None, "vllm", "openai"), "engine", c.engine, "must be null (in-process), vllm or openai")
    p.need(c.engine != "openai" or bool(c.url), "url", c.url, "engine=openai needs url=http://host:port (or a list)")
    p.need(c.engine == "openai" or not c.url, "url", c.url, "only engine=openai reads url")
    p.need(c.concurrency >= 1, "concurrency", c.concurrency, "must be >= 1")
    p.need(c.max_minutes is None or c.max_minutes > 0, "max_minutes", c.max_minutes, "must be > 0 or null (no limit)")
    if problem := chat_template_problem("chat_template", c.chat_template):
        p.append(problem)
    p.need(c.engine != "openai" or not c.chat_template, "chat_template", c.chat_template,
           "engine=openai renders with the server's own template: start the server with --chat-template, "
           "and leave this null")
    p.need(not c.engine or c.model.quantization is None, "model.quantization", c.model.quantization,
           "the server loads the model itself; quantize it there (server.args) and leave this null")
    p.extend(check_server(c.server))
    p.extend(check_validation(c.validation))
    g, f = c.generation, c.filters
    p.need(g.max_new_tokens >= 1, "generation.max_new_tokens", g.max_new_tokens, "must be >= 1")
    p.need(g.temperature >= 0, "generation.temperature", g.temperature, "must be >= 0 (0 = greedy)")
    p.need(0 < g.top_p <= 1, "generation.top_p", g.top_p, "must be in (0, 1]")
    p.need(f.repetition_ngram >= 1, "filters.repetition_ngram", f.repetition_ngram, "must be >= 1")
    p.need(f.loop_window is None or f.loop_window >= 1, "filters.loop_window", f.loop_window,
           "must be >= 1 or null (off)")
    p.need(f.max_repeated_fraction is None or 0 < f.max_repeated_fraction <= 1, "filters.max_repeated_fraction",
           f.max_repeated_fraction, "must be in (0, 1] or null (off)")
    return p


def record_settings(cfg: DistillConfig) -> dict:
    """The ``RECORD_SETTINGS`` of ``cfg``, by dotted key (saved beside the output, compared on resume)."""
    data = dataclasses.asdict(cfg)
    flat = {}
    for key in RECORD_SETTINGS:
        value = data
        for part in key.split("."):
            value = value[part]
        flat[key] = value
    return flat
