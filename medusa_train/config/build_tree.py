"""Typed configuration of ``medusa-train build-tree`` (``configs/commands/build_tree.yaml``) and its range checks.

Checks that read the heads folder or look for the calibration file live with the command
(``medusa_train.cli.build_tree``), which runs them together with these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from medusa_train.config.check import Problems
from medusa_train.config.dtype import parse_dtype
from medusa_train.config.model import EvalModelConfig, check_decoder_attention
from medusa_train.config.paths import take_draft_alias


@dataclass
class BuildTreeConfig:
    draft: str | None = None  #: a draft folder: exported Medusa heads or an EAGLE-3 draft (``draft=`` also)
    heads: str | None = None  #: ``draft=``'s other name (config/paths.py ``DRAFT_ALIAS``)
    #: tree size, root included; auto: the size (up to max_nodes) with the most expected tokens per second,
    #: from a cost curve measured here, on this device and dtype (medusa_train/tree/cost.py)
    nodes: int | str = 64
    max_nodes: int = 128  #: with nodes=auto, the largest size considered
    #: with nodes=auto, cached tokens at which steps are timed; auto: a decode step's mean context when answering
    #: the evaluation's prompts (the ``exclude`` benchmark's first turns, else the calibration prompts, through the
    #: chat template) with ``answer_tokens`` new tokens: their mean length + answer_tokens / 2
    cost_context: int | str = "auto"
    answer_tokens: int = 128  #: with cost_context=auto, the answers' length (the evaluation's generation.max_new_tokens)
    cost_repeats: int = 10  #: with nodes=auto, timed rounds per size (the median counts)
    #: with nodes=auto, the first round screens the sizes: those past the biggest whose expected tokens/s there reaches
    #: the best size's / cost_screen are timed that once (tree/cost.py ``screened_sizes``); null: every size every round
    cost_screen: float | None = 2.0
    #: with nodes=auto, time the steps replayed from CUDA graphs over a static cache (what evaluate decodes with on
    #: CUDA, generation.cuda_graphs); null: on CUDA
    cuda_graphs: bool | None = None
    #: validation: the validation set of the heads' training data (their training_config.json's data.validation; the
    #: prompts held out of training, config/validation.py); or packaged:sharegpt-v3 (its first prompts the heads did not
    #: train on) or a .jsonl of prompts (not MT-Bench)
    calibration: str = "validation"
    num_prompts: int | None = None  #: calibration prompts (their first user turn); null: the whole validation set (else 16)
    max_new_tokens: int = 128  #: greedy continuation length per prompt (evaluate's generation.max_new_tokens)
    max_prompt_tokens: int = 256  #: longer prompts are passed over
    top_k: int = 10  #: ranks measured per head
    #: nodes of the tree's lookup chain (guesses copied from the text so far, medusa_train/decoding/lookup.py), part
    #: of ``nodes``; auto: the split of nodes between heads and lookup with the most expected tokens per second
    #: (nodes=auto) or per step (a fixed nodes), greedy decoding walked step by step over the calibration text, then
    #: checked by decoding (``guard_prompts``): the hybrid is kept only if it beats the draft alone and the lookup
    #: chain alone by ``guard_margin`` in tokens/s; 0: the draft alone
    lookup_depth: int | str = "auto"
    #: with lookup_depth=auto: validation prompts decoded with the hybrid, the draft alone and the lookup chain alone
    #: (interleaved, tokens/s here) before a hybrid is kept; 0: no guard (the walk's choice stands)
    guard_prompts: int = 16
    #: the guard sized to the machine: none of its prompts starts after this many minutes of its decoding (the first
    #: always does; every tree decodes the same prompts; the YAML's ``guard.prompts`` says how many). null: all
    guard_max_minutes: float | None = None
    guard_margin: float = 0.03  #: the hybrid must beat both by this share of tokens/s; within it the smaller tree wins
    lookup_max_depth: int = 8  #: with lookup_depth=auto, the longest chain considered
    lookup_ngram: list[int] = field(default_factory=lambda: [1, 3])  #: [shortest, longest] suffix lookup matches
    exclude: str | None = "packaged:mt-bench"  #: drop calibration prompts found in this benchmark (null: keep all)
    exclude_training_data: bool = True  #: drop prompts of the heads' training data (their training_config.json)
    output: str | None = None  #: tree YAML path; default outputs/trees/<heads name>-n<nodes>.yaml
    model: EvalModelConfig = field(default_factory=EvalModelConfig)
    device: str | None = None  #: default: cuda when available, else cpu
    threads: int | None = None  #: torch CPU threads (null = torch's default)


def check_build_tree_config(c: BuildTreeConfig) -> list[str]:
    """Range checks that need only the values; every problem names its key."""
    p = Problems()
    p += take_draft_alias(c)
    if not c.draft:
        p.append("draft: required; pass draft=<a draft folder: exported heads or an EAGLE-3 draft>")
    p.need(c.nodes == "auto" or (isinstance(c.nodes, int) and c.nodes >= 1), "nodes", c.nodes,
           "must be >= 1 (the root) or auto")
    p.need(c.max_nodes >= 1, "max_nodes", c.max_nodes, "must be >= 1")
    p.need(c.cost_context == "auto" or (isinstance(c.cost_context, int) and c.cost_context >= 1), "cost_context",
           c.cost_context, "must be >= 1 or auto")
    p.need(c.answer_tokens >= 0, "answer_tokens", c.answer_tokens, "must be >= 0")
    p.need(c.cost_repeats >= 1, "cost_repeats", c.cost_repeats, "must be >= 1")
    p.need(c.cost_screen is None or c.cost_screen >= 1, "cost_screen", c.cost_screen,
           "must be >= 1 (the share of the best expected tokens/s a size must reach, inverted) or null (no screen)")
    p.need(c.num_prompts is None or c.num_prompts >= 1, "num_prompts", c.num_prompts, "must be >= 1 or null (all)")
    p.need(c.guard_prompts >= 0, "guard_prompts", c.guard_prompts, "must be >= 0 (0: no guard)")
    p.need(c.guard_max_minutes is None or c.guard_max_minutes > 0, "guard_max_minutes", c.guard_max_minutes,
           "must be > 0 or null (no limit)")
    p.need(0 <= c.guard_margin < 1, "guard_margin", c.guard_margin, "must be in [0, 1)")
    p.need(c.max_new_tokens >= 4, "max_new_tokens", c.max_new_tokens, "must be >= 4")
    p.need(c.max_prompt_tokens >= 1, "max_prompt_tokens", c.max_prompt_tokens, "must be >= 1")
    p.need(c.top_k >= 1, "top_k", c.top_k, "must be >= 1")
    p.need(c.lookup_depth == "auto" or (isinstance(c.lookup_depth, int) and c.lookup_depth >= 0), "lookup_depth",
           c.lookup_depth, "must be >= 0 (0: no lookup chain) or auto")
    p.need(isinstance(c.lookup_depth, str) or c.nodes == "auto" or c.lookup_depth < c.nodes, "lookup_depth",
           c.lookup_depth, f"must leave the root among nodes={c.nodes}: at most {c.nodes - 1}"
           if isinstance(c.nodes, int) else "")
    p.need(c.lookup_max_depth >= 0, "lookup_max_depth", c.lookup_max_depth, "must be >= 0")
    p.need(len(c.lookup_ngram) == 2 and 1 <= c.lookup_ngram[0] <= c.lookup_ngram[1], "lookup_ngram",
           c.lookup_ngram, "must be [shortest, longest] with 1 <= shortest <= longest")
    p.need(c.calibration != c.exclude and "mt-bench" not in c.calibration, "calibration", c.calibration,
           "MT-Bench is the evaluation set; calibrate on other prompts (default: validation)")
    p.need(c.threads is None or c.threads >= 1, "threads", c.threads, "must be >= 1 or null")
    p += check_decoder_attention(c.model)
    parse_dtype(p, c.model, "model.dtype")
    return p
