"""The one table of draft families: each is declared here once, and resolved by name or by a folder's ``config.json``.

Loading, export, choose-k, capture and the demo ask this table (and training's ``config/methods.py``, which maps a
training method to a family); nothing else branches on a family. What each family provides is the contract in
``model/contract.py``. A new family (MTP, P-EAGLE, DFlash) is a folder ``families/<name>/`` (its settings, config and
model classes, a ``detect`` of its ``config.json``, its layouts' converter, its recipe and loss), a row here, a row per
method in ``config/methods.py`` (and its settings section there) and an oracle in ``tests/model/test_families.py``,
which then runs it through train, export, load and decode.

    family, layout = family_of(read_config_json(folder))   # which family a folder holds, in which layout
    family.model_class().from_pretrained(folder, backbone=backbone)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from medusa_train.config.check import table_row
from medusa_train.families.eagle3.config import Eagle3Config, eagle3_captured, eagle3_layout
from medusa_train.families.medusa.config import MedusaConfig
from medusa_train.families.medusa.layouts import MEDUSA_FILES, medusa_layout
from medusa_train.families.peagle.config import PEagleConfig, peagle_layout
from medusa_train.model.contract import CapturedStates, final_hidden_states


@dataclass(frozen=True)
class Family:
    """One draft family (a row of ``FAMILIES``)."""

    name: str  #: what ``Method.family`` names
    config: type  #: its config class (``contract.DraftConfig``)
    model: str  #: ``module:Class`` of its model (``contract.DraftModel``), imported when first asked for
    #: the layouts it writes (``medusa-train export format=``); the first is its native one
    layouts: tuple[str, ...]
    served_layout: str  #: the layout vLLM loads as it is
    chains_any_k: bool  #: vLLM serves it as a chain of any K (else K is at most its depth: vLLM builds K heads)
    detect: Callable[[dict], str | None]  #: a ``config.json`` -> the layout it is in, or None when not this family's
    captured: Callable[[Any], CapturedStates]  #: its settings section -> what a capture stores for it
    #: ``module:function`` converting a folder of it to one of its layouts: ``(source, output, format, **options)``
    converter: str
    files: tuple[str, ...] = ()  #: the files its layouts write besides config.json and model.safetensors
    #: ``module:function`` checking ``medusa-train export``'s options for its layouts: ``(format or None, lm_head_pt,
    #: max_paths, topk) -> [problem naming the option]`` (None: it takes none of them)
    options: str | None = None

    def convert_folder(self, source, output, format: str, **options):
        """Write the folder ``source`` (any of its layouts) as ``format``, one of ``layouts``."""
        return _imported(self.converter)(source, output, format, **options)

    def model_class(self) -> type:
        """The model class, imported now."""
        return _imported(self.model)

    def option_problems(self, format: str | None, lm_head_pt: bool, max_paths: int, topk: int) -> list[str]:
        """What is wrong with the export options for its layouts (``format`` not one of them: only the rest)."""
        if self.options is None:
            return []
        return _imported(self.options)(format if format in self.layouts else None, lm_head_pt, max_paths, topk)

    @property
    def vllm_method(self) -> str:
        """vLLM's ``--speculative-config`` method that serves it."""
        return self.config.vllm_method

    @property
    def draft_name(self) -> str:
        """What it is called in messages and reports."""
        return self.config.draft_name

    def serves_as_is(self, layout: str) -> bool:
        """Whether vLLM loads a folder in ``layout`` as it is."""
        return layout == self.served_layout

    def depth_in(self, config: dict) -> int | None:
        """Its default depth (tokens drafted a step) as a ``config.json`` of any of its layouts states it."""
        return self.config.depth_in(config)


def _imported(reference: str):
    """What a ``module:name`` reference names, imported now."""
    module, name = reference.split(":")
    return getattr(importlib.import_module(module), name)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("medusa", config=MedusaConfig, model="medusa_train.families.medusa.model:MedusaModel",
           layouts=("native", "medusa_v1", "vllm"), served_layout="vllm", chains_any_k=False, detect=medusa_layout,
           captured=lambda settings: CapturedStates(final_hidden_states),
           converter="medusa_train.families.medusa.export:export_medusa_folder", files=MEDUSA_FILES,
           options="medusa_train.families.medusa.export:option_problems"),
    # before eagle3: a P-EAGLE folder is an EAGLE-3 folder plus a mask token, which eagle3's detect would also take
    Family("peagle", config=PEagleConfig, model="medusa_train.families.peagle.model:PEagleModel",
           layouts=("native", "vllm"), served_layout="vllm", chains_any_k=False, detect=peagle_layout,
           captured=eagle3_captured, converter="medusa_train.families.peagle.model:export_peagle_folder"),
    Family("eagle3", config=Eagle3Config, model="medusa_train.families.eagle3.model:Eagle3Model",
           layouts=("native", "vllm"), served_layout="vllm", chains_any_k=True, detect=eagle3_layout,
           captured=eagle3_captured, converter="medusa_train.families.eagle3.model:export_eagle3_folder"),
)}

#: every layout some family writes: what ``format=`` may say
LAYOUTS: tuple[str, ...] = tuple(dict.fromkeys(layout for f in FAMILIES.values() for layout in f.layouts))


def family_named(name: str) -> Family:
    """The family called ``name`` (a ``ValueError`` naming those there are when there is none)."""
    return table_row(FAMILIES, name, "draft family")


def family_of(config: dict) -> tuple[Family, str]:
    """``(family, layout)`` of a folder's ``config.json``, as stored (any layout of any family).

    Raises:
        ValueError: no family recognises it.
    """
    for family in FAMILIES.values():
        layout = family.detect(config)
        if layout is not None:
            return family, layout
    known = "; ".join(f"{f.config.draft_name} ({', '.join(f.layouts)})" for f in FAMILIES.values())
    raise ValueError(f"config.json is not a draft we know: {known}")


def family_of_method(method: str) -> Family:
    """The family training method ``method`` trains (``config/methods.py``)."""
    from medusa_train.config.methods import method_named

    return family_named(method_named(method).family)


def captured_for(cfg) -> CapturedStates:
    """What a capture stores for training or capture config ``cfg``: its method's family, given the draft's settings
    section (``config.capture.draft_settings``)."""
    from medusa_train.config.capture import draft_settings

    return family_of_method(cfg.method).captured(draft_settings(cfg))


def family_of_config(config) -> Family:
    """The family of a draft config object (by its class: its own first, then one it derives from, as a variant's
    config derives from its family's: P-EAGLE's from EAGLE-3's)."""
    for family in FAMILIES.values():
        if type(config) is family.config:
            return family
    for family in FAMILIES.values():
        if isinstance(config, family.config):
            return family
    raise ValueError(f"{type(config).__name__} is no registered draft family's config")


def family_of_model(model) -> Family:
    """The family of a loaded draft model (by its config's class)."""
    return family_of_config(model.config)


def layout_problem(family: Family, config, layout: str) -> str | None:
    """Why ``layout`` cannot hold a draft of ``family`` with ``config``, with what to change (None: it can)."""
    if layout not in family.layouts:
        return (f"{family.draft_name} {'have' if family.draft_name.endswith('s') else 'has'} no {layout} layout "
                f"(written as {' or '.join(family.layouts)})")
    return config.layout_problem(layout)

