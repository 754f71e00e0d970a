"""Fitting a tree to measured heads and sizing it for this machine (``medusa-train build-tree``).

``fit_and_write``: calibrate the heads (``tree/calibrate.py``), fit the tree (``tree/fit.py``), size it
(``nodes=auto``: ``choose_size`` times the steps, ``tree/cost.py``) and write the tree YAML. The command
(config checks, loading the heads) is ``medusa_train.cli.build_tree``.
"""

from __future__ import annotations

from pathlib import Path

from medusa_train.backbone.generation import encode_chat
from medusa_train.config.build_tree import BuildTreeConfig
from medusa_train.config.paths import heads_name
from medusa_train.data.benchmarks import load_benchmark, normalise_prompt
from medusa_train.data.validation import continuations, validation_prompts
from medusa_train.decoding.tree import TokenTree
from medusa_train.tree.calibrate import (
    VALIDATION,
    calibration_prompts,
    greedy_continuations,
    heads_depths,
    heads_validation,
    lookup_gains,
    lookup_runs,
    measure_ranks,
    rank_accuracies_from,
    tokens_per_step,
    training_prompts,
    write_tree,
)
from medusa_train.tree.cost import auto_sizes, choose_tree_size, measure_cost_curve
from medusa_train.tree.fit import build_tree


def calibrate(cfg: BuildTreeConfig, model, tokenizer) -> tuple[list[str], list, list, list[list[float]], list[int]]:
    """The calibration ``fit_and_write`` fits to: greedy continuations of ``cfg``'s calibration prompts (by default
    the heads' validation set, held out of their training; otherwise the source's prompts, the heads' training
    prompts passed over when ``exclude_training_data``) and the heads' ranks on them.

    Returns ``(prompts, sequences, ranks, rank accuracies, positions per head)``."""
    from medusa_train.training.run_folder import read_training_config

    if cfg.exclude_training_data and read_training_config(cfg.draft) is None:
        print(f"note: {cfg.draft} carries no training_config.json (the record of the run that trained it), so its "
              "training prompts are unknown and cannot be left out of calibration: if they are among the calibration "
              "prompts, the expected figures come out high. Converted with medusa-train export, a draft keeps it.")
    if cfg.calibration == VALIDATION:
        source, v, predates = heads_validation(cfg.draft)
        prompts = validation_prompts(source, v.size or 64, v.seed)
        if predates and cfg.exclude_training_data:
            seen = training_prompts(cfg.draft)
            prompts = [p for p in prompts if normalise_prompt(p) not in seen]
        texts = continuations(model.backbone, tokenizer, prompts, cfg.max_new_tokens, cfg.max_prompt_tokens)
        prompts, sequences = texts.prompts[:cfg.num_prompts], texts.sequences[:cfg.num_prompts]
        print(f"calibration: {len(sequences)} validation prompts of {source}"
              + (" (the heads' training predates validation sets: their training prompts passed over)" if predates
                 else " (held out of the heads' training)") + f"; continuations: {texts.summary()}")
    else:
        seen = training_prompts(cfg.draft) if cfg.exclude_training_data else set()
        prompts = calibration_prompts(cfg.calibration, tokenizer, cfg.num_prompts or 16, cfg.max_prompt_tokens,
                                      cfg.exclude, seen)
        if seen:
            print(f"calibration: {len(prompts)} prompts of {cfg.calibration} the heads were not trained on "
                  f"({len(seen):,} training prompts passed over)")
        sequences = greedy_continuations(model, tokenizer, prompts, cfg.max_new_tokens, progress=True)
    if not prompts:
        raise SystemExit(f"calibration={cfg.calibration}: no usable prompts (all too long, empty, excluded or "
                         "in the heads' training data); pass calibration=<a .jsonl of held-out prompts>")
    ranks = measure_ranks(model, sequences, cfg.top_k)
    accuracies, counts = rank_accuracies_from(ranks, model.config.depth, cfg.top_k)
    return prompts, sequences, ranks, accuracies, counts


def tree_output(cfg: BuildTreeConfig) -> str:
    """Where the tree goes: ``output``, by default ``outputs/trees/<heads name>-n<nodes>.yaml``."""
    return cfg.output or str(Path("outputs") / "trees" / f"{heads_name(cfg.draft)}-n{cfg.nodes}.yaml")


def fit_and_write(cfg: BuildTreeConfig, model, tokenizer) -> dict:
    """Measure ``model``'s heads, build and write the tree; print where it went and (last) the expected
    accepted length."""
    prompts, sequences, ranks, accuracies, counts = calibrate(cfg, model, tokenizer)
    split = LookupSplit(cfg, accuracies, ranks, sequences)
    output = tree_output(cfg)
    command = (f"medusa-train build-tree draft={cfg.draft} nodes={cfg.nodes} calibration={cfg.calibration} "
               f"num_prompts={cfg.num_prompts} max_new_tokens={cfg.max_new_tokens} top_k={cfg.top_k} "
               f"model.dtype={cfg.model.dtype}"
               + (f" cost_context={cfg.cost_context} answer_tokens={cfg.answer_tokens}" if cfg.nodes == "auto" else "")
               + f" lookup_depth={cfg.lookup_depth} lookup_ngram=[{cfg.lookup_ngram[0]},{cfg.lookup_ngram[1]}]"
               + (f" lookup_max_depth={cfg.lookup_max_depth}" if cfg.lookup_depth == "auto" else ""))
    target, extra = (choose_size(model, accuracies, cfg, cost_context(cfg, tokenizer, prompts), split)
                     if cfg.nodes == "auto" else (cfg.nodes, None))
    split_expected, depth = split.best(target)
    heads_nodes = target - depth
    guard = None
    if cfg.lookup_depth == "auto" and depth and heads_nodes > 1 and cfg.guard_prompts:
        guard = run_guard(cfg, model, sequences, accuracies, heads_nodes, depth, split)
        heads_nodes, depth = guard.pop("heads_nodes"), guard.pop("lookup_nodes")
        split_expected = split.expected(heads_nodes, depth)
    nodes = len(build_tree(accuracies, heads_nodes)) + 1
    gains = split.gains(heads_nodes)[:depth]
    lookup = {"lookup_depth": depth, "lookup_ngram": list(cfg.lookup_ngram),
              "lookup_gains": [round(g, 4) for g in gains]} if depth else {}
    comments = [command, f"use: medusa-train evaluate draft={cfg.draft} tree={output}",
                f"{nodes} nodes (root + paths), most likely path first, fitted to rank accuracies measured on "
                f"{len(sequences)} greedy continuations ({counts[0]} positions for head 1)"
                + (f"; then a lookup chain of {depth} nodes (lookup_gains: per chain node, the share of "
                   "positions of the same text where it is right and the heads' tree falls short; tokens per step "
                   "walked step by step over that text)." if depth else ".")]
    expected = split_expected
    path, choices = write_tree(output, accuracies, heads_nodes, expected, comments,
                               {**lookup, **({"guard": guard} if guard else {}), **(extra or {})})
    default = TokenTree.from_name("default").truncated(max_nodes=target, max_depth=len(accuracies))
    default_expected = tokens_per_step(heads_depths(ranks, [c for c in default.choices if max(c) < cfg.top_k]))
    print("top-1 accuracy by head: " + ", ".join(f"{row[0]:.3f}" for row in accuracies))
    print(f"top-{cfg.top_k} accuracy by head: " + ", ".join(f"{sum(row):.3f}" for row in accuracies))
    print(f"tree: {path} ({len(choices) + 1 + depth} nodes"
          + (f": {len(choices) + 1} for the root and heads, {depth} for lookup)" if depth else ")"))
    if cfg.lookup_depth == "auto" and split.runs is not None:
        shares = ", ".join(f"{g:.3f}" for g in split.gains(heads_nodes)) or "none"
        print(f"lookup: {depth} of the {target} nodes go to the lookup chain (share of positions where each lookup "
              f"node is right and the heads' nodes fall short: {shares})")
    if len(choices) + 1 < heads_nodes:  # the heads' share of the nodes (the rest went to lookup)
        print(f"note: only {len(choices)} paths have a measured accuracy above 0 (asked for {heads_nodes - 1}); "
              "calibrate on more prompts for a bigger tree")
    print(f"the built-in default tree cut to {default.num_nodes} nodes, under these accuracies: "
          f"{default_expected:.2f} tokens per step")
    if extra:
        at64 = extra["sizes"].get("64")
        print(f"chosen size: {extra['chosen_nodes']} nodes on {extra['device']}, {extra['dtype']}: expected speedup "
              f"{extra['expected_speedup']:.2f}x over generate"
              + (f" (the 64-node tree: {at64['expected_accept_length']:.2f} tokens per step)" if at64 else ""))
    if guard:
        print(f"guard: kept {guard['kept']} ({guard['why']})")
    print(f"expected accepted length: {expected:.3f} tokens per step (walked over the calibration text)")
    return {"path": str(path), "choices": choices, "rank_accuracies": accuracies, "positions": counts,
            "expected_accept_length": expected, "lookup_depth": depth, **({"auto": extra} if extra else {}),
            **({"guard": guard} if guard else {})}


def run_guard(cfg: BuildTreeConfig, model, sequences, accuracies, heads_nodes: int, depth: int,
              split: LookupSplit) -> dict:
    """Decode ``cfg.guard_prompts`` calibration prompts with the hybrid (``heads_nodes`` heads' nodes and a ``depth``
    chain), the draft alone (all its nodes the draft's) and the lookup chain alone (the root and the chain) and keep the one
    ``guard.choose`` keeps. Returns what the tree YAML records, with the kept split (``heads_nodes``,
    ``lookup_nodes``)."""
    from medusa_train.backbone.generation import eos_token_ids
    from medusa_train.tree.guard import DRAFT, HYBRID, LOOKUP, choose, decode_rates

    nodes = heads_nodes + depth
    fitted = build_tree(accuracies, nodes)
    shapes = {HYBRID: (heads_nodes, depth), DRAFT: (nodes, 0), LOOKUP: (1, depth)}
    trees = {name: TokenTree(fitted[:h - 1], lookup_depth=d, lookup_ngram=cfg.lookup_ngram)
             for name, (h, d) in shapes.items()}
    offered = sequences[:cfg.guard_prompts]
    budget = f" (none started after guard_max_minutes={cfg.guard_max_minutes:g})" if cfg.guard_max_minutes else ""
    print(f"guard: decoding {len(offered)} calibration prompts{budget} with the hybrid ({heads_nodes} heads' nodes + "
          f"{depth} lookup), the draft alone ({nodes} nodes) and the lookup chain alone (1 + {depth}), interleaved", flush=True)
    rates, same_text, decoded = decode_rates(model, offered, trees, cfg.max_new_tokens, eos_token_ids(model.backbone),
                                             max_minutes=cfg.guard_max_minutes)
    prompts = offered[:decoded]
    if decoded < len(offered):
        print(f"guard: stopped at guard_max_minutes={cfg.guard_max_minutes:g} with {decoded} of {len(offered)} prompts "
              "decoded (each by all three)", flush=True)
    kept, why = choose({n: r["tokens_per_s"] for n, r in rates.items()}, {n: trees[n].num_nodes for n in trees},
                       cfg.guard_margin)
    for name, r in rates.items():
        print(f"guard: {name}: {r['tokens_per_s']:.1f} tokens/s, {r['tokens_per_step']:.3f} tokens per step "
              f"(walk expected {split.expected(*shapes[name], len(prompts)):.3f} on the same prompts)")
    if not same_text:
        print("guard: warning: the three trees did not write the same text on every prompt (greedy ties in "
              f"{model.backbone.dtype} rounding)")
    h, d = shapes[kept]
    return {"kept": kept, "why": why, "prompts": len(prompts), "offered": len(offered),
            "max_minutes": cfg.guard_max_minutes, "margin": cfg.guard_margin,
            "measured": {n: {"tokens_per_s": round(r["tokens_per_s"], 2), "tokens_per_step": round(r["tokens_per_step"], 4),
                             "expected_tokens_per_step": round(split.expected(*shapes[n], len(prompts)), 4), "nodes": trees[n].num_nodes}
                         for n, r in rates.items()},
            "heads_nodes": h, "lookup_nodes": d}


class LookupSplit:
    """How to share a tree's nodes between the heads and a lookup chain (``lookup_depth``).

    The heads' part of an ``n``-node tree with a ``d``-node chain is the fitted tree's first ``n - d`` nodes. Every
    split, the heads alone (``d = 0``) included, is estimated the same way: greedy decoding walked step by step over
    the calibration text, each step taking the longer of the heads' measured depth and the chain's measured run at
    its position (``calibrate.tokens_per_step``). Per-position gains (``calibrate.lookup_gains``, what the YAML
    records per chain node) over-promise where the text loops: the demo's calibration text promised 4.59 tokens per
    step for a split that then accepted 1.88 on MT-Bench."""

    def __init__(self, cfg: BuildTreeConfig, accuracies, ranks, sequences):
        self.accuracies, self.ranks = accuracies, ranks
        self.fixed = None if cfg.lookup_depth == "auto" else cfg.lookup_depth
        self.max_depth = cfg.lookup_max_depth if self.fixed is None else self.fixed
        self.runs = lookup_runs(sequences, self.max_depth, cfg.lookup_ngram) if self.max_depth else None
        self._depths: dict[int, list[list[int]]] = {}

    def depths(self, heads_nodes: int) -> list[list[int]]:
        """Per sequence and position, how deep the fitted tree's first ``heads_nodes`` nodes accept."""
        if heads_nodes not in self._depths:
            self._depths[heads_nodes] = heads_depths(self.ranks, build_tree(self.accuracies, heads_nodes))
        return self._depths[heads_nodes]

    def gains(self, heads_nodes: int) -> list[float]:
        """Per chain index, the share of positions where it is right and those heads' nodes fall short."""
        return lookup_gains(self.runs, self.depths(heads_nodes), self.max_depth) if self.runs is not None else []

    def expected(self, heads_nodes: int, lookup_depth: int, texts: int | None = None) -> float:
        """Expected tokens per step of ``heads_nodes`` heads' nodes (root included) and a ``lookup_depth`` chain (over
        the first ``texts`` calibration texts; all by default)."""
        runs = self.runs[:texts] if self.runs is not None else None
        return tokens_per_step(self.depths(heads_nodes)[:texts], runs, lookup_depth)

    def best(self, nodes: int) -> tuple[float, int]:
        """``(expected tokens per step, chain nodes)`` of the best split of ``nodes`` (ties: the shorter chain)."""
        depths = [self.fixed] if self.fixed is not None else range(min(self.max_depth, nodes - 1) + 1)
        options = [(self.expected(nodes - d, d), -d) for d in depths if d < nodes]
        expected, negative = max(options, key=lambda o: (round(o[0], 9), o[1]))  # equal up to rounding: a tie
        return expected, -negative


def cost_context(cfg: BuildTreeConfig, tokenizer, calibration: list[str]) -> int:
    """Cached tokens at which ``nodes=auto`` times the steps: ``cost_context``, or with ``auto`` the mean context
    of a decode step answering the evaluation's prompts (the ``exclude`` benchmark's first turns, else the
    ``calibration`` prompts) with ``answer_tokens`` new tokens: their mean length + ``answer_tokens / 2``.

    The ratio of the two steps' costs may move with the context (a plain step's attention grows with it, a
    verify step's extra rows less so), so the steps are timed where the decoding will run rather than at a
    fixed length. Measured on the demo's CPU (6-node tree, 4 interleaved rounds): verify / generate 1.21
    on average at 129 tokens against 1.17 at 256, and 1.17 at 160 (the demo's mean) against 1.12 at 256,
    round by round from -2% to +19% (docs/results.md)."""
    if cfg.cost_context != "auto":
        return cfg.cost_context
    benchmark = [p.turns[0] for p in load_benchmark(cfg.exclude) if p.turns] if cfg.exclude else []
    texts = benchmark or calibration  # run() has stopped already if there are no calibration prompts
    lengths = [encode_chat(tokenizer, [{"role": "user", "content": t}]).shape[1] for t in texts]
    return round(sum(lengths) / len(lengths) + cfg.answer_tokens / 2)


def choose_size(model, accuracies, cfg: BuildTreeConfig, context: int, split: LookupSplit) -> tuple[int, dict]:
    """``nodes=auto``: time the fitted tree's prefixes here (at ``context`` cached tokens) and pick the size
    with the most expected tokens/s, each size shared between heads and lookup as ``split`` finds best (each size
    is timed with its lookup chain; the chain's own lookup, a few dictionary reads, is not).

    Returns the size and what the tree YAML records about the choice (device, dtype, cost curve, every
    size's expected figures and lookup nodes)."""
    full = build_tree(accuracies, cfg.max_nodes)
    sizes = auto_sizes(cfg.max_nodes, len(full) + 1 + split.max_depth)
    splits = {n: split.best(n) for n in sizes}
    # most likely first: every prefix is a tree; each size timed as it would decode, its lookup chain included
    trees = {n: TokenTree(full[:n - 1 - d], lookup_depth=d, lookup_ngram=cfg.lookup_ngram)
             for n, (_, d) in splits.items()}
    where = ", the mean context answering the evaluation's prompts" if cfg.cost_context == "auto" else ""
    print(f"nodes=auto: timing a plain step, generate and a verify step at {len(sizes)} tree sizes "
          f"({context} cached tokens{where}, {cfg.cost_repeats} rounds)", flush=True)
    expected = {n: walked for n, (walked, _) in splits.items()}  # each size's expected accepted length
    curve = measure_cost_curve(model, trees, context, cfg.cost_repeats, graphs=cfg.cuda_graphs, expected=expected,
                               screen=cfg.cost_screen)
    best, rows = choose_tree_size(curve, expected)
    print(f"cost on {curve.device}, {curve.dtype}{', CUDA graphs' if curve.graphs else ''}: plain step "
          f"{curve.plain_ms:.1f} ms, generate {curve.generate_ms:.1f} ms per token; speedups over "
          f"{curve.baseline_ms:.1f} ms (the faster plain decoding)")
    print("| nodes | lookup nodes | expected accepted length | verify step timed (ms) | fitted (ms) | relative cost | "
          "expected tokens/s | expected speedup |\n|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.nodes}{' *' if r.nodes == best else ''} | {splits[r.nodes][1]} | {r.expected_accept_length:.3f} | "
              f"{curve.verify_ms[r.nodes]:.1f}{' (once)' if r.nodes in curve.once else ''} | {r.verify_ms:.1f} | "
              f"{r.relative_cost:.2f} | {r.expected_tokens_per_s:.1f} | {r.expected_speedup:.2f}x |")
    if curve.once:
        print(f"timed once (screened out by the first round, cost_screen={cfg.cost_screen:g}): "
              f"{', '.join(map(str, curve.once))} nodes: their expected tokens/s there fell under 1/{cfg.cost_screen:g} "
              "of the best size's")
    chosen = next(r for r in rows if r.nodes == best)
    extra = {"device": curve.device, "dtype": curve.dtype, "chosen_nodes": best,
             "chosen_lookup_nodes": splits[best][1],
             "expected_speedup": round(chosen.expected_speedup, 4),
             "expected_tokens_per_s": round(chosen.expected_tokens_per_s, 2),
             "cost_curve": {"context": curve.context, "repeats": curve.repeats, "threads": curve.threads,
                            "plain_ms": round(curve.plain_ms, 3), "generate_ms": round(curve.generate_ms, 3),
                            # CUDA graphs (decoding/graphs.py); speedups divide by baseline_ms, the faster plain
                            "graphs": curve.graphs, "baseline_ms": round(curve.baseline_ms, 3),
                            "verify_ms": {int(n): round(ms, 3) for n, ms in curve.verify_ms.items()},
                            # sizes screened out by the first round (cost_screen): their verify_ms timed once
                            "screen": cfg.cost_screen, "once": list(curve.once),
                            # what the choice used: the timings made non-decreasing in size (noise pooled)
                            "verify_ms_fitted": {r.nodes: round(r.verify_ms, 3) for r in rows}},
             "sizes": {str(r.nodes): {"lookup_nodes": splits[r.nodes][1],
                                      "expected_accept_length": round(r.expected_accept_length, 4),
                                      "expected_tokens_per_s": round(r.expected_tokens_per_s, 2),
                                      "expected_speedup": round(r.expected_speedup, 4)} for r in rows}}
    return best, extra
