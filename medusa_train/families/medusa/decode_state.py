"""What the heads keep between decode steps of one sequence: eagerly (``DecodeState``), or over fixed buffers, and
on CUDA their passes replayed from CUDA graphs (``StaticHeadsState``).

``DecodeState`` keeps the prefix layer's keys and values in an ``AppendingLayer`` (written in place, grown when full)
and a view of what the heads read at the last accepted position: what every decoder on a CPU uses.

A graphed decoder replays the backbone's pass from a graph (``decoding/graphs.py``); the heads' own pass, eager, is
~70 operator calls a step (the prefix layer, one round of heads per tree depth, their top-k; the demo's heads and
16-node tree, counted on the CPU): on a GPU each is a kernel launch and its Python, what a server replays from a graph
too. ``StaticHeadsState`` (on ``model/draft_state.py``'s rooms and graphs) keeps the prefix layer's keys and values in
rooms as long as the backbone's static cache and what the heads read at the last accepted position in a fixed buffer
(``last``). A step is two passes: the read (the accepted positions through the prefix layer,
``PrefixAttention.step_in_room``; one graph per count of them) and the guesses (``heads_guesses`` from ``last`` and the
root token; one graph per tree). On a CPU, eagerly, they equal ``DecodeState``'s bit for bit where the step attention
takes the prefix layer's steps (it skips masked positions), the same candidates elsewhere (tested in
``tests/decoding/test_static_drafts.py``); on a GPU the graphed ones are checked against eager decoding
(``tests/gpu/test_graphs.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from medusa_train.backbone.appending_cache import AppendingLayer
from medusa_train.families.medusa.propose import heads_guesses
from medusa_train.model.draft_state import StaticDraftState


@dataclass
class DecodeState:
    """What the heads keep between decode steps of one sequence (opaque to callers).

    Attributes:
        prefix_cache: Keys and values of the prefix attention layer over the accepted positions (appended in place).
        last: (1, hidden) what the heads read at the last accepted position.
    """

    prefix_cache: AppendingLayer = field(default_factory=AppendingLayer)
    last: torch.Tensor | None = None

    def read(self, model, hidden: torch.Tensor) -> None:
        """The positions accepted since the last step, (n, hidden): through the prefix layer, if any, after those
        read before; ``last`` becomes what the heads read at the last of them."""
        self.last = model._context(hidden, self.prefix_cache)[-1:]

    def guesses(self, model, tree, root_token: int) -> torch.Tensor:
        """(num_nodes,) the tree's tokens from what was read (``heads_guesses``)."""
        return heads_guesses(model, tree, root_token, self)

    def rewind(self, length: int) -> None:
        """Forget every position after the first ``length`` (a benchmark repeating one step)."""
        self.prefix_cache.keep(length)

    def reset(self) -> None:
        """Empty, for the next sequence."""
        self.prefix_cache, self.last = AppendingLayer(), None


class StaticHeadsState(StaticDraftState):
    """``DecodeState``'s answers (``read``, ``guesses``, ``rewind``, ``reset``) over buffers fixed for ``room``
    positions (``model/draft_state.py``); with ``graphs`` (CUDA) each pass captured once and replayed."""

    what = "heads"

    def __init__(self, model, room: int, graphs: bool = False, warmup: int = 2):
        super().__init__(model.lm_head.weight.device, room, graphs, warmup)
        self.model = model
        self.last: torch.Tensor | None = None  #: (1, features) what the heads read at the last accepted position
        self.key_room = self.value_room = None
        if model.prefix is not None:
            prefix = model.prefix
            size = prefix.qkv.weight.shape[1]
            shape = (1, prefix.num_attention_heads, room, size // prefix.num_attention_heads)
            self.key_room = torch.zeros(shape, dtype=prefix.qkv.weight.dtype, device=self.length.device)
            self.value_room = torch.zeros_like(self.key_room)

    def read(self, model, hidden: torch.Tensor) -> None:
        """``DecodeState.read`` over the rooms: (n, hidden), the positions accepted since the last step (``model``:
        the one this state was made for, ``self.model``)."""
        self.read_positions(hidden)

    def guesses(self, model, tree, root_token: int) -> torch.Tensor:
        """(num_nodes,) the tree's tokens from what was read: ``heads_guesses``, replayed from the tree's graph."""
        self.root.fill_(root_token)
        tree.path_buffers(self.root.device)  # on the device before any capture (a graph cannot copy from the host)
        return self.tree_tokens(tree, lambda: heads_guesses(self.model, tree, self.root, self))

    def _read(self, hidden: torch.Tensor) -> None:
        """The read's operations (what a read graph replays): through the prefix layer into the rooms, ``last``
        refilled in place, ``length`` advanced on the device."""
        prefix = self.model.prefix
        context = hidden if prefix is None else prefix.step_in_room(
            hidden[None], self.key_room, self.value_room, self.length, empty=not self.filled)[0]
        if self.last is None:
            self.last = context[-1:].clone()
        else:
            self.last.copy_(context[-1:])
        self.length.add_(hidden.shape[0])

    def _kept(self) -> tuple[torch.Tensor, ...]:
        return (self.last,)
