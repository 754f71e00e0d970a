"""What an EAGLE-3 draft keeps between decode steps of one sequence: eagerly (``Eagle3DecodeState``), or over fixed
buffers, and on CUDA its passes replayed from CUDA graphs (``Eagle3StaticState``).

``Eagle3DecodeState`` keeps the draft layer's keys and values in an ``AppendingLayer``; ``Eagle3Model.propose`` reads
the verified positions into it and drafts the tree after them (``model.py``). ``Eagle3StaticState`` holds them in
rooms as long as the backbone's static cache (``model/draft_state.py``: the rooms' length on the device, the graphs),
so a step's two passes read and write the same buffers:

- the read: the positions verified since the last step, each with the token after it (the root for the last),
  through the draft layer into the rooms; the last row's output and pre-norm sum kept in place (what depth 1 reads);
  one graph per count of verified positions;
- the tree: depth by depth, the nodes with children drafted at once at ``length - 1 + depth``, their keys and values
  written after the verified positions (the shallower nodes' first), each seeing the verified positions and its own
  drafted ancestors, every node's scores and pre-norm sum kept in a buffer of a row per node; one graph per tree.

The same attention as the eager draft's (SDPA over the keys a node sees, the rest masked), so the same guesses up to
rounding (tested against the eager state on the CPU, ``tests/decoding/test_static_drafts.py``; graphed on a GPU,
``tests/gpu/test_graphs.py``). A P-EAGLE draft's single masked pass keeps the eager state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from medusa_train.backbone.appending_cache import AppendingLayer
from medusa_train.model.draft_state import StaticDraftState


@dataclass
class Eagle3DecodeState:
    """The draft's keys and values at the verified positions of one sequence (opaque to callers), written in place
    (``AppendingLayer``): a step copies its own positions, never the ones before; a tree's drafted nodes are written
    after them for the step and dropped at its end."""

    cache: AppendingLayer = field(default_factory=AppendingLayer)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def propose(self, model, tree, accepted_inputs: torch.Tensor, accepted_tokens: torch.Tensor,
                root_token: int) -> torch.Tensor:
        """``Eagle3Model.propose`` over this cache (``model.eager_proposal``)."""
        return model.eager_proposal(tree, accepted_inputs, accepted_tokens, root_token, self)

    def rewind(self, length: int) -> None:
        """Forget every position after the first ``length`` (a benchmark repeating one step)."""
        self.cache.keep(length)

    def reset(self) -> None:
        """Empty, for the next sequence."""
        self.cache = AppendingLayer()


class Eagle3StaticState(StaticDraftState):
    """``Eagle3DecodeState``'s answers (``propose``, ``rewind``, ``reset``) over buffers fixed for ``room`` positions
    (``model/draft_state.py``); with ``graphs`` (CUDA) each pass captured once and replayed."""

    what = "EAGLE-3 draft"

    def __init__(self, model, room: int, graphs: bool = False, warmup: int = 2):
        weight = model.draft.fc.weight
        super().__init__(weight.device, room, graphs, warmup)
        self.model, c = model, model.draft.config
        shape = (1, c.num_key_value_heads, room, c.head_dim)
        self.key_room = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.value_room = torch.zeros_like(self.key_room)
        self.normed = self.prenorm = None  # (1, H): the last verified row's output and pre-norm sum
        self.plans: dict[tuple, list] = {}  # a tree's choices -> per depth, what its drafted nodes read (``_plan``)

    def propose(self, model, tree, accepted_inputs: torch.Tensor, accepted_tokens: torch.Tensor,
                root_token: int) -> torch.Tensor:
        """(num_nodes,) the tree's tokens, as ``Eagle3Model.eager_proposal`` drafts them (``model``: the one this
        state was made for, ``self.model``)."""
        self.root.fill_(root_token)
        drafted = sum(len(parents) for parents, *_ in tree.levels[1:])
        self.read_positions(accepted_inputs, accepted_tokens.to(self.root.device).long().reshape(-1), drafted=drafted)
        if tree.depth == 0:
            return torch.tensor([root_token] + [0] * (tree.num_nodes - 1), device=self.root.device)
        self._plan(tree)  # made before any capture (a graph cannot copy from the host)
        return self.tree_tokens(tree, lambda: self._draft(tree))

    def _read(self, inputs: torch.Tensor, tokens: torch.Tensor) -> None:
        """The verified positions through the draft layer into the rooms, each with the token after it; the last
        row's output and pre-norm sum kept in place; ``length`` advanced on the device."""
        model, device = self.model, self.root.device
        draft = model.draft
        after = torch.cat([tokens[1:], self.root[None]])
        positions = self.length + torch.arange(len(after), device=device)
        q, k, v, residual = draft.qkv(model._embed(after)[None], draft.features(inputs)[None], positions[None])
        self.key_room.index_copy_(2, positions, k)
        self.value_room.index_copy_(2, positions, v)
        allowed = torch.arange(self.room, device=device) <= positions[:, None]
        normed, prenorm = draft.finish(model._attend(q, self.key_room, self.value_room, allowed), residual)
        if self.normed is None:
            self.normed, self.prenorm = normed[0, -1:].clone(), prenorm[0, -1:].clone()
        else:
            self.normed.copy_(normed[0, -1:])
            self.prenorm.copy_(prenorm[0, -1:])
        self.length.add_(len(after))

    def _kept(self) -> tuple[torch.Tensor, ...]:
        return self.normed, self.prenorm

    def _plan(self, tree) -> list:
        """Per depth d > 0 of ``tree``, on the device: the rows its drafted nodes read their features from (their
        parents'), where their slots start after the verified positions, and which drafted nodes each sees."""
        key = tuple(tree.choices)
        if key not in self.plans:
            device, plan, drafted = self.root.device, [None], []
            for parents, *_ in tree.levels[1:]:
                offset = len(drafted)
                drafted += parents.tolist()
                sees = tree.visibility[parents][:, drafted]  # ancestors-or-self among the drafted, in slot order
                plan.append((tree.parents[parents].to(device), offset, sees.to(device),
                             torch.arange(len(drafted), device=device)))
            tree.path_buffers(device)
            self.plans[key] = plan
        return self.plans[key]

    def _draft(self, tree) -> torch.Tensor:
        """The tree below the root from the last verified row's output, depth by depth (``_plan``)."""
        model, device = self.model, self.root.device
        draft = model.draft
        plan, (_, levels) = self._plan(tree), tree.path_buffers(device)
        tokens = torch.zeros(tree.num_nodes, dtype=torch.long, device=device)
        tokens[0] = self.root
        root_scores = draft.logits(self.normed)
        scores = root_scores.new_zeros(tree.num_nodes, root_scores.shape[-1])  # a row per node with children
        scores[0] = root_scores[0]
        features = self.prenorm.new_zeros(tree.num_nodes, self.prenorm.shape[-1])
        features[0] = self.prenorm[0]
        columns = torch.arange(self.room, device=device)
        for d, (parents, children, rows, ranks) in enumerate(levels):
            if d > 0:
                grand, offset, sees, order = plan[d]
                count = len(grand)
                position = (self.length - 1 + d).expand(1, count)
                q, k, v, residual = draft.qkv(model._embed(tokens[parents])[None], features[grand][None], position)
                slots = self.length + offset + order[:count]
                self.key_room.index_copy_(2, slots, k)
                self.value_room.index_copy_(2, slots, v)
                allowed = (columns < self.length).expand(count, -1).clone()
                allowed.index_copy_(1, self.length + order, sees)
                normed, prenorm = draft.finish(model._attend(q, self.key_room, self.value_room, allowed), residual)
                features.index_copy_(0, parents, prenorm[0])
                scores.index_copy_(0, parents, draft.logits(normed[0]))
            top = scores[parents].topk(tree.head_top_k[d], dim=-1).indices
            tokens[children] = model.guessed_tokens(top[rows, ranks])
        return tokens
