"""The report's ``served`` section: each vLLM server's figures, its outputs checked, beside the free rows.

Every row counts tokens per step the same way (``evaluation.served``: tokens after each reply's first per
decode step, what our in-process rows count too); vLLM's own acceptance length is kept beside it, labelled
per *drafted* step. Each row's speedup divides by the server without speculation (``plain``) on the same
prompts. Greedy replies are compared with that server's; sampled replies are scored under the backbone
(``evaluation.sampled_check``), and a sampled phase found incorrect shows no speedup.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from medusa_train.evaluation.compare import brief, compare_outputs, mismatch_detail
from medusa_train.evaluation.engines import vllm_reason
from medusa_train.evaluation.sampled_check import against_plain, describe, score_replies

ROWS = {"plain": "vLLM without speculation", "ngram": "vLLM n-gram speculation (prompt lookup; no training)",
        "suffix": "vLLM suffix decoding (its prompt and reply so far; no training, no cache of other replies)"}
#: the trained draft's row (``draft``), by the method vLLM serves it with and what the draft is
DRAFT_ROW = "vLLM speculation with {draft} (method {method}: a top-1 chain of K steps)"
FREE_ROWS = ("plain", "ngram", "suffix")


def add_served(report: dict, raw: dict, model, inputs: list[torch.Tensor], stop_ids: Sequence[int] = ()) -> None:
    """Put ``serve_and_measure``'s result in ``report["served"]`` (see the module docstring); ``stop_ids``: the end
    tokens a reply that ended where another goes on chose (the servers' replies come without them)."""
    servers = raw["servers"]
    plain = servers.get("plain")
    rows = {}
    threshold = raw["settings"]["sampled_check_threshold"]
    for name in sorted(servers, key=lambda n: n != "plain"):  # the plain row first: the others' reference
        plain_check = ((rows.get("plain") or {}).get("phases", {}).get("sampled") or {}).get("check")
        rows[name] = served_row(name, servers[name], plain, model, inputs, threshold, plain_check, stop_ids)
    rows = {name: rows[name] for name in servers}
    engines = report.get("engines") or {}
    if "draft" in rows and engines.get("vllm"):
        rows["draft"]["simulated_tokens_per_step"] = engines["vllm"]["mean_accepted_length"]
    report["served"] = {
        "rows": rows, "settings": raw["settings"],
        "draft_not_served": None if "draft" in servers else vllm_reason(model.config)
        or "no draft server was started or attached",
        "attached": [name for name, s in servers.items() if s.get("attached")],
        "not_served": raw.get("not_served") or {},  # a free row the engine cannot serve here, and why
        "tokens_per_step": "(completion tokens - replies) / decode steps (vllm:inter_token_latency_seconds_count)",
        "vllm_acceptance_length": "1 + accepted / drafts: per drafted step (vLLM counts only steps with a draft)",
    }


def served_row(name: str, server: dict, plain: dict | None, model, inputs: list[torch.Tensor],
               threshold: float, plain_check: dict | None = None, stop_ids: Sequence[int] = ()) -> dict:
    """One server's row: its greedy phase's figures, the other phases', its outputs compared and checked (the
    sampled replies also against ``plain_check``, the plain server's sampled check, when given)."""
    phases = server["phases"]
    greedy = phases["greedy"]
    counted = greedy["prompt_tokens"]
    alike = [n == ids.shape[1] for n, ids in zip(counted, inputs)]
    method = (server["speculative_config"] or {}).get("method")
    label = DRAFT_ROW.format(draft=model.config.draft_name, method=method) if name == "draft" else ROWS.get(name, name)
    row = {"decodes_with": label, "speculative_config": server["speculative_config"],
           "attached": server.get("attached", False), "url": server.get("url"), "startup_s": server["startup_s"],
           **_figures(greedy), "prompts_tokenised_alike": sum(alike), "phases": {}}
    if plain is not None:
        row["speedup"] = greedy["tokens_per_s"] / max(plain["phases"]["greedy"]["tokens_per_s"], 1e-9)
        if name != "plain":
            def classify(i, a, b, position):
                if not alike[i]:  # the engine's prompt is not ours: no base-model view of the difference
                    return {"kind": "prompt_differs"}
                return brief(mismatch_detail(model, inputs[i], a, b, position, stop_ids))

            row["outputs"] = compare_outputs(plain["phases"]["greedy"]["outputs"], greedy["outputs"], classify)
    for phase, figures in phases.items():
        if phase == "greedy":
            continue
        entry = {"concurrency": figures["concurrency"], "temperature": figures["temperature"], **_figures(figures)}
        if figures["temperature"] > 0 and figures.get("outputs") is not None:
            kept = [reply if ok else None for reply, ok in zip(figures["outputs"], alike)]
            check = score_replies(model, inputs, kept, figures["temperature"], threshold)
            if plain_check is not None:
                check.update(against_plain(check, plain_check))
                check["flagged"] = check["flagged"] or check["flagged_against_plain"]
            entry["check"] = {**check, "summary": describe(check)}
        if plain is not None and phase in plain["phases"]:
            base = plain["phases"][phase]["tokens_per_s"]
            entry["plain_tokens_per_s"] = base
            correct = not (entry.get("check") or {}).get("flagged")
            entry["speedup"] = figures["tokens_per_s"] / max(base, 1e-9) if correct else None
        row["phases"][phase] = entry
    return row


def _figures(phase: dict) -> dict:
    """A phase's counted figures (tokens per step first: the definition every row shares)."""
    return {k: phase.get(k) for k in ("tokens_per_step", "decode_steps", "tokens", "replies", "tokens_per_s",
                                      "mean_acceptance_length", "per_position_acceptance", "drafts", "accepted",
                                      "drafted_share", "steps_from_accepted", "step_ms", "seconds")}


def best_free(rows: dict, key: str = "tokens_per_s") -> tuple[str, dict] | None:
    """The fastest free row (no speculation or n-gram) whose greedy outputs nothing contradicts."""
    free = [(n, r) for n, r in rows.items() if n in FREE_ROWS and not ((r.get("outputs") or {}).get("unexplained"))]
    return max(free, key=lambda item: item[1][key]) if free else None


def print_served(report: dict) -> None:
    """The served lines of the summary (nothing when no engine was run)."""
    for name, row in ((report.get("served") or {}).get("rows") or {}).items():
        simulated = row.get("simulated_tokens_per_step")
        parts = [f"{row['tokens_per_s']:.1f} tokens/s"]
        if row.get("speedup") is not None:
            parts.append(f"{row['speedup']:.2f}x over no speculation")
        if row["tokens_per_step"] is not None:
            parts.append(f"{row['tokens_per_step']:.3f} tokens per step"
                         + (f" (simulated {simulated:.3f})" if simulated is not None else ""))
        if row["mean_acceptance_length"] is not None:
            share = f", {row['drafted_share']:.0%} of steps drafted" if row.get("drafted_share") is not None else ""
            parts.append(f"vLLM's acceptance length {row['mean_acceptance_length']:.3f} per drafted step{share}")
        if row.get("outputs"):
            o = row["outputs"]
            parts.append(f"greedy outputs identical {o['identical']}/{o['compared']} ({o['unexplained']} unexplained)")
        for phase in row["phases"].values():
            if phase.get("check"):
                parts.append(f"T={phase['temperature']}: {phase['check']['summary']}")
        print(f"served {name}{' (attached)' if row['attached'] else ''}: " + "; ".join(parts))
    for name, why in ((report.get("served") or {}).get("not_served") or {}).items():
        print(f"served {name}: not served: {why}")
