"""A draft vocabulary: heads that score only the K tokens most often trained on (``heads.draft_vocab_size=K``).

Each head's output layer then has K rows instead of the whole vocabulary's (a shared LM head is read
through the K rows of the backbone's), so guessing costs K / vocab of the full projection. Head output
``i`` is token ``token_map[i]``; a token outside the K is never guessed, and the verify pass keeps
the whole vocabulary, so greedy output is the backbone's either way. vLLM's Medusa loader reads the
same thing (``truncated_vocab_size`` + a ``token_map`` tensor); EAGLE-3 calls it a draft vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from medusa_train.backbone.rows import RowLinear, step_linear


def label_counts(labels: Iterable, vocab_size: int) -> torch.Tensor:
    """How often each token is a target in ``labels`` (rows of token ids; negatives such as the ignore index are
    not counted): a (vocab_size,) long tensor."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in labels:
        row = torch.as_tensor(row, dtype=torch.long).flatten()
        row = row[row >= 0]
        if len(row) and int(row.max()) >= vocab_size:
            raise ValueError(f"a label {int(row.max())} lies outside the backbone's {vocab_size}-token vocabulary")
        counts += torch.bincount(row, minlength=vocab_size)
    return counts


def top_tokens(counts: torch.Tensor, size: int, key: str = "heads.draft_vocab_size") -> torch.Tensor:
    """The ``size`` most counted tokens as a sorted (size,) long tensor; ties go to the lower id, so the same data
    always gives the same map, and tokens never seen fill it up when fewer than ``size`` were counted."""
    if not 0 < size < len(counts):
        raise ValueError(f"{key}={size}: a draft vocabulary must be between 1 and the backbone's "
                         f"{len(counts) - 1} tokens")
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:size].sort().values


def most_frequent_tokens(labels: Iterable, size: int, vocab_size: int,
                         key: str = "heads.draft_vocab_size") -> torch.Tensor:
    """The ``size`` tokens most often trained on in ``labels`` (label rows), as a sorted (size,) long tensor
    (``key``: the setting a bad size is reported under)."""
    return top_tokens(label_counts(labels, vocab_size), size, key)


#: ``eagle3.draft_vocab_size=auto`` tries powers of two from this one below the vocabulary, and the whole vocabulary
AUTO_SMALLEST = 64
#: the chance that a trained draft's first guess is accepted when the backbone's token is one it can name, assumed
#: when sizing its vocabulary before training: the choice weighs what coverage buys (this times the coverage) against
#: what a bigger output layer costs each step. Our drafts at the demo's data budget reach about 0.3, drafts trained
#: on 100x the data 0.7-0.8; over 0.3-0.8 the choice moved by one size on the demo's data (SmolLM2, 49,152 tokens:
#: 4,096 at 0.3, 8,192 at 0.6 and 0.8); on a 262,144-token vocabulary the whole one loses at any acceptance
#: (docs/results.md#eagle-3-drafts-for-big-vocabularies)
IN_VOCAB_ACCEPTANCE = 0.6


@dataclass(frozen=True)
class VocabOption:
    """One draft vocabulary size weighed by ``choose_draft_vocab``."""

    size: int
    coverage: float  #: share of the training targets inside the ``size`` most frequent tokens
    step_share: float  #: weights one draft step reads, as a share of what a plain backbone step reads
    score: float  #: (1 + acceptance * coverage) / (1 + step_share): tokens per unit of step cost at K=1, relative


def choose_draft_vocab(counts: torch.Tensor, hidden_size: int, draft_weights: int, plain_weights: int,
                       acceptance: float = IN_VOCAB_ACCEPTANCE) -> tuple[int, list[VocabOption]]:
    """The draft vocabulary size worth most at K=1, and every size weighed.

    A decode step at K=1 runs one draft step and a verify pass; a draft step reads the draft layer's weights
    (``draft_weights``, its output layer left out) and ``size`` rows of its output layer (``hidden_size`` each), a
    plain step the backbone's (``plain_weights``): at the small batches drafting is for, steps cost what they read
    (measured: docs/results.md#eagle-3-drafts-for-big-vocabularies). The first token is accepted only when the
    backbone's is inside the vocabulary (``coverage``, measured on ``counts``, the training targets). The size with
    the highest ``(1 + acceptance * coverage) / (1 + step_share)`` wins; ties go to the smaller.

    Returns:
        ``(size, options)``: ``size`` equals the vocabulary when the whole one wins.
    """
    vocab = len(counts)
    total = int(counts.sum())
    if total == 0:
        raise ValueError("no training targets to measure a draft vocabulary's coverage on")
    covered = torch.sort(counts, descending=True).values.cumsum(0)
    sizes = [vocab]
    while sizes[0] > AUTO_SMALLEST:  # halving from the vocabulary's power of two below it
        sizes.insert(0, 1 << ((sizes[0] - 1).bit_length() - 1))
    options = []
    for size in sizes:
        coverage = int(covered[size - 1]) / total
        share = (draft_weights + size * hidden_size) / plain_weights
        options.append(VocabOption(size, coverage, share, (1 + acceptance * coverage) / (1 + share)))
    best = max(options, key=lambda o: (round(o.score, 9), -o.size))
    return best.size, options


def step_weights(config) -> int:
    """The weights one plain decode step of a backbone with ``config`` reads: every parameter but the input
    embedding's (one row of it is read), the LM head whole (counted from an empty model: no memory, any family)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # a tied LM head is counted once, as it is read once
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or embedding.weight is not head.weight:
        total -= embedding.weight.numel()
    return total


class DraftVocab(nn.Module):
    """The draft vocabulary's ``token_map`` (a buffer) and the lookups the heads' users need.

    What is derived from the map (the inverse index, the LM head's rows) is kept between calls while
    the map and the LM head are unchanged, so a decode step gathers nothing anew.
    """

    def __init__(self, token_map: torch.Tensor, vocab_size: int):
        super().__init__()
        token_map = torch.as_tensor(token_map, dtype=torch.long)
        if token_map.dim() != 1 or not len(token_map):
            raise ValueError(f"token_map has shape {tuple(token_map.shape)}: it must list K >= 1 token ids")
        if int(token_map.min()) < 0 or int(token_map.max()) >= vocab_size or len(token_map.unique()) != len(token_map):
            raise ValueError(f"token_map must list distinct token ids below {vocab_size}")
        self.vocab_size = vocab_size
        self.token_map: torch.Tensor
        self.register_buffer("token_map", token_map)
        self._index: tuple[tuple, torch.Tensor] | None = None
        self._rows: tuple[tuple, torch.Tensor, torch.Tensor | None] | None = None

    @classmethod
    def for_config(cls, config, token_map: torch.Tensor | None, device) -> DraftVocab | None:
        """The draft vocabulary of heads described by ``config`` (a ``MedusaConfig``), on ``device``; without
        ``token_map`` a placeholder that loading the heads overwrites; ``None`` when they have none."""
        if not config.draft_vocab_size:
            if token_map is not None:
                raise ValueError("a token_map was given for heads without a draft vocabulary (draft_vocab_size)")
            return None
        if token_map is None:
            token_map = torch.arange(config.draft_vocab_size)
        if len(token_map) != config.draft_vocab_size:
            raise ValueError(f"token_map lists {len(token_map)} tokens, the draft vocabulary {config.draft_vocab_size}")
        return cls(token_map, config.vocab_size).to(device)

    def __len__(self) -> int:
        return len(self.token_map)

    def _map_key(self) -> tuple:
        return self.token_map.data_ptr(), self.token_map._version, self.token_map.device

    def tokens(self, indices: torch.Tensor) -> torch.Tensor:
        """Token ids of head outputs ``indices``."""
        return self.token_map[indices]

    def indices(self, tokens: torch.Tensor) -> torch.Tensor:
        """Each token's head output index, -1 outside the map (negative tokens included)."""
        if self._index is None or self._index[0] != self._map_key():
            index = torch.full((self.vocab_size,), -1, dtype=torch.long, device=self.token_map.device)
            index[self.token_map] = torch.arange(len(self.token_map), device=self.token_map.device)
            self._index = (self._map_key(), index)
        index = self._index[1]
        found = index[tokens.clamp(min=0).to(index.device)].to(tokens.device)
        return torch.where(tokens >= 0, found, -1)

    def rows(self, lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM head's weight rows (and bias) of the map's tokens; a trainable LM head's are gathered
        through autograd each call, a frozen one's (every recipe's) once."""
        weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
        if weight.requires_grad:
            return weight[self.token_map], None if bias is None else bias[self.token_map]
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device, self._map_key())
        if self._rows is None or self._rows[0] != key:
            self._rows = (key, weight.detach()[self.token_map],
                          None if bias is None else bias.detach()[self.token_map])
        return self._rows[1], self._rows[2]

    def project(self, features: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """``lm_head`` over ``features``, restricted to the map's tokens: (..., K) logits."""
        weight, bias = self.rows(lm_head)
        features = features.to(weight.dtype)
        if type(lm_head) is RowLinear and not lm_head.weight.requires_grad:  # a frozen LM head's rows, gathered
            logits = step_linear(features, weight, bias, self.__dict__)  # once: a step's few rows take the kernel
            if logits is not None:
                return logits
        return nn.functional.linear(features, weight, bias)

