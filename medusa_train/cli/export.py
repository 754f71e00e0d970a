"""``scripts/export.py``: convert Medusa heads to another checkpoint layout.

    python scripts/export.py heads=<heads dir> format=native|medusa_v1|vllm output=<dir>

Options: ``configs/commands/export.yaml`` (schema: ``medusa_train.config.export.ExportConfig``); the
work is ``medusa_train.model.export.export_folder``.
"""

from __future__ import annotations

import sys
from dataclasses import asdict

from medusa_train.config.check import parse_config
from medusa_train.config.export import ExportConfig, check_export_config


def build_export_config(raw) -> ExportConfig:
    """A validated ``ExportConfig``: required keys, the layout and its options, every problem at once."""
    from medusa_train.model.export import option_problems

    return parse_config(ExportConfig, raw, lambda c: check_export_config(c) + option_problems(
        c.format, c.lm_head_pt, c.max_paths, c.topk))


def run(cfg: ExportConfig) -> None:
    """Convert; a folder that cannot be converted exits with status 2 and says why."""
    from medusa_train.model.export import export_folder

    try:
        path = export_folder(**asdict(cfg))
    except (ValueError, FileNotFoundError) as err:
        print(err, file=sys.stderr)
        sys.exit(2)
    print(f"wrote {cfg.format} heads from {cfg.heads} to {path}")
    if cfg.format == "vllm":
        print("serve it with vLLM (K tokens proposed per step, at most the number of heads):\n"
              + serve_command(path))


def serve_command(path) -> str:
    """The ``vllm serve`` line for a vllm export: its base model and ``--speculative-config`` JSON."""
    import json
    from pathlib import Path

    config = json.loads((Path(path) / "config.json").read_text())
    heads = config.get("num_heads") or config.get("medusa_num_heads")
    spec = {"method": "medusa", "model": str(Path(path).resolve()), "num_speculative_tokens": heads}
    base = config.get("base_model_name_or_path") or "<base model>"
    return f"vllm serve {base} --speculative-config '{json.dumps(spec)}'"


def main() -> None:
    """Entry point of ``scripts/export.py``."""
    from medusa_train.cli.entry import run_command

    run_command("export", build_export_config, run)
