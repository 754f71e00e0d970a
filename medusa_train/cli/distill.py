"""``medusa-train distill``: self-distilled training data, the backbone answering the training prompts itself.

    medusa-train distill num_prompts=400 generation.max_new_tokens=256
    medusa-train distill model.name_or_path=/path/to/hf/folder source=/path/to/chat.jsonl

Options: ``configs/commands/distill.yaml`` (schema: ``medusa_train.config.distill.DistillConfig``).
Re-running the same command continues an interrupted run.
"""

from __future__ import annotations

from medusa_train.cli.entry import run_command
from medusa_train.config.distill import build_distill_config
from medusa_train.data.distill.run import report


def main() -> None:
    """Hydra entry point: compose, check every key, then distill and print the summary line."""
    run_command("distill", build_distill_config, report)


if __name__ == "__main__":
    main()
