"""What a running vLLM accepts and how fast it serves: the same conversations through the engine's chat API.

    python scripts/evaluate.py heads=<export> engine=vllm      # the report's engines.vllm.served

For each server (the backbone without speculation, with the ``vllm`` export as its Medusa speculator,
and with vLLM's n-gram speculation), started one after another and always stopped:

- greedy at concurrency 1: tokens/s, the reply tokens, and the spec-decode counters read from
  ``/metrics`` before and after (they count from the server's start): mean acceptance length
  (1 + accepted / drafts) and the acceptance at each draft position;
- greedy at ``served.concurrency``: the same, without the replies (the CPU build does not promise
  batch-invariant outputs there, so they are not compared);
- sampled at ``served.sampled_temperature`` (request seeds fixed), concurrency 1: acceptance and speed.

The comparison of greedy outputs with the server without speculation happens in ``evaluate``, which
holds the model that classifies a difference (at rounding, or unexplained).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from medusa_train.config.engine import ServedConfig, ServerConfig
from medusa_train.engine import EngineClient, serve
from medusa_train.engine.client import run_concurrently
from medusa_train.evaluation.compare import compare_outputs

WARMUP_TOKENS = 8
COUNTER_SETTLE_S = 1.0


def speculative_configs(export_dir: str | Path, num_heads: int, served: ServedConfig) -> dict[str, dict | None]:
    """``{server name: --speculative-config}``: ``plain`` (none), ``medusa`` (the export), ``ngram``."""
    configs: dict[str, dict | None] = {}
    if served.plain:
        configs["plain"] = None
    configs["medusa"] = {"method": "medusa", "model": str(Path(export_dir).resolve()),
                         "num_speculative_tokens": served.num_speculative_tokens or num_heads}
    if served.ngram:
        configs["ngram"] = {"method": "ngram", "num_speculative_tokens": served.ngram_tokens,
                            "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    return configs


def measure_phase(client: EngineClient, conversations: Sequence[list[dict]], max_tokens: int, eos: Sequence[int],
                  concurrency: int = 1, temperature: float = 0.0, seed: int = 0) -> dict:
    """Send every conversation once; tokens/s over the phase's wall time and the spec-decode counters' change."""
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
    return {"concurrency": concurrency, "temperature": temperature, "requests": len(replies), "tokens": tokens,
            "seconds": round(seconds, 3), "tokens_per_s": tokens / max(seconds, 1e-9),
            "mean_acceptance_length": counters.mean_acceptance_length,
            "per_position_acceptance": counters.per_position_acceptance, "drafts": counters.drafts,
            "prompt_tokens": [r.prompt_tokens for r in replies],
            "outputs": [_reply_tokens(r.token_ids, eos) for r in replies]  # compared: greedy, one at a time
            if temperature == 0 and concurrency == 1 else None}


def measure_server(client: EngineClient, conversations: Sequence[list[dict]], max_tokens: int, eos: Sequence[int],
                   served: ServedConfig, seed: int = 0) -> dict:
    """The phases of one server (see the module docstring), after one untimed warm-up request."""
    client.chat(conversations[0], max_tokens=WARMUP_TOKENS, stop_token_ids=eos)
    phases = {"greedy": measure_phase(client, conversations, max_tokens, eos)}
    if served.concurrency > 1:
        phases[f"greedy_c{served.concurrency}"] = measure_phase(client, conversations, max_tokens, eos,
                                                                concurrency=served.concurrency)
    if served.sampled_temperature > 0:
        phases["sampled"] = measure_phase(client, conversations, max_tokens, eos,
                                          temperature=served.sampled_temperature, seed=seed)
    return phases


def serve_and_measure(base_model: str, export_dir: str | Path, num_heads: int, conversations: Sequence[list[dict]],
                      *, dtype: str, max_tokens: int, eos: Sequence[int], served: ServedConfig, server: ServerConfig,
                      log_dir: str | Path, seed: int = 0, progress: bool = True) -> dict:
    """Start each server in turn (see ``speculative_configs``), measure it, stop it.

    Returns:
        ``{"servers": {name: {"speculative_config", "startup_s", "command", "phases": {phase: figures}}},
        "settings": ...}``.
    """
    results = {}
    for name, spec in speculative_configs(export_dir, num_heads, served).items():
        if progress:
            print(f"[medusa_train] vLLM {name}: starting the server ({base_model}, dtype {dtype}) ...", flush=True)
        with serve(base_model, dtype=dtype, speculative_config=spec, log_path=Path(log_dir) / f"vllm-{name}.log",
                   seed=seed, **server.server_kwargs()) as client:
            client.timeout = server.request_timeout
            phases = measure_server(client, conversations, max_tokens, eos, served, seed)
            results[name] = {"speculative_config": spec, "startup_s": round(client.server.startup_seconds, 1),
                             "command": client.server.command, "phases": phases}
        if progress:
            g = phases["greedy"]
            accepted = f", acceptance length {g['mean_acceptance_length']:.3f}" if g["mean_acceptance_length"] else ""
            print(f"[medusa_train] vLLM {name}: {g['tokens_per_s']:.1f} tokens/s at concurrency 1{accepted}",
                  flush=True)
    return {"servers": results, "settings": {"base_model": base_model, "export": str(export_dir), "dtype": dtype,
                                             "max_tokens": max_tokens, "stop_token_ids": list(eos),
                                             **asdict(served)}}


def _reply_tokens(token_ids: list[int] | None, eos: Sequence[int]) -> list[int] | None:
    """The reply's tokens without the end-of-turn token that stopped it (as our decoders count them)."""
    if token_ids is None:
        return None
    return token_ids[:-1] if token_ids and token_ids[-1] in eos else list(token_ids)


def summarise_served(raw: dict, name: str, classify=None) -> dict:
    """One server's figures for the report, its greedy outputs compared with the server without speculation.

    Args:
        raw: ``serve_and_measure``'s result.
        name: The server (``medusa`` | ``ngram``).
        classify: ``classify(i, plain, speculated, position) -> {"kind": "at_rounding" | "unexplained", ...}``
            for the i-th conversation's first differing token (``None``: differences are not classified).
    """
    servers = raw["servers"]
    phases, plain = servers[name]["phases"], (servers.get("plain") or {}).get("phases")
    greedy = phases["greedy"]
    out = {"mean_acceptance_length": greedy["mean_acceptance_length"],
           "per_position_acceptance": greedy["per_position_acceptance"], "drafts": greedy["drafts"],
           "speculative_config": servers[name]["speculative_config"], "startup_s": servers[name]["startup_s"],
           "tokens_per_s": {"speculative": greedy["tokens_per_s"]}, "phases": {}}
    for phase, figures in phases.items():
        if phase == "greedy":
            continue
        row = {k: figures[k] for k in ("concurrency", "temperature", "tokens_per_s", "mean_acceptance_length",
                                       "per_position_acceptance")}
        if plain and phase in plain:
            row["plain_tokens_per_s"] = plain[phase]["tokens_per_s"]
            row["speedup"] = figures["tokens_per_s"] / max(plain[phase]["tokens_per_s"], 1e-9)
        out["phases"][phase] = row
    if plain:
        out["tokens_per_s"]["plain"] = plain["greedy"]["tokens_per_s"]
        out["speedup"] = greedy["tokens_per_s"] / max(plain["greedy"]["tokens_per_s"], 1e-9)
        out["outputs"] = compare_outputs(plain["greedy"]["outputs"], greedy["outputs"], classify)
    return out
