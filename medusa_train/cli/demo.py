"""``medusa-train demo``: parse the command line and launch the demo's pipeline (``pipeline/demo.py``: its stages,
what each reads and writes, its key and its fallback)."""

from __future__ import annotations


def main() -> None:
    """Entry point: ``configs/commands/demo.yaml`` with the command line's ``key=value`` overrides."""
    from medusa_train.cli.entry import run_command
    from medusa_train.pipeline.demo import build, run

    run_command("demo", build, run)
