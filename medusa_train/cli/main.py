"""``medusa-train <command> [key=value ...]``: every stage of the pipeline from one installed command.

    medusa-train distill num_prompts=1000                         # self-distilled data
    medusa-train capture +recipe=medusa1 data.source=...          # the frozen backbone's states, once
    medusa-train train +recipe=medusa1 data.source=...            # Medusa heads (+recipe=medusa2: with QLoRA)
    medusa-train train +recipe=eagle3 data.source=...             # an EAGLE-3 draft (= accelerate launch train.py ...)
    medusa-train build-tree draft=outputs/medusa1/export nodes=auto
    medusa-train evaluate draft=outputs/medusa1/export
    medusa-train export draft=outputs/medusa1/export format=vllm output=outputs/medusa1/vllm
    medusa-train choose-k draft=outputs/medusa1/vllm dtype=bfloat16    # vLLM's K: one server per K, fastest kept
    medusa-train demo                                              # all of it on the packaged model

Each command composes its own configs (``configs/train.yaml`` for train and capture, ``configs/commands/<name>.yaml``
for the others, shipped inside the wheel) and takes Hydra overrides, ``--cfg job`` and ``--help`` included.
``python -m medusa_train <command>`` is the same; the checkout's ``train.py`` and ``scripts/*.py`` call the same code.
"""

from __future__ import annotations

import importlib
import sys

from medusa_train.config.commands import COMMANDS as TABLE

#: command -> (module whose ``main()`` runs it, what it does), from the one table of commands
COMMANDS: dict[str, tuple[str, str]] = {name: (c.module, c.what) for name, c in TABLE.items()}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return ("usage: medusa-train <command> [key=value ...]   (medusa-train <command> --help: its keys)\n\n"
            "commands:\n" + "\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    """Run ``argv[0]``'s command with the rest as its arguments (Hydra reads them from ``sys.argv``)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return
    if argv[0] not in COMMANDS:
        sys.exit(f"medusa-train: unknown command {argv[0]!r}\n\n{usage()}")
    module = importlib.import_module(COMMANDS[argv[0]][0])
    sys.argv = [f"medusa-train {argv[0]}", *argv[1:]]
    module.main()
