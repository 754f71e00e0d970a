"""Tokenised once: the packaged ShareGPT (or any source) tokenised into the on-disk cache, then read back.

    python -m benchmarks tokenize                       # ~17.5k conversations at 2048 tokens
    python -m benchmarks tokenize max_length=512 num_proc=1

Three fresh processes, each timed and its peak memory (RSS of the process and of its tokenising workers)
taken: the first run (reads, splits, tokenises with ``datasets.map``, writes Arrow), the same call again
(reads the cache), and the in-memory path the cache replaced (``build_datasets``: Python lists).

Options (``key=value``): data (packaged:sharegpt-v3), model (the packaged model), max_length (2048),
max_samples (null: all), eval_size (64), num_proc (null: the CPUs, at most 8), output (JSON, default
``outputs/bench/tokenize.json``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_options import bench_options

DEFAULTS = dict(data="packaged:sharegpt-v3", model="packaged:smollm2-135m-instruct", max_length=2048,
                max_samples=None, eval_size=64, num_proc=None, output=None)

CHILD = """
import json, resource, sys, time
from medusa_train.backbone import load_tokenizer
opts = json.loads(sys.argv[1])
tokenizer = load_tokenizer(opts["model"])
start = time.perf_counter()
if opts["mode"] == "memory":
    from medusa_train.data import build_datasets
    train, evals, stats = build_datasets(tokenizer, opts["data"], opts["max_length"], opts["max_samples"],
                                         opts["eval_size"], 0)
    result = {"train": len(train), "eval": len(evals), "tokens": sum(len(e["input_ids"]) for e in train)}
else:
    from medusa_train.data.cache import tokenized_splits
    data = tokenized_splits(tokenizer, opts["data"], opts["max_length"], opts["max_samples"], opts["eval_size"], 0,
                            opts["num_proc"], opts["cache_root"])
    stats = data.stats
    result = {"train": len(data.train), "eval": len(data.evals), "tokens": sum(data.train["length"]),
              "from_cache": data.from_cache,
              "arrow_bytes": sum(f.stat().st_size for f in data.folder.rglob("*.arrow"))}
result["seconds"] = round(time.perf_counter() - start, 2)
peak_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
peak_children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
result.update(peak_rss_mib=round(peak_self), peak_worker_rss_mib=round(peak_children), kept=stats.kept,
              skipped=dict(stats.skipped), truncated=stats.truncated)
print(json.dumps(result))
"""


def _child(opts: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(opts)], capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(**overrides) -> int:
    opts = bench_options(DEFAULTS, overrides)
    if opts is None:
        return 2
    opts["max_length"], opts["eval_size"] = int(opts["max_length"]), int(opts["eval_size"])
    opts["max_samples"] = None if opts["max_samples"] in (None, "null") else int(opts["max_samples"])
    opts["num_proc"] = None if opts["num_proc"] in (None, "null") else int(opts["num_proc"])
    with tempfile.TemporaryDirectory() as root:
        runs = {}
        for name, mode in (("first", "cache"), ("cached", "cache"), ("in_memory", "memory")):
            runs[name] = _child({**opts, "mode": mode, "cache_root": root})
            print(f"{name:10s} {json.dumps(runs[name])}", flush=True)
    output = Path(opts["output"] or "outputs/bench/tokenize.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"options": opts, "runs": runs}, indent=2) + "\n")
    print(f"first {runs['first']['seconds']} s, cached {runs['cached']['seconds']} s "
          f"({runs['first']['seconds'] / max(runs['cached']['seconds'], 1e-9):.0f}x); written to {output}")
    return 0
