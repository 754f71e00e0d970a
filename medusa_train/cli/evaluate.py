"""``medusa-train evaluate``: measure heads on a benchmark against plain decoding and write the report.

    medusa-train evaluate draft=outputs/medusa1/export                    # MT-Bench, 80 x 2 turns
    medusa-train evaluate draft=outputs/medusa1/export bench.limit=5 generation.max_new_tokens=64
    medusa-train evaluate draft=outputs/medusa1/export engine=vllm bench.limit=24 bench.turns=1   # + served

Options: ``configs/commands/evaluate.yaml`` (schema: ``medusa_train.config.evaluate.EvalConfig``).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import asdict
from pathlib import Path

import torch

from medusa_train.config.check import Problems, parse_config
from medusa_train.config.evaluate import EvalConfig, check_eval_config, default_output_dir
from medusa_train.evaluation.console import print_summary
from medusa_train.evaluation.drift import measure_drift
from medusa_train.evaluation.evaluate import evaluate, resolve_tree
from medusa_train.evaluation.report import report_output_problem
from medusa_train.evaluation.served import served_runner
from medusa_train.model.load import check_draft_folder, load_exported_draft, read_exported_draft
from medusa_train.tree.calibrate import bench_prompts, bench_source_problem


# ------------------------------------------------------------------------------------------- checks
def build_eval_config(raw) -> EvalConfig:
    """A validated ``EvalConfig`` from a Hydra ``DictConfig`` or a dict: the schema's range checks and
    those that read the heads, the tree and the benchmark, every problem reported at once.

    Raises:
        ConfigError: listing each invalid value with the key to change.
    """
    return parse_config(EvalConfig, raw, lambda c: check_eval_config(c) + check_eval_inputs(c))


def check_eval_inputs(c: EvalConfig) -> list[str]:
    """The checks that need the heads folder, the tree, the benchmark file or this machine."""
    from medusa_train.backbone.merge import BACKBONE_INFO
    from medusa_train.config.engine import check_served
    from medusa_train.data.benchmarks import BENCH_PICKS
    from medusa_train.decoding import ACCEPTANCE_METHODS

    p = Problems()
    depth, base = check_draft_folder(c.draft, p)
    if c.engine:  # vLLM builds K Medusa heads, so K is at most their count; a chained draft takes any K
        chains = depth is not None and read_exported_draft(c.draft).family.chains_any_k
        p.extend(check_served(c.served, None if chains else depth))
        p.need(c.model.form == "merged", "model.form", c.model.form, "engine=vllm serves a merged backbone")
    if depth is not None:
        p.need(bool(base or c.model.name_or_path), "model.name_or_path", None,
               "the heads' config.json names no base model; set model.name_or_path")
    adapted = bool(c.draft) and (Path(c.draft).expanduser() / BACKBONE_INFO).is_file()  # a backbone trained too
    p.need(c.model.form != "adapter" or adapted, "model.form", c.model.form,
           f"adapter needs a Medusa-2 export (no {BACKBONE_INFO} in heads=)")
    p.need(c.drift.original != "auto" or adapted, "drift.original", c.drift.original,
           f"auto needs a Medusa-2 export (no {BACKBONE_INFO} in heads=); name the original model instead")
    p.extend(filter(None, [report_output_problem(c.output_dir or default_output_dir(c.draft))]))
    problem = bench_source_problem(c.bench.source)
    p.need(problem is None, "bench.source", c.bench.source, problem)
    p.need(c.bench.pick in BENCH_PICKS, "bench.pick", c.bench.pick, f"must be one of {', '.join(BENCH_PICKS)}")
    p.need(c.generation.acceptance in ACCEPTANCE_METHODS, "generation.acceptance", c.generation.acceptance,
           f"must be one of {', '.join(ACCEPTANCE_METHODS)}")
    p.need(not (c.device or "").startswith("cuda") or torch.cuda.is_available(), "device", c.device,
           "CUDA is not available here")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a built-in tree cut to the heads' depth is said once, at run time
            resolve_tree(c.tree, depth)
    except (ValueError, FileNotFoundError) as err:
        p.append(str(err) if str(err).startswith("tree") else f"tree={c.tree}: {err}")
    return p


# ------------------------------------------------------------------------------------------- running
def busy_cpu_note() -> None:
    """Say so when other processes keep the CPU busy: with several torch threads, every parallel op then
    waits for a descheduled thread, and timings come out many times too slow (one thread is steadier)."""
    load, cores, threads = os.getloadavg()[0], os.cpu_count() or 1, torch.get_num_threads()
    if threads > 1 and load >= 0.75 * cores:
        print(f"note: the CPU is busy (load average {load:.1f} on {cores} cores) and torch uses {threads} threads: "
              "timings will be noisy and slow; threads=1 gives steadier numbers on a shared machine")


def run(cfg: EvalConfig) -> dict:
    """Load what ``cfg`` names, evaluate, write the report, and print the summary (last two lines:
    ``mean accepted length: X.XX`` and ``speedup: Y.YYx``)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    heads = read_exported_draft(cfg.draft)  # its config.json, read once and handed along
    model, tokenizer = load_exported_draft(heads, cfg.model, cfg.device)
    prompts = bench_prompts(cfg.bench.source, cfg.draft, tokenizer, cfg.bench.limit, cfg.bench.pick)
    if model.lm_head.weight.device.type == "cpu":
        busy_cpu_note()
    output_dir = cfg.output_dir or default_output_dir(cfg.draft)
    Path(output_dir).mkdir(parents=True, exist_ok=True)  # after the checks: a refused command creates nothing
    settings = {"draft_folder": str(cfg.draft), "model": model.backbone.name_or_path, "bench": asdict(cfg.bench),
                "attn_implementation": cfg.model.attn_implementation}
    extra = {}
    if cfg.drift.original:
        extra["drift"] = measure_drift(model.backbone, tokenizer, prompts, cfg.drift, cfg.draft, cfg.model)
        d = extra["drift"]
        print(f"backbone drift from {d['original']}: mean KL {d['mean_kl']:.4f} per token, greedy agreement "
              f"{d['greedy_agreement']:.1%} over {d['num_tokens']} tokens of {d['prompts']} prompts", flush=True)
    served = served_runner(cfg, heads, model, tokenizer, output_dir) if cfg.engine == "vllm" else None
    report = evaluate(model, tokenizer, prompts, cfg.tree, turns=cfg.bench.turns, generation=cfg.generation,
                      baselines=cfg.baselines, warmup=cfg.warmup, output_dir=output_dir, progress=cfg.progress,
                      settings=settings, extra=extra, served=served, max_minutes=cfg.bench.max_minutes,
                      branches=cfg.bench.branches)
    print_summary(report, cfg.bench.turns, cfg.tree)
    return report


def main() -> None:
    """Entry point of ``medusa-train evaluate``."""
    from medusa_train.cli.entry import run_command

    run_command("evaluate", build_eval_config, run, resolvers={"default_output_dir": default_output_dir})
