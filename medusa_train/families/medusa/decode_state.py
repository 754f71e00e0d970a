"""What the heads keep between decode steps of one sequence: eagerly (``DecodeState``), or over fixed buffers, and
on CUDA their passes replayed from CUDA graphs (``StaticHeadsState``).

``DecodeState`` keeps the prefix layer's keys and values in an ``AppendingLayer`` (written in place, grown when full)
and a view of what the heads read at the last accepted position: what every decoder on a CPU uses.

A graphed decoder replays the backbone's pass from a graph (``decoding/graphs.py``); the heads' own pass, eager, is
~150 small operations a step (the prefix layer, one round of heads per tree depth, their top-k): on a GPU each is a
kernel launch and its Python, what a server replays from a graph too. Here everything the heads keep lives at fixed
addresses: the prefix layer's keys and values in rooms as long as the backbone's static cache, how many positions
they hold as a 0-d tensor on the device (``length``), what the heads read at the last accepted position (``last``).
A step is two passes:

- ``read``: the accepted positions through the prefix layer into the rooms (``PrefixAttention.step_in_room``),
  ``last`` refilled, ``length`` advanced; one graph per count of accepted positions (1 to ``GRAPHED_READ``; a
  prompt's many are read eagerly over the same buffers, as a prefill is).
- ``guesses``: ``heads_guesses`` from ``last`` and the root token (a device scalar): one graph per tree.

Captured on first use (an evaluation's warm-up turn meets them, as the backbone's), kept across generations with the
static cache that owns this state (``StaticSteps.draft_state``), dropped with it when it grows. Without ``graphs``
(any device) the same passes run eagerly over the same buffers: on a CPU they equal ``DecodeState``'s bit for bit
(the step attention skips masked positions; tested in ``tests/decoding/test_static_drafts.py``), and on a GPU the graphed
ones are checked against eager decoding (``tests/gpu/test_graphs.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from medusa_train.backbone.appending_cache import AppendingLayer
from medusa_train.backbone.graph_capture import capture
from medusa_train.families.medusa.propose import heads_guesses

#: the most accepted positions a read replays from a graph (a step accepts at most its tree's depth + 1)
GRAPHED_READ = 32


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


class StaticHeadsState:
    """``DecodeState``'s answers (``read``, ``guesses``, ``rewind``, ``reset``) over buffers fixed for ``room``
    positions; with ``graphs`` (CUDA) each pass captured once and replayed."""

    def __init__(self, model, room: int, graphs: bool = False, warmup: int = 2):
        device = model.lm_head.weight.device
        if graphs and device.type != "cuda":
            raise ValueError(f"graphed heads need a CUDA model (here: {device.type})")
        self.room, self.graphed, self.warmup = room, graphs, warmup
        self.length = torch.zeros((), dtype=torch.long, device=device)  #: positions the rooms hold, on the device
        self.filled = 0  #: the same, here (for the checks; never read from the device)
        self.last: torch.Tensor | None = None  #: (1, features) what the heads read at the last accepted position
        self.key_room = self.value_room = None
        if model.prefix is not None:
            prefix = model.prefix
            size = prefix.qkv.weight.shape[1]
            shape = (1, prefix.num_attention_heads, room, size // prefix.num_attention_heads)
            self.key_room = torch.zeros(shape, dtype=prefix.qkv.weight.dtype, device=device)
            self.value_room = torch.zeros_like(self.key_room)
        self.reads: dict[int, tuple] = {}  # accepted positions -> (graph, their buffer)
        self.guessed: dict[tuple, tuple] = {}  # a tree's choices -> (graph, root buffer, tokens)
        self.captures = 0  #: graphs captured so far

    def read(self, model, hidden: torch.Tensor) -> None:
        """``DecodeState.read`` over the rooms: (n, hidden), the positions accepted since the last step."""
        n = hidden.shape[0]
        if self.filled + n > self.room:
            raise ValueError(f"the heads' rooms hold {self.room} positions; {self.filled} read and {n} more do not "
                             "fit: size the state as the backbone's cache (StaticSteps.draft_state)")
        if not self.graphed or not self.filled or n > GRAPHED_READ:
            self._read(model, hidden)
        else:
            if n not in self.reads:
                self.reads[n] = self._capture_read(model, hidden)
            graph, buffer = self.reads[n]
            buffer.copy_(hidden)
            graph.replay()
        self.filled += n

    def guesses(self, model, tree, root_token: int) -> torch.Tensor:
        """(num_nodes,) the tree's tokens from what was read: ``heads_guesses``, replayed from the tree's graph."""
        if not self.graphed:
            return heads_guesses(model, tree, root_token, self)
        key = tuple(tree.choices)
        if key not in self.guessed:
            self.guessed[key] = self._capture_guesses(model, tree)
        graph, root, tokens = self.guessed[key]
        root.fill_(root_token)
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

    def _read(self, model, hidden: torch.Tensor) -> None:
        """The read's operations (what a read graph replays): through the prefix layer into the rooms, ``last``
        refilled in place, ``length`` advanced on the device."""
        if model.prefix is None:
            context = hidden
        else:
            context = model.prefix.step_in_room(hidden[None], self.key_room, self.value_room, self.length,
                                                empty=not self.filled)[0]
        if self.last is None:
            self.last = context[-1:].clone()
        else:
            self.last.copy_(context[-1:])
        self.length.add_(hidden.shape[0])

    def _capture_read(self, model, hidden: torch.Tensor) -> tuple:
        buffer = hidden.clone()
        length, last = self.length.clone(), self.last.clone()

        def restore():  # the warm-up's reads advanced the length and refilled last: as they were
            self.length.copy_(length)
            self.last.copy_(last)

        graph, _ = capture(lambda: self._read(model, buffer), buffer.device, self.warmup, restore)
        self.captures += 1
        return graph, buffer

    def _capture_guesses(self, model, tree) -> tuple:
        root = torch.zeros((), dtype=torch.long, device=self.length.device)
        tree.path_buffers(root.device)  # copied to the device before capture (a graph cannot copy from the host)
        graph, tokens = capture(lambda: heads_guesses(model, tree, root, self), root.device, self.warmup, lambda: None)
        self.captures += 1
        return graph, root, tokens
