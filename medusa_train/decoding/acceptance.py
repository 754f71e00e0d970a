"""Choosing which tree candidates to keep, given the base model's logits at every tree node.

Every rule gets the candidate tokens of the tree nodes, ``tokens`` (num_nodes,), and the base
model's logits at those nodes, ``logits`` (num_nodes, vocab): ``logits[i]`` is the base model's
next-token distribution after the path root..i. The root (node 0) is already accepted: it is the
token the previous step decided. A rule returns the accepted root-to-node path and the token that
follows its last node (the next step's root).

- ``greedy``: a candidate is kept when it equals the argmax of its parent's logits. The output is
  token-identical to plain greedy decoding (lossless).
- ``typical``: Medusa's typical acceptance. A candidate is kept when its base probability exceeds
  ``min(threshold, alpha * exp(-entropy))`` of its parent's distribution; the longest kept path wins
  (ties: the most likely). Lossy: faster at temperature > 0 but not the base model's distribution.
- ``rejection``: recursive rejection sampling over the tree. At a node, its children (deterministic
  top-k drafts) are tried in rank order: child token x is kept with probability r(x) under the
  current residual r (initially the base distribution p); on rejection r(x) is set to 0 and r is
  renormalised. When every child is rejected (or there are none), the next token is drawn from r.
  Each emitted token is then distributed exactly as under plain sampling from the base model
  (lossless in law).

At ``temperature == 0`` every rule is greedy.

Every rule also takes ``valid`` (num_nodes,) bool, the nodes that hold a guess this step (``None``: all):
a lookup chain's nodes past what lookup found hold no guess and are never accepted, whatever token they
carry. A lookup token may equal a sibling head guess: greedy follows every matching child and keeps the
longest path (ties: the heads'); rejection sampling, having accepted a token, descends into the sibling
holding it whose guesses below reach deepest (a choice made from the drafts alone, so the law is kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from medusa_train.backbone.generation import sampling_probabilities
from medusa_train.decoding.tree import TokenTree

ACCEPTANCE_METHODS = ("greedy", "typical", "rejection")


@dataclass
class Acceptance:
    """Result of one acceptance decision.

    Attributes:
        path: Accepted node indices, root (0) first; ``len(path)`` tokens are gained.
        next_token: The token after the last accepted node (the next step's root).
    """

    path: list[int]
    next_token: int


# --------------------------------------------------------------------------------- sampling helpers
def probabilities(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """``softmax(logits / temperature)`` in float32, restricted to the top-p nucleus and renormalised.

    The nucleus keeps the most likely tokens until their mass reaches ``top_p`` (at least one token).
    """
    probs = sampling_probabilities(logits, temperature, top_p)
    return probs / probs.sum(-1, keepdim=True) if top_p < 1.0 else probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token id drawn from ``probs`` (vocab,)."""
    return int(torch.multinomial(probs, 1, generator=generator))


def first_token(logits: torch.Tensor, method: str, temperature: float, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> int:
    """The token after the prompt: argmax when greedy, else a sample of the base distribution."""
    if method == "greedy" or temperature == 0:
        return top_token(logits)
    return sample(probabilities(logits, temperature, top_p), generator)


def top_token(logits: torch.Tensor) -> int:
    """The argmax of one row of logits (vocab,). A bf16 or fp16 row is widened to float32 first (exactly: the same
    token, ties included): torch's CPU argmax over bf16 is ~4x slower than the conversion and a float32 argmax."""
    return int((logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits).argmax(-1))


class NodeArgmax:
    """Each tree node's greedy token, ``best[node]``. On a CPU a node's argmax is taken when first asked for: greedy
    acceptance reads only the nodes it walks (the accepted path, 2-3 of a 12-64 node tree), and each argmax reads
    a whole vocabulary row (12 bf16 rows of 49,152: 1.06 ms at once on the BF16 CPU, ~0.03 ms a row asked for).
    Elsewhere (a GPU) every row at once, in one launch and one transfer."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits
        self.rows: list[int] | None = None if logits.device.type == "cpu" else logits.argmax(-1).tolist()
        self.asked: dict[int, int] = {}

    def __getitem__(self, node: int) -> int:
        if self.rows is not None:
            return self.rows[node]
        if node not in self.asked:
            self.asked[node] = top_token(self.logits[node])
        return self.asked[node]


# --------------------------------------------------------------------------------- rules
def _usable(tree: TokenTree, valid: torch.Tensor | None) -> list[bool]:
    return [True] * tree.num_nodes if valid is None else [bool(v) for v in valid.tolist()]


def greedy_accept(tree: TokenTree, tokens: torch.Tensor, logits: torch.Tensor,
                  valid: torch.Tensor | None = None) -> Acceptance:
    """Keep candidates equal to their parent's argmax; where two children match (a lookup token equal to
    a head guess), the longer accepted path wins (ties: the first child, the heads')."""
    best = NodeArgmax(logits)
    tokens = tokens.tolist()
    usable = _usable(tree, valid)

    def longest(node: int) -> list[int]:
        path = [node]
        for child in tree.children[node]:
            if usable[child] and tokens[child] == best[node]:
                below = longest(child)
                if len(below) + 1 > len(path):
                    path = [node, *below]
        return path

    path = longest(0)
    return Acceptance(path, best[path[-1]])


def typical_accept(tree: TokenTree, tokens: torch.Tensor, logits: torch.Tensor, temperature: float,
                   top_p: float = 1.0, threshold: float = 0.09, alpha: float = 0.3,
                   generator: torch.Generator | None = None, valid: torch.Tensor | None = None) -> Acceptance:
    """Medusa's typical acceptance (lossy); the next token is sampled from the last accepted node."""
    probs = probabilities(logits, temperature)
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
    cutoff = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))
    parents = tree.parents.to(logits.device).clamp_min(0)
    candidate_probs = probs[parents, tokens]  # each node's probability under its parent
    kept = candidate_probs > cutoff[parents]
    if valid is not None:
        kept &= valid.to(kept.device)
    kept[0] = True
    paths = tree.retrieve_paths.to(logits.device)
    valid = paths >= 0
    safe = paths.clamp_min(0)
    on_path = (kept[safe] & valid).long().cumprod(-1).bool()
    lengths = on_path.sum(-1)
    score = (torch.log(candidate_probs.clamp_min(1e-30))[safe] * on_path).sum(-1)
    longest = lengths == lengths.max()
    row = int(torch.where(longest, score, torch.full_like(score, -float("inf"))).argmax())
    path = paths[row, : int(lengths[row])].tolist()
    return Acceptance(path, sample(probabilities(logits[path[-1]], temperature, top_p), generator))


def rejection_accept(tree: TokenTree, tokens: torch.Tensor, logits: torch.Tensor, temperature: float,
                     top_p: float = 1.0, generator: torch.Generator | None = None,
                     valid: torch.Tensor | None = None) -> Acceptance:
    """Recursive rejection sampling over deterministic drafts (lossless in law)."""
    tokens = tokens.tolist()
    usable = _usable(tree, valid)

    def reach(node: int) -> int:  # how deep the usable guesses below a node go
        return max((1 + reach(c) for c in tree.children[node] if usable[c]), default=0)

    node, path = 0, [0]
    while True:
        residual = probabilities(logits[node], temperature, top_p)
        for child in tree.children[node]:
            if not usable[child]:
                continue
            x = tokens[child]
            p_x = float(residual[x])
            if p_x > 0 and float(torch.rand((), generator=generator, device=residual.device)) < p_x:
                same = [c for c in tree.children[node] if usable[c] and tokens[c] == x]
                node = max(same, key=reach)  # the first of the deepest (x is accepted: which holds it is free)
                path.append(node)
                break
            residual[x] = 0.0
            residual = residual / residual.sum()  # sum is 1 - p_x > 0 since p_x < 1 here
        else:
            return Acceptance(path, sample(residual, generator))


def accept(method: str, tree: TokenTree, tokens: torch.Tensor, logits: torch.Tensor, temperature: float = 0.0,
           top_p: float = 1.0, typical_threshold: float = 0.09, typical_alpha: float = 0.3,
           generator: torch.Generator | None = None, valid: torch.Tensor | None = None) -> Acceptance:
    """Dispatch to the acceptance rule ``method`` (greedy when ``temperature == 0``); ``valid``: the nodes
    holding a guess this step (``None``: all)."""
    if method == "greedy" or temperature == 0:
        return greedy_accept(tree, tokens, logits, valid)
    if method == "typical":
        return typical_accept(tree, tokens, logits, temperature, top_p, typical_threshold, typical_alpha, generator,
                              valid)
    if method == "rejection":
        return rejection_accept(tree, tokens, logits, temperature, top_p, generator, valid)
    raise ValueError(f"acceptance={method!r}: must be one of {list(ACCEPTANCE_METHODS)}")
