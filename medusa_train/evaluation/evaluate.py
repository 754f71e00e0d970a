"""Measure Medusa heads: accepted length, per-head acceptance, speedup over plain decoding, losslessness.

    python scripts/evaluate.py heads=outputs/medusa1/export                    # MT-Bench, 80 x 2 turns
    python scripts/evaluate.py heads=outputs/medusa1/export bench.limit=5 generation.max_new_tokens=64

Every prompt goes through the tokenizer's chat template (``add_generation_prompt=True``) and is
decoded twice with the same settings: by ``medusa_generate`` and by the backbone's own
``generate`` (plain decoding). A second turn is asked after the *plain* answer to the first, so
both methods see the same context. Under greedy decoding the two outputs must be identical; each
difference is reported with the first differing position and the base model's top-2 logit gap
there (a tiny gap is a floating-point near-tie, a large one a bug).

Definitions (all totals over every prompt and turn):

- mean accepted length = medusa new tokens / verify steps (plain decoding = 1.00);
- per-head acceptance = fraction of verify steps in which head k's guess was kept;
- ``speedup`` = medusa tokens/s / plain tokens/s, wall clock of the whole generation (prefill +
  decode, as a user sees it); ``decode_speedup`` uses decode time only (after the first new token).
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from medusa_train.backbone.generation import encode_chat, eos_token_ids, now, plain_generate
from medusa_train.config.evaluate import DecodeConfig
from medusa_train.config.paths import TREE_DIR
from medusa_train.data.benchmarks import DEFAULT_BENCHMARK, BenchPrompt, load_benchmark
from medusa_train.decoding import MedusaTree, medusa_generate
from medusa_train.decoding.tree import tree_from_config
from medusa_train.evaluation.compare import first_difference, mismatch_detail
from medusa_train.evaluation.engines import engine_rows

WARMUP_TOKENS = 16


# ------------------------------------------------------------------------------------------- trees
def resolve_tree(spec, num_heads: int | None) -> MedusaTree:
    """A ``MedusaTree`` for ``spec`` that fits ``num_heads`` heads.

    Built-in names adapt: ``chain`` is built for ``num_heads`` heads, and a built-in tree deeper than
    the model is cut to its first ``num_heads`` depths (with a warning). A YAML path, a list of
    choices or a ``MedusaTree`` is used as given; one that needs more heads is an error.
    """
    if isinstance(spec, str) and Path(spec).suffix not in (".yaml", ".yml") and (TREE_DIR / f"{spec}.yaml").is_file():
        if spec == "chain" and num_heads is not None:
            return MedusaTree.chain(num_heads)
        tree = MedusaTree.from_name(spec)
        if num_heads is not None and tree.depth > num_heads:
            warnings.warn(f"tree={spec} is {tree.depth} deep but the heads are {num_heads}: "
                          f"using its paths of depth <= {num_heads}", stacklevel=2)
            tree = tree.truncated(max_depth=num_heads)
        return tree
    return tree_from_config(spec, num_heads=num_heads)


def _generate_turn(model, tokenizer, messages: list[dict], tree: MedusaTree, gen: DecodeConfig, eos: list[int],
                   pad: int) -> tuple[dict, list[int], torch.Tensor]:
    """Decode one turn with both methods; returns the per-prompt record, the plain answer's ids and the input."""
    device = model.lm_head.weight.device
    input_ids = encode_chat(tokenizer, messages).to(device)
    sampling = gen.temperature > 0
    if sampling:
        torch.manual_seed(gen.seed)
    plain, plain_time = plain_generate(model.backbone, input_ids, gen.max_new_tokens, eos, pad,
                                       gen.temperature, gen.top_p)
    generator = torch.Generator(device).manual_seed(gen.seed) if sampling else None
    start = now(device)
    out = medusa_generate(model, input_ids, tree, max_new_tokens=gen.max_new_tokens, temperature=gen.temperature,
                          acceptance=gen.acceptance, top_p=gen.top_p, typical_threshold=gen.typical_threshold,
                          typical_alpha=gen.typical_alpha, eos_token_id=eos, generator=generator)
    wall = now(device) - start
    medusa = out.sequences[0, input_ids.shape[1]:].tolist()
    record = {
        "prompt_tokens": input_ids.shape[1], "new_tokens": out.new_tokens, "steps": out.steps,
        "accepted_length": out.new_tokens / max(out.steps, 1), "plain_new_tokens": len(plain),
        "accept_lengths": out.accept_lengths, "accepted_depths": out.accepted_depths,
        "medusa_s": {**out.timings, "wall_s": wall}, "plain_s": plain_time, "match": None, "mismatch": None,
    }
    if not sampling:
        position = first_difference(plain, medusa)
        record["match"] = position is None
        if position is not None:
            record["mismatch"] = mismatch_detail(model, input_ids, plain, medusa, position)
    return record, plain, input_ids


# ------------------------------------------------------------------------------------------- evaluate
def evaluate(model, tokenizer, prompts: Sequence[BenchPrompt] | str = DEFAULT_BENCHMARK,
             tree: MedusaTree | str = "default", *, turns: int = 2, limit: int | None = None,
             generation: DecodeConfig | None = None, warmup: bool = True, output_dir: str | os.PathLike | None = None,
             progress: bool = True, settings: dict | None = None, extra: dict | None = None,
             served=None, **generation_kwargs) -> dict:
    """Run a benchmark with Medusa and plain decoding and return the report.

    Args:
        model: A ``MedusaModel`` (see ``medusa_train.model.load.load_heads``).
        tokenizer: Its tokenizer (with a chat template).
        prompts: ``BenchPrompt``s, or a source for ``load_benchmark``.
        tree: Tree name, YAML path or ``MedusaTree`` (see ``resolve_tree``).
        turns: Turns asked per prompt (at most the prompt's own).
        limit: Evaluate the first ``limit`` prompts only.
        generation: Decoding settings; ``generation_kwargs`` (``max_new_tokens=64``, ...) override fields.
        warmup: Run one short untimed generation of each method first.
        output_dir: When given, ``report.json``, ``report.md`` and ``report.png`` are written there.
        progress: Show a tqdm bar over prompts with the running accepted length.
        settings: Extra entries for the report's ``settings`` (the model, the heads, ...).
        extra: Extra top-level entries of the report (``drift``, ...), written with it.
        served: ``served(conversations) -> serve_and_measure's result`` (``evaluation.served``): the same
            conversations through a running engine (greedy only); its figures join ``engines.vllm``
            as ``served``, and the engine's n-gram speculation becomes the ``vllm-ngram`` row.

    Returns:
        The report dict (keys described in ``summarise``).
    """
    from tqdm.auto import tqdm

    load_at_start = os.getloadavg()[0]
    if isinstance(prompts, str | os.PathLike):
        prompts = load_benchmark(prompts, limit)
    elif limit is not None:
        prompts = list(prompts)[:limit]
    if not prompts:
        raise ValueError("no prompts to evaluate")
    gen = DecodeConfig(**{**asdict(generation or DecodeConfig()), **generation_kwargs})
    tree_spec = tree if isinstance(tree, str) else "custom"
    tree = resolve_tree(tree, model.config.num_heads)
    eos = eos_token_ids(model.backbone)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    model.eval()

    if warmup:
        short = DecodeConfig(**{**asdict(gen), "max_new_tokens": min(gen.max_new_tokens, WARMUP_TOKENS)})
        _generate_turn(model, tokenizer, [{"role": "user", "content": prompts[0].turns[0]}], tree, short, eos, pad)

    records: list[dict] = []
    inputs: list[torch.Tensor] = []
    conversations: list[list[dict]] = []  # what each input was encoded from (for a served engine)
    tokens = steps = 0
    bar = tqdm(prompts, desc="evaluate", unit="prompt", disable=not progress)
    for prompt in bar:
        messages: list[dict] = []
        for turn, text in enumerate(prompt.turns[:turns], start=1):
            messages.append({"role": "user", "content": text})
            record, plain, input_ids = _generate_turn(model, tokenizer, messages, tree, gen, eos, pad)
            inputs.append(input_ids)
            conversations.append(list(messages))
            records.append({"id": prompt.id, "category": prompt.category, "turn": turn, **record})
            messages.append({"role": "assistant", "content": tokenizer.decode(plain, skip_special_tokens=True)})
            tokens, steps = tokens + record["new_tokens"], steps + record["steps"]
            bar.set_postfix(accepted_length=f"{tokens / max(steps, 1):.2f}")
    bar.close()

    report = summarise(records, model.config.num_heads)
    if gen.temperature == 0:  # what each serving engine would accept on the same prompts
        report["engines"] = engine_rows(model, inputs, tree, report["mean_accepted_length"], gen.max_new_tokens, eos)
    report["settings"] = {
        **(settings or {}), "tree": tree_spec, "tree_nodes": tree.num_nodes, "tree_depth": tree.depth,
        "tree_choices": [list(c) for c in tree.listed_choices], "turns": turns, **asdict(gen),
        "sampling": gen.temperature > 0, "eos_token_ids": eos, "num_heads": model.config.num_heads,
        "dtype": str(model.lm_head.weight.dtype).removeprefix("torch."),
        "device": str(model.lm_head.weight.device), "torch_threads": torch.get_num_threads(),
        "warmup": warmup, "cpu_load_average_at_start": round(load_at_start, 2),
        "speedup": "medusa tokens/s / plain tokens/s, wall clock of whole generations (prefill + decode); "
                   "decode_speedup: decode time only, tokens after the first",
    }
    report.update(extra or {})
    report["per_prompt"] = records
    if output_dir is not None:  # written before any engine runs: a failed server loses nothing measured here
        from medusa_train.evaluation.report import write_report

        report["files"] = {k: str(v) for k, v in write_report(report, output_dir).items()}
    if served is not None and "engines" in report and report["engines"]["vllm"]["reason"] is None:
        _add_served(report["engines"], served(conversations), model, inputs)
        if output_dir is not None:
            write_report(report, output_dir)
    return report


def _add_served(engines: dict, raw: dict, model, inputs: list[torch.Tensor]) -> None:
    """Put a served engine's figures beside the simulated ones (see ``evaluation.served``)."""
    from medusa_train.evaluation.served import summarise_served

    def classify(i, plain, speculated, position):
        detail = mismatch_detail(model, inputs[i], plain, speculated, position)
        return {k: detail[k] for k in ("kind", "top2_gap", "tolerance", "plain_token", "medusa_token")}

    engines["vllm"]["served"] = summarise_served(raw, "medusa", classify)
    engines["vllm"]["served"]["settings"] = raw["settings"]
    counted = raw["servers"]["medusa"]["phases"]["greedy"]["prompt_tokens"]  # the engine's chat template vs ours
    engines["vllm"]["served"]["prompts_tokenised_alike"] = sum(n == ids.shape[1] for n, ids in zip(counted, inputs))
    if "ngram" in raw["servers"]:
        row = summarise_served(raw, "ngram", classify)
        engines["vllm-ngram"] = {"mean_accepted_length": row["mean_acceptance_length"],
                                 "verifies": "vLLM's n-gram prompt lookup, no heads (served)", "reason": None,
                                 "served": row}


def _totals(records: list[dict]) -> dict:
    """Accepted length, tokens/s and speedups of a group of per-prompt records."""
    def total(key, sub=None):
        return sum(r[key][sub] if sub else r[key] for r in records)

    tokens, plain_tokens, steps = total("new_tokens"), total("plain_new_tokens"), total("steps")
    n = len(records)
    tps = {"medusa": tokens / max(total("medusa_s", "wall_s"), 1e-9),
           "plain": plain_tokens / max(total("plain_s", "wall_s"), 1e-9)}
    decode_tps = {"medusa": (tokens - n) / max(total("medusa_s", "decode_s"), 1e-9),
                  "plain": (plain_tokens - n) / max(total("plain_s", "decode_s"), 1e-9)}
    checked = [r for r in records if r["match"] is not None]
    return {
        "count": n, "accepted_length": tokens / max(steps, 1), "speedup": tps["medusa"] / max(tps["plain"], 1e-9),
        "decode_speedup": decode_tps["medusa"] / max(decode_tps["plain"], 1e-9),
        "tokens_per_s": tps, "decode_tokens_per_s": decode_tps,
        "mismatches": sum(not r["match"] for r in checked) if checked else None,
        "mismatches_unexplained": sum(bool(r["mismatch"]) and r["mismatch"]["kind"] == "unexplained"
                                      for r in checked) if checked else None,
        "mismatches_at_rounding": sum(bool(r["mismatch"]) and r["mismatch"]["kind"] == "at_rounding"
                                      for r in checked) if checked else None,
        "new_tokens": {"medusa": tokens, "plain": plain_tokens}, "steps": steps,
    }


def summarise(records: list[dict], num_heads: int) -> dict:
    """The report's headline numbers from per-prompt records.

    Returns:
        ``mean_accepted_length`` (medusa tokens / verify steps), ``speedup`` and ``decode_speedup``,
        ``tokens_per_s`` and ``decode_tokens_per_s`` ({medusa, plain}), ``mismatches`` (greedy
        outputs differing from plain decoding; ``None`` when sampling), split into
        ``mismatches_unexplained`` (must be 0) and ``mismatches_at_rounding`` (see ``mismatch_detail``),
        with ``mismatch_details``,
        ``per_head_acceptance``, ``accept_length_histogram`` ({tokens per step: steps}),
        ``per_category`` ({category: count, accepted_length, speedup, ...}) and ``totals``.
    """
    overall = _totals(records)
    steps = max(overall["steps"], 1)
    depths = [d for r in records for d in r["accepted_depths"]]
    categories = sorted({r["category"] for r in records})
    return {
        "mean_accepted_length": overall["accepted_length"],
        "speedup": overall["speedup"],
        "decode_speedup": overall["decode_speedup"],
        "tokens_per_s": overall["tokens_per_s"],
        "decode_tokens_per_s": overall["decode_tokens_per_s"],
        "mismatches": overall["mismatches"],
        "mismatches_unexplained": overall["mismatches_unexplained"],
        "mismatches_at_rounding": overall["mismatches_at_rounding"],
        "mismatch_details": [{"id": r["id"], "category": r["category"], "turn": r["turn"], **r["mismatch"]}
                             for r in records if r["mismatch"]],
        "per_head_acceptance": [sum(d > k for d in depths) / steps for k in range(num_heads)],
        "accept_length_histogram": dict(sorted(Counter(n for r in records for n in r["accept_lengths"]).items())),
        "per_category": {c: _totals([r for r in records if r["category"] == c]) for c in categories},
        "totals": {k: overall[k] for k in ("count", "new_tokens", "steps")},
    }
