"""What a running vLLM accepts and how fast it serves: the same conversations through the engine's chat API.

    medusa-train evaluate draft=<export> engine=vllm      # the report's served section

For each server (the backbone without speculation, with vLLM's n-gram speculation, and with the ``vllm``
export as its Medusa speculator when the heads have one), started one after another and always stopped, or
attached at a URL you give (``served.<row>_url``):

- greedy at concurrency 1: tokens/s, the reply tokens, and the counters read from ``/metrics`` before and
  after: decode steps (``vllm:inter_token_latency_seconds_count``: one per request per decode step,
  drafted or not) and the spec-decode counters. Tokens per step = (completion tokens - replies) / decode
  steps, the same count as our in-process rows (``evaluation.summary``); vLLM's own ``1 + accepted /
  drafts`` is per *drafted* step and is kept beside it, with the share of steps that carried a draft;
- greedy at ``served.concurrency``: the same, without the replies (the CPU build does not promise
  batch-invariant outputs there, so they are not compared);
- sampled at ``served.sampled_temperature`` (request seeds fixed), concurrency 1: the replies are kept so
  that ``evaluation.sampled_check`` can score them under the backbone.

The comparison of outputs happens in ``evaluation.served_report``, which holds the model.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from medusa_train.config.engine import ServedConfig, ServerConfig
from medusa_train.engine import EngineClient, attach, serve
from medusa_train.engine.client import run_concurrently
from medusa_train.model.contract import vllm_speculation

WARMUP_TOKENS = 8
COUNTER_SETTLE_S = 1.0


#: vLLM's suffix decoding with its cache of earlier replies off: each reply drafts from its own prompt and text only
SUFFIX = {"method": "suffix", "suffix_decoding_max_cached_requests": 0}


def free_configs(ngram_tokens: int = 4, suffix: bool = True) -> dict[str, dict]:
    """``{row: --speculative-config}`` of the engine's free baselines, which need no training: ``ngram`` (prompt
    lookup, ``ngram_tokens`` a step) and ``suffix`` (suffix decoding, where ``suffix``: the engine has it)."""
    configs = {"ngram": {"method": "ngram", "num_speculative_tokens": ngram_tokens, "prompt_lookup_max": 4,
                         "prompt_lookup_min": 2}}
    if suffix:
        configs["suffix"] = dict(SUFFIX)
    return configs


def speculative_configs(export_dir: str | Path | None, depth: int, served: ServedConfig,
                        speculation: dict | None = None, suffix: bool = True) -> dict[str, dict | None]:
    """``{row: --speculative-config}``: ``plain`` (none), ``ngram``, ``suffix`` (when ``suffix``: the engine has
    it), ``draft`` (the trained draft's row: the export, served with vLLM's ``method``, its family's; left out when
    ``export_dir`` is ``None`` and no ``served.draft_url`` is given: a draft with no vLLM form still gets the free
    rows)."""
    configs: dict[str, dict | None] = {}
    if served.plain:
        configs["plain"] = None
    free = free_configs(served.ngram_tokens, suffix=served.suffix and suffix)
    if served.ngram:
        configs["ngram"] = free["ngram"]
    if "suffix" in free:
        configs["suffix"] = free["suffix"]
    if export_dir is not None or served.draft_url:
        model = str(Path(export_dir).resolve()) if export_dir is not None else None
        configs["draft"] = {**(speculation or {"method": "medusa"}), "model": model,
                             "num_speculative_tokens": served.num_speculative_tokens or depth}
    return configs


def measure_phase(client: EngineClient, conversations: Sequence[list[dict]], max_tokens: int, eos: Sequence[int],
                  concurrency: int = 1, temperature: float = 0.0, seed: int = 0) -> dict:
    """Send every conversation once: tokens/s over the phase's wall time, and the counters' change.

    Returns:
        ``tokens`` (completion tokens, stop tokens included), ``replies``, ``decode_steps`` (``None`` where the
        server does not expose them), ``tokens_per_step`` ((tokens - replies) / decode steps),
        ``mean_acceptance_length`` and ``per_position_acceptance`` (vLLM's, per drafted step), ``drafts``,
        ``accepted``, ``drafted_share``, ``step_ms`` (the engine's mean decode step, as it clocks them: at
        concurrency 1 what one step of a request costs), ``steps_from_accepted`` (tokens - replies - accepted: a cross-check of
        the decode steps that over-counts accepted tokens a stop cut off), ``tokens_per_s``, the prompts'
        token counts, and at concurrency 1 the replies' tokens (``outputs``, without the stop token).
    """
    before = client.spec_counters()
    jobs = [lambda i=i, c=c: client.chat(c, max_tokens=max_tokens, temperature=temperature, stop_token_ids=eos,
                                         seed=seed + i if temperature > 0 else None)
            for i, c in enumerate(conversations)]
    start = time.perf_counter()
    replies = run_concurrently(jobs, concurrency)
    seconds = time.perf_counter() - start
    time.sleep(COUNTER_SETTLE_S)  # the engine core publishes its counters with its outputs; let the last land
    counters = client.spec_counters() - before
    tokens = sum(r.completion_tokens for r in replies)
    steps = counters.decode_steps
    return {"concurrency": concurrency, "temperature": temperature, "tokens": tokens,
            "replies": len(replies), "seconds": round(seconds, 3), "tokens_per_s": tokens / max(seconds, 1e-9),
            "decode_steps": steps, "tokens_per_step": (tokens - len(replies)) / steps if steps else None,
            "step_ms": None if counters.step_seconds is None else 1e3 * counters.step_seconds,
            "mean_acceptance_length": counters.mean_acceptance_length,
            "per_position_acceptance": counters.per_position_acceptance, "drafts": counters.drafts,
            "accepted": counters.accepted, "drafted_share": counters.drafted_share,
            "draft_positions": len(counters.per_position),
            "steps_from_accepted": tokens - len(replies) - counters.accepted,
            "prompt_tokens": [r.prompt_tokens for r in replies],
            "outputs": [_reply_tokens(r.token_ids, eos) for r in replies] if concurrency == 1 else None}


def measure_server(client: EngineClient, conversations: Sequence[list[dict]], max_tokens: int, eos: Sequence[int],
                   served: ServedConfig, seed: int = 0) -> dict:
    """The phases of one server (see the module docstring), after one untimed warm-up request."""
    client.chat(conversations[0], max_tokens=WARMUP_TOKENS, stop_token_ids=eos)
    time.sleep(COUNTER_SETTLE_S)  # the warm-up's counters land before the first phase reads them
    phases = {"greedy": measure_phase(client, conversations, max_tokens, eos)}
    if served.concurrency > 1:
        phases[f"greedy_c{served.concurrency}"] = measure_phase(client, conversations, max_tokens, eos,
                                                                concurrency=served.concurrency)
    if served.sampled_temperature > 0:
        phases["sampled"] = measure_phase(client, conversations, max_tokens, eos,
                                          temperature=served.sampled_temperature, seed=seed)
    return phases


def serve_and_measure(base_model: str, export_dir: str | Path | None, depth: int,
                      conversations: Sequence[list[dict]], *, dtype: str, max_tokens: int, eos: Sequence[int],
                      served: ServedConfig, server: ServerConfig, log_dir: str | Path, seed: int = 0,
                      chat_template: str | Path | None = None, progress: bool = True,
                      speculation: dict | None = None) -> dict:
    """Measure each row (see ``speculative_configs``): on the server at its ``served.<row>_url``, or on one
    started for it and stopped after.

    Args:
        chat_template: A template file the started servers render prompts with (``--chat-template``; the
            heads' own template); ``None``: the served model's.
        speculation: the export's ``--speculative-config`` but its path and K (``model.contract.vllm_speculation``:
            its family's method and options; None: ``medusa``).

    Returns:
        ``{"servers": {row: {"speculative_config", "attached", "url", "startup_s", "command", "phases":
        {phase: figures}}}, "settings": ...}``.
    """
    results, not_served = {}, {}
    if served.suffix and not served.suffix_url and (why := suffix_problem(server)):
        not_served["suffix"] = why
        if progress:
            print(f"[medusa_train] vLLM suffix: not served: {why}", flush=True)
    for name, spec in speculative_configs(export_dir, depth, served, speculation, "suffix" not in not_served).items():
        url = served.url(name)
        if url:
            client = attach(url, timeout=server.request_timeout)
            if progress:
                print(f"[medusa_train] vLLM {name}: measuring the server at {client.url} (attached: its counters "
                      "include any other traffic it gets)", flush=True)
            phases = measure_server(client, conversations, max_tokens, eos, served, seed)
            results[name] = {"speculative_config": _attached_config(spec, phases), "attached": True,
                             "url": client.url, "startup_s": None, "command": None, "phases": phases}
        else:
            if progress:
                print(f"[medusa_train] vLLM {name}: starting the server ({base_model}, dtype {dtype}) ...", flush=True)
            extra = [*server.args, *(["--chat-template", str(chat_template)] if chat_template else [])]
            with serve(base_model, dtype=dtype, speculative_config=spec, log_path=Path(log_dir) / f"vllm-{name}.log",
                       seed=seed, **{**server.server_kwargs(), "extra_args": extra}) as client:
                client.timeout = server.request_timeout
                phases = measure_server(client, conversations, max_tokens, eos, served, seed)
                results[name] = {"speculative_config": spec, "attached": False, "url": client.url,
                                 "startup_s": round(client.server.startup_seconds, 1),
                                 "command": client.server.command, "phases": phases}
        if progress:
            g = phases["greedy"]
            per_step = f", {g['tokens_per_step']:.3f} tokens per step" if g["tokens_per_step"] else ""
            print(f"[medusa_train] vLLM {name}: {g['tokens_per_s']:.1f} tokens/s at concurrency 1{per_step}",
                  flush=True)
    return {"servers": results, "not_served": not_served, "settings": {"base_model": base_model, "export": str(export_dir) if export_dir else None,
                                             "dtype": dtype, "max_tokens": max_tokens, "stop_token_ids": list(eos),
                                             "chat_template": str(chat_template) if chat_template else None,
                                             **asdict(served)}}


def suffix_problem(server: ServerConfig) -> str | None:
    """Why the engine cannot serve suffix decoding (None: it can): vLLM's ``method: suffix`` imports
    ``arctic_inference.suffix_decoding`` in the engine's environment."""
    import subprocess

    from medusa_train.engine.server import EngineError, find_engine_python

    try:
        python = find_engine_python(server.python)
    except EngineError as err:
        return str(err)
    found = subprocess.run([python, "-c", "import arctic_inference.suffix_decoding"], capture_output=True, text=True)
    if found.returncode == 0:
        return None
    return (f"arctic-inference is not installed in the engine's environment ({python}); `bash scripts/suffix_env.sh` "
            "builds it there against the engine's torch")


def _attached_config(row: dict | None, phases: dict) -> dict | None:
    """An attached server's speculation: the method its row states, K as its counters report it (the draft
    positions; the stated K where it reported none). What it drafts with was not started by us: not checked."""
    read = phases["greedy"]["draft_positions"]
    if row is None:  # the plain row: a server that drafts after all is said so
        return {"method": "unknown (stated: none)", "num_speculative_tokens": read} if read else None
    config = {k: v for k, v in row.items() if k != "model"}
    return {**config, "num_speculative_tokens": read or row["num_speculative_tokens"],
            "num_speculative_tokens_stated": row["num_speculative_tokens"], "read_from_counters": bool(read)}


def _reply_tokens(token_ids: list[int] | None, eos: Sequence[int]) -> list[int] | None:
    """The reply's tokens without the end-of-turn token that stopped it (as our decoders count them)."""
    if token_ids is None:
        return None
    return token_ids[:-1] if token_ids and token_ids[-1] in eos else list(token_ids)


def served_runner(cfg, heads, model, tokenizer, output_dir: str):
    """``served(conversations, servable)`` for ``evaluate`` (``cfg``: its ``EvalConfig``; ``heads``: the
    ``model.load.ExportedDraft`` evaluated): the backbone's folder (``packaged:`` names resolved) served in the
    evaluation's dtype without speculation and with n-gram speculation, and, when the draft is ``servable``, with it in
    its family's served layout (the folder itself when it is in it). Started servers render prompts
    with the template the evaluation renders with (the heads' own when they carry one) unless ``server.args``
    names a ``--chat-template``."""

    from medusa_train.backbone.generation import eos_token_ids
    from medusa_train.backbone.load import resolve_model_path

    base_model = resolve_model_path(cfg.model.name_or_path or heads.base_model)[0]
    eos = eos_token_ids(model.backbone)

    def served(conversations, servable: bool):
        export = None
        if servable and not cfg.served.draft_url:  # an attached draft server has its own
            export = heads.path if heads.served_as_is \
                else model.save_as(Path(output_dir) / "vllm-export", heads.family.served_layout)
        template = None
        if getattr(tokenizer, "chat_template", None) and "--chat-template" not in cfg.server.args:
            template = Path(output_dir) / "chat_template.jinja"
            template.parent.mkdir(parents=True, exist_ok=True)
            template.write_text(tokenizer.chat_template)
        return serve_and_measure(base_model, export, model.config.depth, conversations, dtype=cfg.model.dtype,
                                 max_tokens=cfg.generation.max_new_tokens, eos=eos, served=cfg.served,
                                 server=cfg.server, log_dir=output_dir, seed=cfg.generation.seed,
                                 chat_template=template, progress=cfg.progress, speculation=vllm_speculation(model.config))
    return served
