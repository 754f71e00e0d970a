"""Choose vLLM's ``num_speculative_tokens`` (K) by measuring it: one server per K, the same prompts each time.

    python -m benchmarks vllm_k heads=outputs/demo-plain/train-XXXX/export dtype=bfloat16

vLLM fixes K at start-up and fails to load K above the head count, so each K in 1..heads (and the
server without speculation, K=0) is started in turn, sent MT-Bench first turns greedily at
concurrency 1 and at ``concurrency``, and stopped. The fastest K at concurrency 1 is recommended and
written to ``serving.json`` in the vllm export (what ``scripts/export.py`` reads for the serve line it
prints); the table goes to stdout and ``output`` (JSON).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

DEFAULTS = {"heads": None, "model": None, "dtype": "bfloat16", "limit": 24, "max_tokens": 128, "concurrency": 8,
            "python": None, "output": None, "ks": None, "threads": None}


def main(**overrides) -> int:
    from benchmarks.bench_options import bench_options

    opts = bench_options(DEFAULTS, overrides)
    if opts is None or not opts["heads"]:
        print("pass heads=<heads folder> (any layout; a vllm export is written when it is not one)")
        return 2
    from medusa_train.backbone.load import load_without_weights
    from medusa_train.cli.export import serve_command
    from medusa_train.data.benchmarks import load_benchmark
    from medusa_train.engine import serve
    from medusa_train.evaluation.served import measure_phase
    from medusa_train.export.write import export_folder
    from medusa_train.model.layouts import detect_format

    heads = Path(opts["heads"]).expanduser()
    raw = json.loads((heads / "config.json").read_text())
    export = heads
    if detect_format(raw) != "vllm":
        export = heads.parent / f"vllm-export-{opts['dtype']}"
        export_folder(heads, export, "vllm", model=opts["model"], dtype=opts["dtype"])
        raw = json.loads((export / "config.json").read_text())
    base = opts["model"] or raw.get("base_model_name_or_path")
    _, eos, _, folder = load_without_weights(base)
    conversations = [[{"role": "user", "content": p.turns[0]}] for p in load_benchmark("packaged:mt-bench",
                                                                                       int(opts["limit"]))]
    ks = [int(k) for k in str(opts["ks"]).split(",")] if opts["ks"] else list(range(0, raw["num_heads"] + 1))
    concurrency, max_tokens = int(opts["concurrency"]), int(opts["max_tokens"])
    rows = []
    for k in ks:
        spec = {"method": "medusa", "model": str(export.resolve()), "num_speculative_tokens": k} if k else None
        started = time.perf_counter()
        with serve(folder, dtype=opts["dtype"], speculative_config=spec, python=opts["python"],
                   log_path=export.parent / f"vllm-k{k}.log") as client:
            startup = time.perf_counter() - started
            client.chat(conversations[0], max_tokens=8, stop_token_ids=eos)  # warm-up
            one = measure_phase(client, conversations, max_tokens, eos)
            many = measure_phase(client, conversations, max_tokens, eos, concurrency=concurrency)
        rows.append({"k": k, "startup_s": round(startup, 1), "tokens_per_s": one["tokens_per_s"],
                     f"tokens_per_s_c{concurrency}": many["tokens_per_s"],
                     "mean_acceptance_length": one["mean_acceptance_length"],
                     "per_position_acceptance": one["per_position_acceptance"], "tokens": one["tokens"]})
        print(_row(rows[-1], rows[0], concurrency), flush=True)
    plain = next((r for r in rows if r["k"] == 0), None)
    best = max((r for r in rows if r["k"]), key=lambda r: r["tokens_per_s"])
    faster = plain is None or best["tokens_per_s"] > plain["tokens_per_s"]
    result = {"recommended_num_speculative_tokens": best["k"] if faster else None,
              "fastest_num_speculative_tokens": best["k"], "rows": rows,
              "settings": {k: opts[k] for k in ("dtype", "limit", "max_tokens", "concurrency")},
              "base_model": base, "export": str(export), "device": _device()}
    (export / "serving.json").write_text(json.dumps(result, indent=2) + "\n")
    if opts["output"]:
        Path(opts["output"]).write_text(json.dumps(result, indent=2) + "\n")
    if faster:
        print(f"fastest at concurrency 1: K={best['k']} ({best['tokens_per_s']:.1f} tokens/s"
              + (f", {best['tokens_per_s'] / plain['tokens_per_s']:.2f}x without speculation)" if plain else ")"))
    else:
        print(f"no K beats serving without speculation here (best K={best['k']}: "
              f"{best['tokens_per_s'] / plain['tokens_per_s']:.2f}x); serve the base model alone")
    print(serve_command(export))
    return 0


def _row(row: dict, first: dict, concurrency: int) -> str:
    accepted = f"{row['mean_acceptance_length']:.3f}" if row["mean_acceptance_length"] else "-"
    return (f"K={row['k']}: {row['tokens_per_s']:.1f} tokens/s at concurrency 1, "
            f"{row[f'tokens_per_s_c{concurrency}']:.1f} at {concurrency}; acceptance length {accepted}; "
            f"start-up {row['startup_s']:.0f} s")


def _device() -> str:
    import os
    import platform

    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
