"""Typed configuration of ``medusa-train choose-k`` (``configs/commands/choose_k.yaml``) and its range checks.

The check that needs the heads folder (how many heads there are: K above it fails to load in vLLM) is
``check_ks``, which the command (``medusa_train.cli.choose_k``) runs with the count it reads, together with these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from medusa_train.config.check import Problems
from medusa_train.config.dtype import parse_dtype
from medusa_train.config.engine import ServerConfig, check_server
from medusa_train.config.paths import take_draft_alias


@dataclass
class ChooseKConfig:
    #: a draft folder, any layout (not a vllm export: one is written to <draft>/../vllm-export-<dtype>); ``draft=`` also
    draft: str | None = None
    heads: str | None = None  #: ``draft=``'s other name (config/paths.py ``DRAFT_ALIAS``)
    model: str | None = None  #: base model to serve (null: the heads' base_model_name_or_path)
    dtype: str = "bfloat16"  #: float32 | bfloat16 | float16: the served dtype (the serve line repeats it)
    ks: list[int] | None = None  #: K values served, e.g. [0,1,2] (0 = no speculation; null: 0..heads)
    limit: int = 24  #: first turns sent to each server (greedy)
    #: the prompts: packaged:mt-bench, validation (the draft's validation prompts, held out of its training) or a .jsonl
    source: str = "packaged:mt-bench"
    max_tokens: int = 128  #: reply length per request
    concurrency: int = 8  #: the higher concurrency measured beside 1 (K is chosen at concurrency 1)
    #: also serve the engine's free baselines on the same prompts (n-gram; suffix decoding where the engine has it:
    #: ``bash scripts/suffix_env.sh``) and choose among every server, trained or not
    free: bool = True
    output: str | None = None  #: also write the result (serving.json's content) to this JSON file
    server: ServerConfig = field(default_factory=ServerConfig)  #: how each server is started


def check_choose_k_config(c: ChooseKConfig) -> list[str]:
    """Range checks that need only the values; every problem names its key."""
    p = Problems()
    p += take_draft_alias(c)
    if not c.draft:
        p.append("draft: required; pass draft=<a draft folder>")
    parse_dtype(p, c, "dtype")  # stored canonical: the export folder, vLLM's --dtype and the serve line use it
    p.need(c.limit >= 1, "limit", c.limit, "must be >= 1")
    p.need(c.max_tokens >= 1, "max_tokens", c.max_tokens, "must be >= 1")
    p.need(c.concurrency >= 1, "concurrency", c.concurrency, "must be >= 1")
    p.extend(check_server(c.server))
    return p


def check_ks(ks: list[int] | None, depth: int | None) -> list[str]:
    """``ks`` against the heads' count: whole numbers in 0..depth, at least one that speculates."""
    p = Problems()
    if ks is None:
        return p
    if not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in ks):
        p.need(False, "ks", ks, "must list whole numbers >= 0 (0 = no speculation), e.g. ks=[0,1,2]")
        return p
    p.need(any(k >= 1 for k in ks), "ks", ks, "must hold at least one K >= 1 to choose from")
    above = [k for k in ks if depth and k > depth]
    p.need(not above, "ks", ks, f"{above} above the heads' {depth} (vLLM fails to load more)")
    return p
