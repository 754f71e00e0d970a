"""``medusa-train build-tree``: fit a Medusa tree to the heads' measured accuracies and write it as a tree YAML.

    medusa-train build-tree draft=outputs/medusa1/export nodes=auto   # calibrated on the validation set

Options: ``configs/commands/build_tree.yaml`` (schema: ``medusa_train.config.build_tree.BuildTreeConfig``);
the work is ``medusa_train.tree.size.fit_and_write`` (calibrate, fit, size, write).
"""

from __future__ import annotations

from pathlib import Path

import torch

from medusa_train.config.build_tree import BuildTreeConfig, check_build_tree_config
from medusa_train.config.check import Problems, parse_config
from medusa_train.model.load import check_draft_folder, load_exported_draft
from medusa_train.tree.calibrate import CONVERSATION_SOURCES, tree_output_problem
from medusa_train.tree.size import fit_and_write, tree_output


def build_build_tree_config(raw) -> BuildTreeConfig:
    """A validated ``BuildTreeConfig``: the schema's range checks and those that read the heads and the
    calibration source, every problem reported at once (``ConfigError``)."""
    return parse_config(BuildTreeConfig, raw, lambda c: check_build_tree_config(c) + check_build_tree_inputs(c))


def check_build_tree_inputs(c: BuildTreeConfig) -> list[str]:
    """The checks that need the heads folder, the calibration file or the output (a file build-tree did not write is
    never replaced; a place that cannot be written is said before the work)."""
    p = Problems()
    check_draft_folder(c.draft, p)
    if c.draft and (problem := tree_output_problem(tree_output(c))):
        p.append(problem)
    p.need(c.calibration in CONVERSATION_SOURCES or Path(c.calibration).expanduser().is_file(), "calibration",
           c.calibration, f"must be one of {', '.join(CONVERSATION_SOURCES)} or an existing .jsonl of prompts")
    return p


def run(cfg: BuildTreeConfig) -> dict:
    """Load the heads, then measure, build and write the tree (``medusa_train.tree.size.fit_and_write``)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model, tokenizer = load_exported_draft(cfg.draft, cfg.model, cfg.device)
    return fit_and_write(cfg, model, tokenizer)


def main() -> None:
    """Entry point of ``medusa-train build-tree``."""
    from medusa_train.cli.entry import run_command

    run_command("build_tree", build_build_tree_config, run)

