"""What ``build-tree`` expects of a lookup chain beside the heads, two ways, on its own calibration text.

    python -m benchmarks lookup_walk heads=<export> tree=<a tree YAML from build-tree nodes=auto> dtype=float32

For every size of the tree YAML's timed cost curve and every chain length up to ``max_depth``: the expected tokens
per step as per-position gains add them (``lookup_gains``: each position counted as a step) and as greedy decoding
walks the text step by step (``tokens_per_step``: what the sizing uses), and the walked figure's expected speedup
from the YAML's timed steps (no timing here). Calibration as ``build-tree``'s defaults (``tree.size.calibrate``);
compare the chosen split's figures with what ``evaluate`` measures on the benchmark.

Options (``key=value``): heads, tree (required), dtype (float32), num_prompts (16), max_new_tokens (96),
max_depth (8), threads, output (JSON, default ``outputs/bench/lookup_walk.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from benchmarks.bench_options import bench_options
from medusa_train.cli.build_tree import build_build_tree_config
from medusa_train.model.load import load_exported_draft
from medusa_train.tree.fit import build_tree, expected_accept_length
from medusa_train.tree.size import LookupSplit, calibrate

DEFAULTS = dict(heads=None, tree=None, dtype="float32", num_prompts=16, max_new_tokens=96, max_depth=8, threads=None,
                output="outputs/bench/lookup_walk.json")


def main(**overrides) -> int:
    opts = bench_options(DEFAULTS, overrides)
    if opts is None or not opts["heads"] or not opts["tree"]:
        print(__doc__)
        return 2
    max_depth = int(opts["max_depth"])
    cfg = build_build_tree_config({"heads": opts["heads"], "num_prompts": int(opts["num_prompts"]),
                                   "max_new_tokens": int(opts["max_new_tokens"]), "model": {"dtype": opts["dtype"]},
                                   "lookup_depth": "auto", "lookup_max_depth": max_depth})
    curve = yaml.safe_load(Path(opts["tree"]).read_text()).get("cost_curve")
    if not curve:
        print(f"tree={opts['tree']}: no cost_curve; pass a tree YAML written by build-tree nodes=auto")
        return 2
    model, tokenizer = load_exported_draft(cfg.heads, cfg.model)
    _, sequences, ranks, accuracies, _ = calibrate(cfg, model, tokenizer)
    split = LookupSplit(cfg, accuracies, ranks, sequences)
    rows = []
    print("| nodes | lookup nodes | per-position gains | walked | walked: expected speedup |\n|---:|---:|---:|---:|---:|")
    for nodes, ms in sorted((int(n), v) for n, v in curve["verify_ms_fitted"].items()):
        for depth in range(min(max_depth, nodes - 1) + 1):
            heads_nodes = nodes - depth
            per_position = (expected_accept_length(build_tree(accuracies, heads_nodes), accuracies)
                            + sum(split.gains(heads_nodes)[:depth]))
            walked = split.expected(heads_nodes, depth)
            rows.append({"nodes": nodes, "lookup_nodes": depth, "per_position": round(per_position, 4),
                         "walked": round(walked, 4), "walked_speedup": round(walked * curve["generate_ms"] / ms, 4)})
            print(f"| {nodes} | {depth} | {per_position:.2f} | {walked:.2f} | {rows[-1]['walked_speedup']:.2f}x |")
    alone = split.expected(1, max_depth)  # the root alone as the heads' part: the chain decides every step
    print(f"the lookup chain alone ({max_depth} nodes), walked: {alone:.2f} tokens per step")
    out = Path(opts["output"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"options": opts, "prompts": len(sequences), "rows": rows, "lookup_alone": alone},
                              indent=1))
    print(f"written: {out}")
    return 0
