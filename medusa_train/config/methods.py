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
from dataclasses import dataclass, field, fields, make_dataclass

from medusa_train.config.check import one_of, table_row
from medusa_train.families.eagle3.settings import Eagle3Settings, check_eagle3_settings, eagle3_problems
from medusa_train.families.medusa.settings import HeadsConfig, check_heads_settings, stage_problems


@dataclass(frozen=True)
class DraftSettings:
    """A section of the training config holding one family's draft settings, a key the user sets by name
    (``heads.num_heads``, ``eagle3.ttt_steps``): its schema and its own checks, which training and capture run."""

    name: str  #: the section's key; ``Method.settings`` names the one a method's draft reads
    schema: type  #: its dataclass (defaults included)
    problems: Callable[[object], list[str]]  #: the section -> its problems, each naming its key


#: every draft settings section, each declared by its family's ``settings`` module
DRAFT_SETTINGS: dict[str, DraftSettings] = {s.name: s for s in (
    DraftSettings("heads", HeadsConfig, check_heads_settings),
    DraftSettings("eagle3", Eagle3Settings, check_eagle3_settings),
)}


def with_draft_settings(after: str) -> Callable[[type], type]:
    """A decorator: the config dataclass with one field per draft settings section (``DRAFT_SETTINGS``), defaulted,
    placed after its field ``after``: training's and capture's configs take every family's section, whichever the
    method reads."""
    def extend(cls: type) -> type:
        own = [(f.name, f.type, f) for f in fields(cls)]
        at = [name for name, _, _ in own].index(after) + 1
        drafts = [(s.name, s.schema, field(default_factory=s.schema)) for s in DRAFT_SETTINGS.values()]
        extended = make_dataclass(cls.__name__, own[:at] + drafts + own[at:], namespace={"__doc__": cls.__doc__})
        extended.__module__, extended.__qualname__ = cls.__module__, cls.__qualname__  # its annotations resolve there
        return extended

    return extend


def draft_settings_problems(c) -> list[str]:
    """Every draft settings section's problems in config ``c`` (a training or capture config)."""
    return [problem for s in DRAFT_SETTINGS.values() for problem in s.problems(getattr(c, s.name))]


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
    #: the module training its draft in ``medusa-train demo`` in stages of its own (``families/medusa/demo.py`` says
    #: what the pipeline asks of it); None: one train command
    demo_stages: str | None = None

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
           adapts_backbone=True, demo_settings_from="medusa1", problems=stage_problems,
           demo_stages="medusa_train.families.medusa.demo"),
    Method("eagle3", family="eagle3", recipe="medusa_train.families.eagle3.recipe:Eagle3Recipe", settings="eagle3",
           experiment="eagle3", problems=eagle3_problems),
    # P-EAGLE trains as EAGLE-3 does (its settings, its loss), each chained step a masked slot (families/peagle)
    Method("peagle", family="peagle", recipe="medusa_train.families.eagle3.recipe:Eagle3Recipe", settings="eagle3",
           experiment="eagle3", problems=eagle3_problems),
)}


def method_named(name: str) -> Method:
    """The row of ``name`` (a ``ValueError`` naming those there are when there is none)."""
    return table_row(METHODS, name, "method")


def method_choices() -> str:
    """``must be medusa1, medusa2, eagle3 or peagle``: the methods there are, for a message."""
    return one_of(METHODS)
