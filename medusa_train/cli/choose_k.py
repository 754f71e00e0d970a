"""``medusa-train choose-k``: measure vLLM's ``num_speculative_tokens`` (K) for a set of heads and keep the fastest.

    medusa-train choose-k draft=<heads dir> dtype=bfloat16 [ks=[0,1,2]] [limit=24] [concurrency=8]

One vLLM server per K (0 = no speculation), MT-Bench first turns greedy at concurrency 1 and at ``concurrency``;
the fastest K at concurrency 1 goes to ``serving.json`` in the vllm export, and the serve line printed here (and by
``medusa-train export``) uses it. Options: ``configs/commands/choose_k.yaml`` (schema:
``medusa_train.config.choose_k.ChooseKConfig``); the work is ``medusa_train.evaluation.choose_k.choose_k``.
"""

from __future__ import annotations

from medusa_train.config.check import Problems, parse_config
from medusa_train.config.choose_k import ChooseKConfig, check_choose_k_config, check_ks


def build_choose_k_config(raw) -> ChooseKConfig:
    """A validated ``ChooseKConfig``: the schema's range checks and those that read the heads folder (K within
    its head count, a base model to serve), every problem reported at once (``ConfigError``)."""
    return parse_config(ChooseKConfig, raw, lambda c: check_choose_k_config(c) + check_choose_k_inputs(c))


def check_choose_k_inputs(c: ChooseKConfig) -> list[str]:
    """The checks that need the heads folder (or files: the prompts' source)."""
    from medusa_train.evaluation.choose_k import record_output_problem, served_problem
    from medusa_train.model.load import check_draft_folder, read_exported_draft
    from medusa_train.tree.calibrate import bench_source_problem

    p = Problems()
    problem = bench_source_problem(c.source)
    p.need(problem is None, "source", c.source, problem)
    depth, base = check_draft_folder(c.draft, p)
    if depth is not None and not (c.model or base):
        p.append(f"model: required; the heads' config.json ({c.draft}) names no base model: pass model=<base model>")
    # Medusa heads: vLLM builds the first K, so K > heads fails to load; a chained draft (EAGLE-3) takes any K
    chains = depth is not None and read_exported_draft(c.draft).family.chains_any_k
    p.extend(check_ks(c.ks, None if chains else depth))
    if depth is not None and (reason := served_problem(c.draft)):
        if not c.free:
            p.append(f"draft={c.draft}: vLLM cannot serve these heads: {reason}; with free=true choose-k serves "
                     "the base model without speculation and the free baselines for them")
        elif c.ks is not None:
            p.append(f"ks={c.ks}: vLLM cannot serve these heads ({reason}): leave ks out (choose-k serves the base "
                     "model without speculation and the free baselines for them)")
    if c.output and (problem := record_output_problem(c.output)):
        p.append(problem)
    return p


def run(cfg: ChooseKConfig) -> dict:
    """Serve and measure each K, write ``serving.json``, print the verdict and the serve line."""
    from medusa_train.evaluation.choose_k import choose_k, verdict
    from medusa_train.export.serve import fastest_free_command, serve_command, served_base
    from medusa_train.model.load import read_export_config

    depth, base = read_export_config(cfg.draft)
    export, record = choose_k(cfg, depth, cfg.model or base)
    print(verdict(record))
    if "draft" in record["not_served"]:  # the base model alone or a free baseline: the fastest served here
        print(fastest_free_command(record, served_base(cfg.model or base, [cfg.draft]), export))
    else:
        print(serve_command(export, draft=cfg.draft))
    return record


def main() -> None:
    """Entry point of ``medusa-train choose-k``."""
    from medusa_train.cli.entry import run_command

    run_command("choose_k", build_choose_k_config, run)
