"""The one table of ``medusa-train``'s commands: each command's name, what it does, its config (the YAML it
composes and the schema behind it), its module in ``cli/`` and the pipeline step it runs. ``medusa-train --help``
(``cli/main.py``), the registered defaults (``config/compose.py``) and the layout test read it."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """One ``medusa-train <name>`` command (a row of ``COMMANDS``)."""

    name: str  #: what the user types
    what: str  #: one line for ``--help``
    config: str  #: the config it composes (``configs/train.yaml`` or ``configs/commands/<config>.yaml``)
    schema: str | None  #: ``module:Class`` of that config's schema (None: another command's, read in part)
    step: str | None  #: the pipeline step it runs (distill, capture, train, export, tree, evaluate; None: all)

    @property
    def module(self) -> str:
        """Its ``cli/`` module (whose ``main()`` runs it)."""
        return f"medusa_train.cli.{self.name.replace('-', '_')}"

    def schema_class(self) -> type:
        module, name = self.schema.split(":")
        return getattr(importlib.import_module(module), name)


COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("distill", "the backbone answers the training prompts (self-distilled data)", "distill",
            "medusa_train.config.distill:DistillConfig", "distill"),
    Command("capture", "run the frozen backbone once, store its hidden states", "train", None, "capture"),
    Command("train", "train a draft: +recipe=medusa1 | medusa2 (Medusa heads; medusa2 with QLoRA) | eagle3 (an "
            "EAGLE-3 draft)", "train", "medusa_train.config.train:TrainConfig", "train"),
    Command("build-tree", "fit a decoding tree to the draft, sized for this machine", "build_tree",
            "medusa_train.config.build_tree:BuildTreeConfig", "tree"),
    Command("evaluate", "accepted length, speedup and greedy parity (engine=vllm: served)", "evaluate",
            "medusa_train.config.evaluate:EvalConfig", "evaluate"),
    Command("export", "write the draft in another layout of its family's (vLLM, TensorRT-LLM, ours)", "export",
            "medusa_train.config.export:ExportConfig", "export"),
    Command("choose-k", "serve each vLLM K (num_speculative_tokens), keep the fastest (serving.json)", "choose_k",
            "medusa_train.config.choose_k:ChooseKConfig", "evaluate"),
    Command("demo", "distill -> train -> build-tree -> evaluate on the packaged model", "demo",
            "medusa_train.config.demo:DemoConfig", None),
)}
