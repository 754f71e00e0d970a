"""Typed configuration of ``medusa-train export`` (``configs/commands/export.yaml``).

The layout names and their options are checked by the command (``medusa_train.cli.export``) with
``export.write.option_problems``, together with the required keys checked here.
"""

from __future__ import annotations

from dataclasses import dataclass

from medusa_train.config.check import Problems
from medusa_train.config.dtype import parse_dtype
from medusa_train.config.paths import take_draft_alias


@dataclass
class ExportConfig:
    draft: str | None = None  #: a draft folder to convert, any layout (usually <trainer.output_dir>/export); ``draft=`` also
    heads: str | None = None  #: ``draft=``'s other name (config/paths.py ``DRAFT_ALIAS``)
    format: str | None = None  #: native | medusa_v1 (original Medusa / TensorRT-LLM) | vllm
    #: folder to write (a temporary one, then renamed); an existing one is replaced only if it holds heads of ours
    #: and nothing else (its serving.json kept), else refused: nothing of yours is deleted
    output: str | None = None
    lm_head_pt: bool = False  #: medusa_v1 only: also write medusa_lm_head.pt (what the original Medusa loader reads)
    max_paths: int = 64  #: vllm only: config.json max_paths
    topk: int = 10  #: vllm only: config.json topk
    model: str | None = None  #: backbone to load when the heads share its LM head (null: base_model_name_or_path)
    dtype: str | None = None  #: dtype of that backbone: float32 | bfloat16 | float16 (null: the heads' dtype)


def check_export_config(c: ExportConfig) -> list[str]:
    """The keys every export needs; every problem names its key."""
    p = Problems()
    p += take_draft_alias(c)
    for key, hint in (("draft", "<a draft folder to convert>"), ("format", "native|medusa_v1|vllm"),
                      ("output", "<folder to write>")):
        if not getattr(c, key):
            p.append(f"{key}: required; pass {key}={hint}")
    parse_dtype(p, c, "dtype", optional=True)
    return p
