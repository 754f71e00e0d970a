"""Read Medusa heads from disk into ``(MedusaConfig, {native key: tensor})``.

One reader for every layout we know; the layout is detected from ``config.json`` (and the
tensor names), never guessed from a model name. Writers live in ``export.py``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors.torch import load_file

FORMAT_VERSION = 1
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


@dataclass
class MedusaConfig:
    """What a set of heads needs to be rebuilt and attached to its backbone.

    Attributes:
        num_heads: Number of Medusa heads; head k (0-based) predicts the token k+2 ahead.
        num_layers: ResBlocks per head.
        hidden_size: Backbone hidden size the heads read.
        vocab_size: Output vocabulary of every head.
        share_lm_head: Heads project through the backbone's frozen LM head instead of their own.
        base_model_name_or_path: The backbone these heads were trained on.
        dtype: Dtype the head weights were saved in.
        format_version: Version of this layout.
    """

    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    share_lm_head: bool = False
    base_model_name_or_path: str | None = None
    dtype: str = "float32"
    format_version: int = FORMAT_VERSION

    def to_dict(self) -> dict:
        return {"format": "medusa_train", **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> MedusaConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})




def detect_format(config: dict) -> str:
    """``native`` | ``medusa_v1`` | ``vllm`` from a heads folder's ``config.json``."""
    if config.get("format") == "medusa_train":
        return "native"
    if config.get("model_type") == "medusa" or "MedusaModel" in config.get("architectures", []):
        return "vllm"
    if "medusa_num_heads" in config:
        return "medusa_v1"
    raise ValueError("config.json is not a Medusa heads config we know (native, medusa_v1 or vllm)")


def read_heads(directory: str | os.PathLike) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    """Read a heads folder in any supported layout, returning native-keyed tensors."""
    directory = Path(directory)
    config_path = directory / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: is {directory} a folder of exported heads?")
    raw = json.loads(config_path.read_text())
    layout = detect_format(raw)
    if layout != "native":
        from . import export

        return export.read_foreign(directory, raw, layout)
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} not found")
    return MedusaConfig.from_dict(raw), load_file(str(weights))
