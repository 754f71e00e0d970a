"""What an EAGLE-3 draft keeps between decode steps of one sequence: eagerly (``Eagle3DecodeState``), or over fixed
buffers, and on CUDA its passes replayed from CUDA graphs (``Eagle3StaticState``).

``Eagle3DecodeState`` keeps the draft layer's keys and values in an ``AppendingLayer``; ``Eagle3Model.propose`` reads
the verified positions into it and drafts the tree after them (``model.py``). ``Eagle3StaticState`` holds them in
rooms as long as the backbone's static cache, with how many positions they hold as a 0-d tensor on the device
(``length``), so a step's two passes read and write the same buffers:

- the read: the positions verified since the last step, each with the token after it (the root for the last),
  through the draft layer into the rooms; the last row's output and pre-norm sum kept in place (what depth 1 reads);
  one graph per count of verified positions (1 to ``GRAPHED_READ``; a prompt's many eagerly, as a prefill);
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
from medusa_train.backbone.graph_capture import capture

#: the most verified positions a read replays from a graph (a step accepts at most its tree's depth + 1)
GRAPHED_READ = 32


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


class Eagle3StaticState:
    """``Eagle3DecodeState``'s answers (``propose``, ``rewind``, ``reset``) over buffers fixed for ``room`` positions;
    with ``graphs`` (CUDA) each pass captured once and replayed."""

    def __init__(self, model, room: int, graphs: bool = False, warmup: int = 2):
        weight = model.draft.fc.weight
        if graphs and weight.device.type != "cuda":
            raise ValueError(f"a graphed EAGLE-3 draft needs a CUDA model (here: {weight.device.type})")
        c = model.draft.config
        self.room, self.graphed, self.warmup = room, graphs, warmup
        shape = (1, c.num_key_value_heads, room, c.head_dim)
        self.key_room = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.value_room = torch.zeros_like(self.key_room)
        self.length = torch.zeros((), dtype=torch.long, device=weight.device)  #: positions the rooms hold, on the device
        self.filled = 0  #: the same, here (for the checks; never read from the device)
        self.root = torch.zeros((), dtype=torch.long, device=weight.device)  # the step's root token, on the device
        self.normed = self.prenorm = None  # (1, H): the last verified row's output and pre-norm sum
        self.reads: dict[int, tuple] = {}  # verified positions -> (graph, (inputs, tokens) buffers)
        self.trees: dict[tuple, tuple] = {}  # a tree's choices -> (graph, tokens)
        self.plans: dict[tuple, list] = {}  # a tree's choices -> per depth, what its drafted nodes read (``_plan``)
        self.captures = 0  #: graphs captured so far

    def propose(self, model, tree, accepted_inputs: torch.Tensor, accepted_tokens: torch.Tensor,
                root_token: int) -> torch.Tensor:
        """(num_nodes,) the tree's tokens, as ``Eagle3Model.eager_proposal`` drafts them."""
        n = accepted_inputs.shape[0]
        drafted = sum(len(parents) for parents, *_ in tree.levels[1:])
        if self.filled + n + drafted > self.room:
            raise ValueError(f"the draft's rooms hold {self.room} positions; {self.filled} read, {n} more and "
                             f"{drafted} drafted do not fit: size the state as the backbone's cache")
        self.root.fill_(root_token)
        inputs, tokens = accepted_inputs, accepted_tokens.to(self.root.device).long().reshape(-1)
        if not self.graphed or not self.filled or n > GRAPHED_READ:
            self._read(model, inputs, tokens)
        else:
            if n not in self.reads:
                self.reads[n] = self._capture_read(model, inputs, tokens)
            graph, (input_buffer, token_buffer) = self.reads[n]
            input_buffer.copy_(inputs)
            token_buffer.copy_(tokens)
            graph.replay()
        self.filled += n
        if tree.depth == 0:
            return torch.tensor([root_token] + [0] * (tree.num_nodes - 1), device=self.root.device)
        if not self.graphed:
            return self._draft(model, tree)
        key = tuple(tree.choices)
        if key not in self.trees:
            self._plan(tree)  # made before capture (a graph cannot copy from the host)
            self.trees[key] = capture(lambda: self._draft(model, tree), self.root.device, self.warmup, lambda: None)
            self.captures += 1
        graph, tokens = self.trees[key]
        graph.replay()
        return tokens.clone()  # the next replay writes the buffer again; the decoder keeps this step's

    def rewind(self, length: int) -> None:
        """Forget every position after the first ``length`` (a benchmark repeating one step)."""
        if length < self.filled:
            self.filled = length
            self.length.fill_(length)

    def reset(self) -> None:
        """Empty, for the next sequence (its graphs kept: they read the length from the device)."""
        self.filled = 0
        self.length.zero_()

    def _read(self, model, inputs: torch.Tensor, tokens: torch.Tensor) -> None:
        """The verified positions through the draft layer into the rooms, each with the token after it; the last
        row's output and pre-norm sum kept in place; ``length`` advanced on the device."""
        draft, device = model.draft, self.root.device
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

    def _capture_read(self, model, inputs: torch.Tensor, tokens: torch.Tensor) -> tuple:
        buffers = inputs.clone(), tokens.clone()
        kept = self.length.clone(), self.normed.clone(), self.prenorm.clone()

        def restore():  # the warm-up's reads advanced the length and refilled the last row's: as they were
            for tensor, value in zip((self.length, self.normed, self.prenorm), kept):
                tensor.copy_(value)

        graph, _ = capture(lambda: self._read(model, *buffers), self.root.device, self.warmup, restore)
        self.captures += 1
        return graph, buffers

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

    def _draft(self, model, tree) -> torch.Tensor:
        """The tree below the root from the last verified row's output, depth by depth (``_plan``)."""
        draft, device = model.draft, self.root.device
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
