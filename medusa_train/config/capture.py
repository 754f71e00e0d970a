"""Typed configuration of the capture stage (``medusa-train capture``): the sections of the training config it
reads, so ``medusa-train train`` with the same keys and ``data.cache_hidden_states=true`` finds what it wrote.

The command takes the training command's config (``configs/train.yaml`` and a recipe) and reads ``method``,
``model``, ``data``, the draft's settings (``heads`` or ``eagle3``: the method's family says which states it
reads, ``config/methods.py``) and ``trainer.mixed_precision`` of it; the rest is training's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from medusa_train.config.check import Problems, parse_config
from medusa_train.config.data import DataConfig, check_data
from medusa_train.config.dtype import parse_dtype
from medusa_train.config.methods import (
    DRAFT_SETTINGS,
    METHODS,
    draft_settings_problems,
    method_choices,
    with_draft_settings,
)
from medusa_train.config.model import ModelConfig, check_model


@with_draft_settings(after="data")  # each family's draft settings section (heads, eagle3: config/methods.py)
@dataclass
class CaptureConfig:
    """What the capture stage reads of the training config."""

    method: str = "medusa1"  #: a training method (``config/methods.py``): its family says which states are stored
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mixed_precision: str = "bfloat16"  #: the training config's trainer.mixed_precision (autocast while capturing)


#: the training config's keys the capture stage reads (``trainer.mixed_precision`` becomes ``mixed_precision``)
CAPTURE_SECTIONS = ("method", "model", "data", *DRAFT_SETTINGS)


def capture_view(train: Any) -> CaptureConfig:
    """The capture stage's view of a parsed training config (any object with its sections)."""
    return CaptureConfig(method=train.method, model=train.model, data=train.data,
                         mixed_precision=train.trainer.mixed_precision,
                         **{name: getattr(train, name) for name in DRAFT_SETTINGS})


def draft_settings(c) -> Any:
    """The section of config ``c`` (a training or capture config) holding the settings of the draft its method
    trains (``Method.settings``)."""
    return getattr(c, METHODS[c.method].settings)


def build_capture_config(raw: Any) -> CaptureConfig:
    """A validated ``CaptureConfig`` from the composed training config (a ``DictConfig`` or a plain dict)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(raw, DictConfig):
        raw = OmegaConf.to_container(raw, resolve=True)
    raw = dict(raw or {})
    picked = {key: raw[key] for key in CAPTURE_SECTIONS if key in raw}
    if "mixed_precision" in (raw.get("trainer") or {}):
        picked["mixed_precision"] = raw["trainer"]["mixed_precision"]
    return parse_config(CaptureConfig, picked, check_capture)


def check_capture(c: CaptureConfig) -> list[str]:
    """Problems of the sections capture reads, each naming its key."""
    p = Problems()
    p.need(c.method in METHODS, "method", c.method, method_choices())
    p += check_model(c.model)
    p += check_placement(c.model)
    p += check_data(c.data)
    p += draft_settings_problems(c)
    p += check_mixed_precision(c)
    return p


def check_placement(m: ModelConfig) -> list[str]:
    p = Problems()
    p.need(m.device_map in (None, "auto"), "model.device_map", m.device_map, "must be null or auto")
    return p


#: what autocast may run in: a dtype of ``config/dtype.py``'s one vocabulary (``model.dtype``'s), or ``no``
AUTOCAST_DTYPES = ("bfloat16", "float16")


def check_mixed_precision(section, attr: str = "mixed_precision") -> list[str]:
    """``trainer.mixed_precision`` of ``section``: ``no``, or a dtype spelled as ``model.dtype`` takes it (stored
    canonical: ``bf16`` -> ``bfloat16``)."""
    problems: list[str] = []
    if getattr(section, attr) != "no":
        parse_dtype(problems, section, "trainer.mixed_precision", attr, allowed=AUTOCAST_DTYPES)
    return [p.replace(": must be one of", ": must be no, or one of") for p in problems]
