"""Decoding steps over one static cache kept across generations, and on CUDA each tree size's pass captured once.

At batch 1 a GPU step is launch-bound, not memory-bound: an eager 8B-shaped step took 19.1-41.6 ms where its
weights take 3.8 ms to read, and the same step replayed from a CUDA graph 7.6 ms (issue 58; `docs/results.md`,
"Step cost"). A server replays graphs captured once at start-up; a speedup measured against eager steps is one no
server would see.

``StaticSteps`` holds one ``StaticCache`` (its keys, values and length at fixed addresses) for every generation it
is handed to (``tree_generate(..., steps=)``): each generation resets it in place, or, when a text needs more room,
gets a larger one (rounded up to ``length_step`` tokens; the graphs made for the old one are dropped and counted in
``captures``). With ``graphs=True`` (CUDA only) it is also the backbone's pass over ``N`` tree nodes with
``tree_pass``'s signature (``generate.py``): on the first call for ``N`` it captures the model's forward over
``N`` nodes into a graph whose inputs (tokens, positions, the 4D mask) are static buffers; each later call copies
the step's inputs into them and replays. The plain step is the 1-node graph. Captured once per evaluation (its
warm-up turn), not per generation, as a server captures at start-up. The draft's state lives beside the cache
(``draft_state``): a family's static one keeps its buffers as long as the cache and, with graphs, replays its own
passes too (``model/draft_state.py``: Medusa heads, EAGLE-3 drafts; a P-EAGLE draft runs eagerly); the cache's
compaction after a graphed pass is one graph per tree size too (``compact``). With ``compiled=True`` each captured
pass is torch's inductor compilation of the model's forward (fused element-wise kernels, one compilation per tree
size; opt-in, timed by ``benchmarks decode graphs=compiled``: an 8B-shaped graphed plain step 7.61 -> 5.72 ms on an
H200).

Tested: graphed decoding equals eager decoding over the dynamic cache token for token, accepted lengths too
(``tests/gpu/test_graphs.py``; passed on an H200, torch 2.11, transformers 5.17, 2026-11-28); one ``StaticSteps``
kept across generations equals a fresh dynamic cache per generation (``tests/decoding/test_generate.py``, CPU).
"""

from __future__ import annotations

import torch
from transformers import StaticCache

from medusa_train.backbone.graph_capture import capture
from medusa_train.decoding.cache import new_cache
from medusa_train.decoding.tree import fill_step_mask


def graphs_wanted(setting: bool | None, device: torch.device) -> bool:
    """Whether to decode with CUDA graphs: ``setting`` (a config's ``cuda_graphs``) or, when it is None, on CUDA."""
    if setting is None:
        return device.type == "cuda"
    if setting and device.type != "cuda":
        raise ValueError(f"cuda_graphs=true needs a CUDA model (here: {device.type}); set cuda_graphs=null or false")
    return bool(setting)


class StaticSteps:
    """One ``StaticCache`` for many generations; with ``graphs``, one CUDA graph per tree size over it."""

    def __init__(self, model, graphs: bool = False, length_step: int = 1024, warmup: int = 2, compiled: bool = False):
        device = model.backbone.get_input_embeddings().weight.device
        if graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA model (here: {device.type})")
        if compiled and not graphs:
            raise ValueError("compiled=True compiles the pass each graph captures: it needs graphs=True")
        self.model, self.graphed, self.length_step, self.warmup = model, graphs, length_step, warmup
        # the captured pass compiled by inductor first (its element-wise ops fused), one compilation per tree size
        self.forward = torch.compile(model, dynamic=False) if compiled else model
        self.cache: StaticCache | None = None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict, object]] = {}
        self.captures = 0  #: graphs captured so far (one per tree size, again after the cache grew)
        self.draft, self.draft_room = None, 0  # the draft's static decode state (``draft_state``) and its rooms
        self.compactions: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # per tree size (``compact``)
        self.nodes = 0  # the last pass's nodes (what ``compact`` moves)

    @property
    def length(self) -> int:
        """Tokens the cache holds (0 before the first generation)."""
        return 0 if self.cache is None else self.cache.layers[0].max_cache_len

    def cache_for(self, length: int) -> StaticCache:
        """The cache, emptied in place, for a generation of up to ``length`` tokens (prompt, reply and one tree)."""
        if length > self.length:
            size = -(-length // self.length_step) * self.length_step
            self.cache, self.graphs, self.compactions = new_cache("static", self.model.backbone, size), {}, {}
        else:
            self.cache.reset()
        return self.cache

    @property
    def draft_captures(self) -> int:
        """Graphs captured of the draft's passes (0 for a draft that runs eagerly: P-EAGLE's)."""
        return getattr(self.draft, "captures", 0)

    @property
    def backbone_pass(self):
        """What ``tree_generate`` runs the backbone's pass with: this object's graphs, or None (eager)."""
        return self if self.graphed else None

    @property
    def compaction(self):
        """What ``tree_generate`` compacts the cache with after a graphed pass: ``compact``, or None (eager)."""
        return self.compact if self.graphed else None

    def compact(self, cache: StaticCache, past_len: int, path: list[int]) -> None:
        """``compact_cache``'s result (``generate.py``) replayed from a graph, one per tree size: every node slot of
        the last pass moved at once (the accepted path's nodes to the first slots, the rest to themselves), the
        indices and the new length copied in as one small tensor (``move_slots``)."""
        if cache is not self.cache:
            raise ValueError("StaticSteps compacts the cache it was made for")
        n = self.nodes
        if n not in self.compactions:
            self.compactions[n] = self._capture_compaction(n)
        graph, indices = self.compactions[n]
        source = [*path, *range(len(path), n)]
        indices.copy_(torch.tensor([*(past_len + s for s in source), past_len, past_len + len(path)]))
        graph.replay()

    def __call__(self, model, tokens: torch.Tensor, tree_mask: torch.Tensor, offsets: torch.Tensor,
                 cache: StaticCache, past_len: int):
        if cache is not self.cache or model is not self.model:
            raise ValueError("StaticSteps replays over the model and cache it was made for")
        n = self.nodes = tokens.shape[0]
        if n not in self.graphs:
            self.graphs[n] = self._capture(n, tree_mask)
            self.captures += 1
        graph, inputs, output = self.graphs[n]
        self._fill(inputs, tokens, tree_mask, offsets, past_len)
        graph.replay()
        return output

    def _fill(self, inputs: dict, tokens, tree_mask, offsets, past_len: int) -> None:
        """The step's tokens, positions and mask (``fill_step_mask``) into the graph's buffers."""
        inputs["tokens"].copy_(tokens[None])
        inputs["positions"].copy_((past_len + offsets)[None])
        fill_step_mask(inputs["mask"][0, 0], tree_mask, past_len)

    def _run(self, inputs: dict):
        return self.forward(inputs["tokens"], attention_mask=inputs["mask"], position_ids=inputs["positions"],
                          past_key_values=self.cache, use_cache=True)

    def _capture(self, n: int, tree_mask: torch.Tensor):
        device, dtype = tree_mask.device, tree_mask.dtype
        length = self.cache.layers[0].max_cache_len
        inputs = {"tokens": torch.zeros(1, n, dtype=torch.long, device=device),
                  "positions": torch.zeros(1, n, dtype=torch.long, device=device),
                  "mask": torch.empty(1, 1, n, length, dtype=dtype, device=device)}
        lengths = [layer.cumulative_length.clone() for layer in self.cache.layers]
        past = int(lengths[0])
        self._fill(inputs, torch.zeros(n, dtype=torch.long, device=device), tree_mask,
                   torch.zeros(n, dtype=torch.long, device=device), past)

        def restore():  # warm-up and capture write nodes after the text: set its length back (they are masked)
            for layer, value in zip(self.cache.layers, lengths):
                layer.cumulative_length.copy_(value)

        graph, output = capture(lambda: self._run(inputs), device, self.warmup, restore)
        return graph, inputs, output

    def _capture_compaction(self, n: int):
        """The compaction of ``n`` node slots captured. Its indices (``n`` source slots, the cache's length before the
        step, after it) start as the identity: the warm-up moves the first ``n`` slots onto themselves (slots every
        cache has: it holds a tree) and sets the length it holds."""
        if any(getattr(layer, "is_sliding", False) for layer in self.cache.layers):
            raise NotImplementedError("cannot compact a sliding-window cache layer")  # as compact_cache refuses it
        length = self.cache.layers[0].cumulative_length.reshape(1)
        indices = torch.cat([torch.arange(n, device=length.device), torch.zeros_like(length), length]).long()

        def run():  # every tensor it reads is kept with the graph (indices) or made inside it (a graph keeps no inputs)
            move_slots(self.cache, indices[:n], indices[n] + torch.arange(n, device=indices.device), indices[n + 1])

        graph, _ = capture(run, length.device, self.warmup, lambda: None)
        return graph, indices

    def draft_state(self):
        """The draft's decode state for the next generation, over rooms as long as the cache (``cache_for`` first):
        the family's static state (``new_decode_state(room=, graphs=)``: its passes captured alongside the
        backbone's, once for every generation) kept and emptied in place, a new one after the cache grew."""
        if self.draft is None or self.draft_room != self.length:
            self.draft, self.draft_room = self.model.new_decode_state(room=self.length, graphs=self.graphed), self.length
        else:
            self.draft.reset()
        return self.draft



def move_slots(cache: StaticCache, source: torch.Tensor, target: torch.Tensor, length: torch.Tensor) -> None:
    """Every layer's keys and values at slots ``source`` written to slots ``target`` (read first, so overlapping slots
    are safe) and its length set to ``length`` (0-d): a compaction whose indices all live on the device, what a graph
    replays (``StaticSteps.compact``)."""
    for layer in cache.layers:
        layer.keys.index_copy_(2, target, layer.keys.index_select(2, source))
        layer.values.index_copy_(2, target, layer.values.index_select(2, source))
        layer.cumulative_length.copy_(length)
