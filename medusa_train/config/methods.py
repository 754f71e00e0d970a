"""The one table of training methods: ``+recipe=<name>`` -> the draft family it trains, its recipe, the config
section holding the draft's settings, and what sets it apart. Training, capture, the demo and the config checks read
it; nothing else names a method.

A method is not a family: Medusa-1 and Medusa-2 train the same family (Medusa heads, ``model/family.py``), one on a
frozen backbone, the other with a LoRA-adapted 4-bit one. A new method is one row here, a recipe
(``training/<name>.py``: setup / train / evaluate / cleanup) and a preset (``configs/recipe/<name>.yaml``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from medusa_train.config.check import one_of, table_row
from medusa_train.families.eagle3.settings import eagle3_problems


@dataclass(frozen=True)
class Method:
    """One training method (a row of ``METHODS``)."""

    name: str  #: what ``+recipe=`` and ``method`` say
    family: str  #: the draft family it trains (``model.family.FAMILIES``)
    recipe: str  #: ``module:Class`` of its recipe, imported when a run starts (peft and bitsandbytes only then)
    settings: str  #: the training config's section holding the draft's own settings
    #: the backbone trains too (LoRA on a 4-bit backbone, ``stage=1|2``): nothing that needs a frozen backbone
    #: (greedy targets, captured states) applies after stage 1
    adapts_backbone: bool = False
    experiment: str | None = None  #: the preset the demo trains it with, when it needs its own (``train.experiment``)
    #: the method whose composed settings key the demo's run and give the epochs its stages split (None: its own)
    demo_settings_from: str | None = None
    problems: Callable[[object], list[str]] | None = None  #: its own checks of a training config

    def recipe_class(self) -> type:
        """The recipe class, imported now."""
        module, name = self.recipe.split(":")
        return getattr(importlib.import_module(module), name)

    def trains_backbone(self, stage: int | None) -> bool:
        """Whether the backbone moves in this run (Medusa-2's stage 1 trains the heads alone on it)."""
        return self.adapts_backbone and stage != 1


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("medusa1", family="medusa", recipe="medusa_train.families.medusa.recipe_medusa1:Medusa1Recipe", settings="heads"),
    Method("medusa2", family="medusa", recipe="medusa_train.families.medusa.recipe_medusa2:Medusa2Recipe", settings="heads",
           adapts_backbone=True, demo_settings_from="medusa1"),
    Method("eagle3", family="eagle3", recipe="medusa_train.families.eagle3.recipe:Eagle3Recipe", settings="eagle3",
           experiment="eagle3", problems=eagle3_problems),
)}


def method_named(name: str) -> Method:
    """The row of ``name`` (a ``ValueError`` naming those there are when there is none)."""
    return table_row(METHODS, name, "method")


def method_choices() -> str:
    """``must be medusa1, medusa2 or eagle3``: the methods there are, for a message."""
    return one_of(METHODS)
