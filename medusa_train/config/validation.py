"""The ``validation`` section (training, distill, build-tree): one validation set per prompt source.

A seeded sample of ``size`` first user turns of the prompt source, drawn from the whole source (so runs at any
``data.max_samples`` share it), held out before distilling and removed from every training set (each copy, by
normalised text). The backbone's greedy continuations of those prompts (``max_new_tokens``, untrimmed) are made once
and cached (``data/validation.py``); training walks its draft along them at every evaluation (tokens per step for a
K-chain and a fixed tree) and build-tree calibrates on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from medusa_train.config.check import Problems


@dataclass
class ValidationConfig:
    #: the conversations the prompts are drawn from; null: the prompt source of data.source (a distilled file's
    #: own source, named in its .stats.json; otherwise data.source itself)
    source: str | None = None
    size: int = 64  #: prompts held out (0: none, and no validation walk during training)
    seed: int = 0  #: which prompts: a seeded sample of the source's first user turns
    max_new_tokens: int = 128  #: greedy continuation per prompt (evaluate's generation.max_new_tokens)
    max_prompt_tokens: int = 256  #: longer prompts (after the chat template) are not walked (counted in the log)
    chains: list[int] = field(default_factory=lambda: [1, 2, 3, 4])  #: K-chains walked at each evaluation
    tree_nodes: int = 16  #: the fixed tree walked at each evaluation: the built-in default tree cut to this size
    top_k: int = 10  #: ranks measured per depth (the fixed tree uses ranks below it)


def check_validation(v: ValidationConfig, key: str = "validation") -> list[str]:
    p = Problems()
    p.need(v.size >= 0, f"{key}.size", v.size, "must be >= 0 (0: no validation set)")
    p.need(v.max_new_tokens >= 2, f"{key}.max_new_tokens", v.max_new_tokens, "must be >= 2")
    p.need(v.max_prompt_tokens >= 1, f"{key}.max_prompt_tokens", v.max_prompt_tokens, "must be >= 1")
    p.need(all(isinstance(k, int) and k >= 1 for k in v.chains), f"{key}.chains", v.chains, "must be K values >= 1")
    p.need(v.tree_nodes >= 1, f"{key}.tree_nodes", v.tree_nodes, "must be >= 1")
    p.need(v.top_k >= 2, f"{key}.top_k", v.top_k, "must be >= 2")
    return p
