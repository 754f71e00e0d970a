"""The ``heads`` section of the training config: the Medusa heads family's settings (``+recipe=medusa1|medusa2``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from medusa_train.config.check import Problems


@dataclass
class HeadsConfig:
    num_heads: int = 4  #: Medusa heads; head k predicts the token k+2 ahead
    num_layers: int = 1  #: ResBlocks per head
    share_lm_head: bool = False  #: project through the frozen LM head instead of a trainable clone
    init_from: str | None = None  #: start from heads saved earlier (an export folder)
    next_token_input: bool = False  #: heads also read the base model's next token (native export only)
    path_input: bool = False  #: with next_token_input: head k reads the k+1 tokens of its tree path (Hydra-style)
    prefix_attention: bool = False  #: heads read through one causal attention layer over the prefix (native export only)
    #: heads score only the K most frequent training targets (a draft vocabulary, token_map); null: every token.
    #: The verify pass keeps the whole vocabulary, so greedy output is unchanged. Native and vllm export only.
    draft_vocab_size: int | None = None


def check_heads_settings(h: HeadsConfig) -> list[str]:
    """Problems of a ``heads`` section, each naming its key."""
    p = Problems()
    p.need(h.num_heads >= 1, "heads.num_heads", h.num_heads, "must be >= 1")
    p.need(h.num_layers >= 0, "heads.num_layers", h.num_layers, "must be >= 0")
    p.need(h.draft_vocab_size is None or h.draft_vocab_size >= 1, "heads.draft_vocab_size", h.draft_vocab_size,
           "must be >= 1 (the draft vocabulary's size), or null for the whole vocabulary")
    p.need(not h.next_token_input or h.num_layers >= 1, "heads.next_token_input", True,
           "the next token enters the first ResBlock: needs heads.num_layers >= 1")
    p.need(not h.path_input or h.next_token_input, "heads.path_input", True,
           "the path starts with the next token: needs heads.next_token_input=true")
    p.need(h.init_from is None or os.path.isdir(h.init_from), "heads.init_from", h.init_from,
           "must be an existing folder of exported heads")
    return p


def stage_problems(c) -> list[str]:
    """What Medusa-2's two stages need of a training config ``c``: stage 2 starts from stage 1's heads."""
    p = Problems()
    p.need(not (c.stage == 2 and not c.heads.init_from), "heads.init_from", None,
           "stage=2 starts from stage 1's heads: set heads.init_from=<stage-1 output_dir>/export")
    return p
