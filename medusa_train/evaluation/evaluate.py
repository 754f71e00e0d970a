"""Measure Medusa heads: accepted length, per-head acceptance, speedup over plain decoding, losslessness.

    medusa-train evaluate draft=outputs/medusa1/export                    # MT-Bench, 80 x 2 turns
    medusa-train evaluate draft=outputs/medusa1/export bench.limit=5 generation.max_new_tokens=64

Every prompt goes through the tokenizer's chat template (``add_generation_prompt=True``; the heads'
own template when their export carries one) and is decoded, one method after the other, by the
backbone's own ``generate`` (plain decoding, HF transformers' greedy), by ``generate`` with prompt
lookup (the free baseline that needs no training; its settings swept on a few prompts first), and by
``tree_generate`` (with a tree that has a lookup chain, also by its heads' nodes alone and by the chain alone). A second turn is asked after the *plain* answer to the first, so every method sees
the same context. Under greedy decoding the outputs must be identical; each difference of the heads
is reported with the first differing position and the base model's top-2 logit gap there (a tiny gap is a
floating-point near-tie, a large one a bug).

Definitions (all totals over every prompt and turn; see ``evaluation.summary``):

- mean accepted length = tokens after each reply's first / target forwards after its prefill (plain
  decoding = 1.00; the same count as the served rows);
- per-head acceptance = fraction of verify steps in which head k's guess was kept;
- ``speedup`` = draft tokens/s / plain tokens/s, wall clock of the whole generation (prefill +
  decode, as a user sees it); ``decode_speedup`` uses decode time only (after the first new token).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from medusa_train.backbone.attention import attention_for, head_dim_of
from medusa_train.backbone.generation import encode_chat, eos_token_ids, now, plain_generate
from medusa_train.backbone.row_layers import linear_path
from medusa_train.config.budget import budget_spent
from medusa_train.config.evaluate import BaselinesConfig, DecodeConfig
from medusa_train.config.paths import TREE_DIR
from medusa_train.data.benchmarks import DEFAULT_BENCHMARK, BenchPrompt, load_benchmark
from medusa_train.decoding import TokenTree, tree_generate
from medusa_train.decoding.graphs import StaticSteps, graphs_wanted
from medusa_train.decoding.tree import tree_from_config
from medusa_train.evaluation.compare import first_difference, mismatch_detail
from medusa_train.evaluation.engines import engine_rows, vllm_reason
from medusa_train.evaluation.pauses import CollectorPauses
from medusa_train.evaluation.summary import summarise

WARMUP_TOKENS = 16


# ------------------------------------------------------------------------------------------- trees
def tree_expectation(spec, measured: float) -> dict:
    """``{"expected": {tokens_per_forward, gap, from}}`` when ``spec`` is a tree YAML that build-tree wrote (its
    walked expectation on its calibration prompts) beside what was measured here; else nothing."""
    if not isinstance(spec, (str, Path)) or not str(spec).endswith((".yaml", ".yml")) or not Path(spec).is_file():
        return {}
    from medusa_train.decoding.tree import _read_tree_file

    expected = _read_tree_file(spec).get("expected_accept_length")
    if expected is None:
        return {}
    return {"expected": {"tokens_per_forward": float(expected), "gap": round(measured - float(expected), 4),
                         "from": f"build-tree's walk over its calibration prompts ({spec})"}}


def resolve_tree(spec, num_heads: int | None) -> TokenTree:
    """A ``TokenTree`` for ``spec`` that fits ``num_heads`` heads.

    Built-in names adapt: ``chain`` is built for ``num_heads`` heads, and a built-in tree deeper than
    the model is cut to its first ``num_heads`` depths (with a warning). A YAML path, a list of
    choices or a ``TokenTree`` is used as given; one that needs more heads is an error.
    """
    if isinstance(spec, str) and Path(spec).suffix not in (".yaml", ".yml") and (TREE_DIR / f"{spec}.yaml").is_file():
        if spec == "chain" and num_heads is not None:
            return TokenTree.chain(num_heads)
        tree = TokenTree.from_name(spec)
        if num_heads is not None and tree.depth > num_heads:
            warnings.warn(f"tree={spec} is {tree.depth} deep but the heads are {num_heads}: "
                          f"using its paths of depth <= {num_heads}", stacklevel=2)
            tree = tree.truncated(max_depth=num_heads)
        return tree
    return tree_from_config(spec, num_heads=num_heads)


def _generate_turn(model, tokenizer, messages: list[dict], tree: TokenTree, gen: DecodeConfig, eos: list[int],
                   pad: int, lookup: tuple[int, int] | None, steps: StaticSteps | None = None,
                   branches: bool = True) -> tuple[dict, list[int], torch.Tensor]:
    """Decode one turn with each method in turn (plain, prompt lookup, with ``steps``' graphs plain graphed, the
    heads; with ``branches`` a lookup-chain tree's branches alone too); returns the per-prompt record, the plain
    answer's ids and the input."""
    device = model.lm_head.weight.device
    input_ids = encode_chat(tokenizer, messages).to(device)
    sampling = gen.temperature > 0
    if sampling:
        torch.manual_seed(gen.seed)
    plain, plain_time = plain_generate(model.backbone, input_ids, gen.max_new_tokens, eos, pad,
                                       gen.temperature, gen.top_p)
    looked_up, lookup_time = None, None
    if lookup is not None:
        if sampling:
            torch.manual_seed(gen.seed)
        looked_up, lookup_time = plain_generate(model.backbone, input_ids, gen.max_new_tokens, eos, pad,
                                                gen.temperature, gen.top_p, prompt_lookup=lookup)
    def ours(decoding_tree: TokenTree):
        generator = torch.Generator(device).manual_seed(gen.seed) if sampling else None
        start = now(device)
        out = tree_generate(model, input_ids, decoding_tree, max_new_tokens=gen.max_new_tokens,
                              temperature=gen.temperature, acceptance=gen.acceptance, top_p=gen.top_p,
                              typical_threshold=gen.typical_threshold, typical_alpha=gen.typical_alpha,
                              eos_token_id=eos, generator=generator, steps=steps)
        return out, now(device) - start

    graphed = None
    if steps is not None and steps.graphed:  # plain greedy as a server steps: the root alone, each step replayed
        graphed, graphed_wall = ours(TokenTree([]))

    # a tree with a lookup chain is also decoded without it and by the chain alone: what each branch buys
    parts = {name: ours(part) for name, part in split_tree(tree).items()} if branches else {}
    out, wall = ours(tree)
    drafted = out.sequences[0, input_ids.shape[1]:].tolist()
    record = {
        "prompt_tokens": input_ids.shape[1], "new_tokens": out.new_tokens, "steps": out.steps,
        "accepted_length": (out.new_tokens - 1) / max(out.steps, 1), "plain_new_tokens": len(plain),
        "accept_lengths": out.accept_lengths, "accepted_depths": out.accepted_depths,
        "lookup_depths": out.lookup_depths, "lookup_nodes": tree.lookup_depth,
        "draft_s": {**out.timings, "wall_s": wall}, "plain_s": plain_time, "match": None, "mismatch": None,
        "prompt_lookup_new_tokens": None if looked_up is None else len(looked_up), "prompt_lookup_s": lookup_time,
        "prompt_lookup_match": None,
    }
    if graphed is not None:
        record.update(plain_graphed_new_tokens=graphed.new_tokens, plain_graphed_match=None,
                      plain_graphed_s={**graphed.timings, "wall_s": graphed_wall, "forwards": graphed.steps + 1})
    for name, (part, part_wall) in parts.items():
        record[name] = {"new_tokens": part.new_tokens, "steps": part.steps, "wall_s": part_wall,
                        "decode_s": part.timings["decode_s"], "match": None}
    if not sampling:
        position = first_difference(plain, drafted)
        record["match"] = position is None
        if position is not None:
            record["mismatch"] = mismatch_detail(model, input_ids, plain, drafted, position)
        if looked_up is not None:
            record["prompt_lookup_match"] = looked_up == plain
        if graphed is not None:
            record["plain_graphed_match"] = graphed.sequences[0, input_ids.shape[1]:].tolist() == plain
        for name, (part, _) in parts.items():
            record[name]["match"] = part.sequences[0, input_ids.shape[1]:].tolist() == plain
    return record, plain, input_ids


def split_tree(tree: TokenTree) -> dict[str, TokenTree]:
    """For a tree with a lookup chain, its two branches alone: ``draft_only`` (the draft's nodes) and
    ``lookup_chain`` (the root and the chain); nothing for a tree without one."""
    if not tree.lookup_depth:
        return {}
    return {"draft_only": tree.heads_tree,
            "lookup_chain": TokenTree([], lookup_depth=tree.lookup_depth, lookup_ngram=tree.lookup_ngram)}


# ------------------------------------------------------------------------------------------- prompt lookup
def choose_prompt_lookup(model, tokenizer, prompts: Sequence[BenchPrompt], baselines: BaselinesConfig,
                         eos: list[int], pad: int) -> dict:
    """Prompt lookup's settings: those given, or the fastest of the sweep's grid (``baselines.sweep_num_tokens``
    x ``sweep_ngram_sizes``; a setting given fixes its half) over the first turns of the first
    ``sweep_prompts`` prompts, greedy.

    Returns:
        ``{"num_tokens", "max_matching_ngram_size", "sweep": [{num_tokens, max_matching_ngram_size,
        tokens_per_s, tokens_per_forward}], "swept_on": prompts}`` (no sweep when both are given).
    """
    b = baselines
    sizes = [b.prompt_lookup_num_tokens] if b.prompt_lookup_num_tokens else list(b.sweep_num_tokens)
    ngrams = [b.prompt_lookup_ngram_size] if b.prompt_lookup_ngram_size else list(b.sweep_ngram_sizes)
    grid = [(n, m) for n in sizes for m in ngrams]
    if len(grid) == 1:
        return {"num_tokens": grid[0][0], "max_matching_ngram_size": grid[0][1], "sweep": [], "swept_on": 0}
    device = model.lm_head.weight.device
    inputs = [encode_chat(tokenizer, [{"role": "user", "content": p.turns[0]}]).to(device)
              for p in prompts[:b.sweep_prompts]]
    rows = []
    for n, m in grid:
        tokens = forwards = 0
        seconds = 0.0
        for ids in inputs:
            new, timing = plain_generate(model.backbone, ids, b.sweep_max_new_tokens, eos, pad, prompt_lookup=(n, m))
            tokens, forwards, seconds = tokens + len(new), forwards + timing["forwards"] - 1, seconds + timing["wall_s"]
        rows.append({"num_tokens": n, "max_matching_ngram_size": m, "tokens_per_s": tokens / max(seconds, 1e-9),
                     "tokens_per_forward": (tokens - len(inputs)) / max(forwards, 1)})
    best = max(rows, key=lambda r: r["tokens_per_s"])
    return {"num_tokens": best["num_tokens"], "max_matching_ngram_size": best["max_matching_ngram_size"],
            "sweep": rows, "swept_on": len(inputs)}


# ------------------------------------------------------------------------------------------- evaluate
def evaluate(model, tokenizer, prompts: Sequence[BenchPrompt] | str = DEFAULT_BENCHMARK,
             tree: TokenTree | str = "default", *, turns: int = 2, limit: int | None = None,
             generation: DecodeConfig | None = None, baselines: BaselinesConfig | None = None, warmup: bool = True,
             output_dir: str | os.PathLike | None = None, progress: bool = True, settings: dict | None = None,
             extra: dict | None = None, served=None, max_minutes: float | None = None, branches: bool = True,
             **generation_kwargs) -> dict:
    """Run a benchmark with the heads, plain decoding and prompt lookup, and return the report.

    Args:
        model: A ``MedusaModel`` (see ``medusa_train.model.load.load_exported_draft``).
        tokenizer: Its tokenizer (with a chat template).
        prompts: ``BenchPrompt``s, or a source for ``load_benchmark``.
        tree: Tree name, YAML path or ``TokenTree`` (see ``resolve_tree``).
        turns: Turns asked per prompt (at most the prompt's own).
        limit: Evaluate the first ``limit`` prompts only.
        generation: Decoding settings; ``generation_kwargs`` (``max_new_tokens=64``, ...) override fields.
        baselines: The free baselines decoded beside the heads (default: prompt lookup, swept).
        warmup: Run one short untimed generation of each method first.
        output_dir: When given, ``report.json``, ``report.md`` and ``report.png`` are written there.
        progress: Show a tqdm bar over prompts with the running accepted length.
        settings: Extra entries for the report's ``settings`` (the model, the heads, ...).
        extra: Extra top-level entries of the report (``drift``, ...), written with it.
        served: ``served(conversations, servable) -> serve_and_measure's result`` (``evaluation.served``): the
            same conversations through a running engine; ``servable`` says whether the heads have a vLLM form
            (when not, only the engine's free rows are served). Its figures become the report's ``served``
            section (see ``evaluation.served_report``).
        max_minutes: No prompt starts after this many minutes of this call (the prompt-lookup sweep and the warm-up
            in them): the prompts decoded are the first of ``prompts``, every method on each, and the report's
            ``prompts`` says how many of how many (``None``: all).
        branches: A tree with a lookup chain also decoded by each branch alone on every prompt (the report's
            ``draft_only`` and ``lookup_chain`` rows); false: the tree alone.

    Returns:
        The report dict (keys described in ``evaluation.summary.summarise``).
    """
    from tqdm.auto import tqdm

    started = time.perf_counter()  # max_minutes counts from here: the sweep and the warm-up are in it
    load_at_start = os.getloadavg()[0]
    if isinstance(prompts, str | os.PathLike):
        prompts = load_benchmark(prompts, limit)
    elif limit is not None:
        prompts = list(prompts)[:limit]
    if not prompts:
        raise ValueError("no prompts to evaluate")
    gen = DecodeConfig(**{**asdict(generation or DecodeConfig()), **generation_kwargs})
    baselines = baselines or BaselinesConfig()
    tree_spec = tree if isinstance(tree, str) else "custom"
    tree = resolve_tree(tree, model.config.depth)
    eos = eos_token_ids(model.backbone)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    model.eval()
    graphs = graphs_wanted(gen.cuda_graphs, model.lm_head.weight.device)
    replayed = StaticSteps(model, graphs=True) if graphs else None  # captured in the warm-up turn, as a server at start

    lookup_settings = choose_prompt_lookup(model, tokenizer, prompts, baselines, eos, pad) \
        if baselines.prompt_lookup else None
    lookup = (lookup_settings["num_tokens"], lookup_settings["max_matching_ngram_size"]) if lookup_settings else None
    if warmup:
        short = DecodeConfig(**{**asdict(gen), "max_new_tokens": min(gen.max_new_tokens, WARMUP_TOKENS)})
        _generate_turn(model, tokenizer, [{"role": "user", "content": prompts[0].turns[0]}], tree, short, eos, pad,
                       lookup, replayed, branches)

    records: list[dict] = []
    inputs: list[torch.Tensor] = []
    conversations: list[list[dict]] = []  # what each input was encoded from (for a served engine)
    tokens = steps = decoded = 0
    bar = tqdm(prompts, desc="evaluate", unit="prompt", disable=not progress)
    with CollectorPauses() as pauses:  # Python's collections inside the timed region (the report keeps them)
        for prompt in bar:
            if decoded and budget_spent(started, max_minutes):
                break  # the budget spent: the prompts left are not started (the report says how many were decoded)
            decoded += 1
            messages: list[dict] = []
            for turn, text in enumerate(prompt.turns[:turns], start=1):
                messages.append({"role": "user", "content": text})
                at = round(time.perf_counter() - started, 2)  # when its turn began: a disturbance's time shows
                record, plain, input_ids = _generate_turn(model, tokenizer, messages, tree, gen, eos, pad, lookup,
                                                          replayed, branches)
                inputs.append(input_ids)
                conversations.append(list(messages))
                records.append({"id": prompt.id, "category": prompt.category, "turn": turn, "at_s": at, **record})
                messages.append({"role": "assistant", "content": tokenizer.decode(plain, skip_special_tokens=True)})
                tokens, steps = tokens + record["new_tokens"] - 1, steps + record["steps"]
                bar.set_postfix(accepted_length=f"{tokens / max(steps, 1):.2f}")
    bar.close()

    stopped = decoded < len(prompts)
    if stopped:
        print(f"evaluate: stopped at max_minutes={max_minutes:g} with {decoded} of {len(prompts)} prompts decoded "
              "(every method on each)", flush=True)
    # acceptance is reported for the heads the tree reaches: a head past its depth is never tried, not 0% right
    report = summarise(records, min(model.config.depth, tree.depth), model.config.draft_name)
    if gen.temperature == 0:  # what each serving engine would accept on the same prompts
        draft_only = report["methods"].get("draft_only")
        report["engines"] = engine_rows(model, inputs, tree, report["mean_accepted_length"], gen.max_new_tokens, eos,
                                        draft_only["tokens_per_forward"] if draft_only else None)
    report["settings"] = {
        **(settings or {}), "tree": tree_spec, "tree_nodes": tree.num_nodes, "tree_depth": tree.depth,
        "tree_choices": [list(c) for c in tree.listed_choices], "lookup_depth": tree.lookup_depth,
        "lookup_ngram": list(tree.lookup_ngram) if tree.lookup_depth else None, "turns": turns, **asdict(gen),
        "sampling": gen.temperature > 0, "eos_token_ids": eos, "depth": model.config.depth,
        "draft": model.config.draft_name,
        "dtype": str(model.lm_head.weight.dtype).removeprefix("torch."),
        "device": str(model.lm_head.weight.device), "torch_threads": torch.get_num_threads(),
        "linear_layers": linear_path(model.backbone),
        "attention": attention_for(model.lm_head.weight.device, model.lm_head.weight.dtype,
                                   head_dim_of(model.backbone)),
        "warmup": warmup, "cpu_load_average_at_start": round(load_at_start, 2),
        "plain_decoding": _plain_decoding(report["plain_reference"], gen.temperature),
        "prompt_lookup": lookup_settings,
        "order": "per prompt: plain, prompt lookup, " + ("plain graphed, " if graphs else "")
                 + ("draft only, lookup only, " if tree.lookup_depth else "") + "draft",
        "cuda_graphs": graphs, "graph_captures": replayed.captures if replayed else 0,
        "draft_graph_captures": replayed.draft_captures if replayed else 0,
        "garbage_collections": pauses.summary(),
        "speedup": f"tokens/s / {report['plain_reference']} tokens/s (the faster plain decoding), wall clock of "
                   "whole generations (prefill + decode); decode_speedup: decode time only, tokens after the first",
        "accepted_length": "tokens after each reply's first / target forwards after its prefill",
    }
    report["prompts"] = {"decoded": decoded, "offered": len(prompts), "max_minutes": max_minutes,
                         "stopped_at_max_minutes": stopped}
    report.update(tree_expectation(tree_spec, report["mean_accepted_length"]))
    report.update(extra or {})
    report["per_prompt"] = records
    if output_dir is not None:  # written before any engine runs: a failed server loses nothing measured here
        from medusa_train.evaluation.report import write_report

        report["files"] = {k: str(v) for k, v in write_report(report, output_dir).items()}
    if served is not None:
        from medusa_train.evaluation.served_report import add_served

        add_served(report, served(conversations, vllm_reason(model.config) is None), model, inputs, eos)
        if output_dir is not None:
            write_report(report, output_dir)
    return report


def _plain_decoding(reference: str, temperature: float) -> str:
    """What the speedups divide by, in words (``reference``: the report's ``plain_reference`` row)."""
    how = "greedy" if temperature == 0 else "sampled"
    if reference == "plain_graphed":
        return f"plain decoding replayed from CUDA graphs, {how} (faster than HF generate here)"
    return f"HF transformers {_transformers_version()} generate, {how}"


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
