"""What every draft's decode state over fixed buffers shares (``families/medusa/decode_state.py``,
``families/eagle3/decode_state.py``): a graphed decoder replays the draft's passes as it replays the backbone's.

A draft keeps its own keys and values in rooms as long as the backbone's static cache; how many positions they hold
lives on the device (``length``, what every pass reads) and here (``filled``, for the checks, never read back). A step
reads the positions verified since the last one (one graph per count of them, 1 to ``GRAPHED_READ``; a prompt's many
eagerly, as a prefill), then fills the tree (one graph per tree). Captured on first use (an evaluation's warm-up turn
meets them, as the backbone's: ``decoding/graphs.py``), kept across generations with the static cache that owns the
state (``StaticSteps.draft_state``), dropped with it when it grows. Without ``graphs`` (any device) the same passes
run eagerly over the same buffers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from medusa_train.backbone.graph_capture import capture

#: the most positions a read replays from a graph (a step accepts at most its tree's depth + 1)
GRAPHED_READ = 32


class StaticDraftState:
    """A draft's state over buffers fixed for ``room`` positions; with ``graphs`` (CUDA) each pass replayed.

    A family's subclass reads in ``_read(*inputs)`` (rows of the positions verified since the last step; it advances
    ``length``) and names in ``_kept()`` what else a read writes that a later pass reads (restored after a capture's
    warm-up)."""

    what = "draft"  #: named in errors

    def __init__(self, device: torch.device, room: int, graphs: bool = False, warmup: int = 2):
        if graphs and device.type != "cuda":
            raise ValueError(f"graphed passes of the {self.what} need a CUDA model (here: {device.type})")
        self.room, self.graphed, self.warmup = room, graphs, warmup
        self.length = torch.zeros((), dtype=torch.long, device=device)  #: positions the rooms hold, on the device
        self.filled = 0  #: the same, here
        self.root = torch.zeros((), dtype=torch.long, device=device)  #: the step's root token, on the device
        self.reads: dict[int, tuple] = {}  # verified positions -> (graph, input buffers)
        self.trees: dict[tuple, tuple] = {}  # a tree's choices -> (graph, tokens, the tree whose buffers it reads)
        self.captures = 0  #: graphs captured so far

    def read_positions(self, *inputs: torch.Tensor, drafted: int = 0) -> None:
        """``_read(*inputs)``: eagerly for the first read (a prompt) or more than ``GRAPHED_READ`` positions, else
        replayed from the graph of that count (captured first); ``drafted``: the tree's slots the step writes after
        them (checked against the room too)."""
        n = inputs[0].shape[0]
        if self.filled + n + drafted > self.room:
            raise ValueError(f"the rooms of the {self.what} keep {self.room} positions; {self.filled} read, {n} more "
                             f"and {drafted} drafted do not fit: size the state as the backbone's cache "
                             "(StaticSteps.draft_state)")
        if not self.graphed or not self.filled or n > GRAPHED_READ:
            self._read(*inputs)
        else:
            if n not in self.reads:
                self.reads[n] = self._capture_read(inputs)
            graph, buffers = self.reads[n]
            for buffer, tensor in zip(buffers, inputs):
                buffer.copy_(tensor)
            graph.replay()
        self.filled += n

    def tree_tokens(self, tree, fill: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``fill()``, the tree's tokens from what was read: eagerly, or replayed from the tree's graph."""
        if not self.graphed:
            return fill()
        key = tuple(tree.choices)
        if key not in self.trees:
            # the tree kept with its graph: the graph reads the tree's device buffers (``path_buffers``) and keeps
            # nothing alive itself, and a later tree of the same choices may be another object
            self.trees[key] = (*capture(fill, self.length.device, self.warmup, lambda: None), tree)
            self.captures += 1
        graph, tokens, _ = self.trees[key]
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

    def _read(self, *inputs: torch.Tensor) -> None:
        raise NotImplementedError

    def _kept(self) -> tuple[torch.Tensor, ...]:
        return ()

    def _capture_read(self, inputs: tuple[torch.Tensor, ...]) -> tuple:
        buffers = tuple(t.clone() for t in inputs)
        written = (self.length, *self._kept())
        kept = tuple(t.clone() for t in written)

        def restore():  # the warm-up's reads advanced the length and wrote what a later pass reads: as they were
            for tensor, value in zip(written, kept):
                tensor.copy_(value)

        graph, _ = capture(lambda: self._read(*buffers), self.length.device, self.warmup, restore)
        self.captures += 1
        return graph, buffers
