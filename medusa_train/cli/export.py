"""``medusa-train export``: convert a draft (heads or EAGLE-3 draft) to another checkpoint layout of its family's.

    medusa-train export draft=<heads dir> format=native|medusa_v1|vllm output=<dir>

Options: ``configs/commands/export.yaml`` (schema: ``medusa_train.config.export.ExportConfig``); the
work is ``medusa_train.export.write.export_folder``.
"""

from __future__ import annotations

import sys
from dataclasses import asdict

from medusa_train.config.check import parse_config
from medusa_train.config.export import ExportConfig, check_export_config
from medusa_train.config.paths import DRAFT_ALIAS


def build_export_config(raw) -> ExportConfig:
    """A validated ``ExportConfig``: required keys, the layout and its options, an ``output`` that may be
    written (absent, empty, or heads of ours: ``model.folder.output_problem``), every problem at once."""
    from medusa_train.export.write import option_problems
    from medusa_train.model.folder import output_problem

    def problems(c: ExportConfig) -> list[str]:
        found = check_export_config(c) + option_problems(c.format, c.lm_head_pt, c.max_paths, c.topk)
        return found + [p for p in [c.output and output_problem(c.output, "output")] if p]

    return parse_config(ExportConfig, raw, problems)


def serve_command_applies(path) -> bool:
    """Whether vLLM serves the folder written as it is (its family's served layout)."""
    from medusa_train.model.load import read_exported_draft

    return read_exported_draft(path).served_as_is


def run(cfg: ExportConfig) -> None:
    """Convert; a folder that cannot be converted exits with status 2 and says why."""
    from medusa_train.export.serve import serve_command
    from medusa_train.export.write import export_folder

    try:
        path = export_folder(**{k: v for k, v in asdict(cfg).items() if k != DRAFT_ALIAS})
    except (ValueError, FileNotFoundError) as err:
        print(err, file=sys.stderr)
        sys.exit(2)
    print(f"wrote {cfg.format} heads from {cfg.draft} to {path}")
    if serve_command_applies(path):
        print(serve_command(path, draft=cfg.draft))


def main() -> None:
    """Entry point of ``medusa-train export``."""
    from medusa_train.cli.entry import run_command

    run_command("export", build_export_config, run)
