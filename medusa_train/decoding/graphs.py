"""CUDA graphs for the decoder's backbone pass: each tree size captured once over a static cache, then replayed.

At batch 1 a GPU step is launch-bound, not memory-bound: an eager 8B-shaped step took 19.1 ms where its weights
take 3.8 ms to read and the same step replayed from a CUDA graph 7.6 ms (issue 58's H200 table). A server
replays graphs; a speedup measured against eager steps is one no server would see.

``GraphedTreePass`` has ``tree_pass``'s signature (``generate.py``): on the first call for a number of nodes it
captures the model's forward over that many nodes into a graph whose inputs (tokens, positions, the 4D mask) and
cache (a ``StaticCache``: its keys, values and length live at fixed addresses) are static buffers; each later
call copies the step's inputs into them and replays. The plain step is the 1-node graph. Only on CUDA.

Status (2026-11-28): written without a GPU to run it on. ``tests/gpu/test_graphs.py`` (marked ``gpu``) checks
graphed decoding against the dynamic cache token for token; until it has passed on a GPU, ``tree_generate``
uses graphs only when asked (``cuda_graphs=True``).
"""

from __future__ import annotations

import torch
from transformers import StaticCache

from medusa_train.decoding.tree import fill_step_mask


class GraphedTreePass:
    """The backbone's pass over ``N`` tree nodes, one CUDA graph per ``N``, over one ``StaticCache``."""

    def __init__(self, model, cache: StaticCache, warmup: int = 2):
        if not isinstance(cache, StaticCache):
            raise ValueError("CUDA graphs replay over fixed buffers: decode with kv_cache='static'")
        self.model, self.cache, self.warmup = model, cache, warmup
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict, object]] = {}

    def __call__(self, model, tokens: torch.Tensor, tree_mask: torch.Tensor, offsets: torch.Tensor,
                 cache: StaticCache, past_len: int):
        if cache is not self.cache or model is not self.model:
            raise ValueError("a GraphedTreePass replays over the model and cache it was made for")
        n = tokens.shape[0]
        if n not in self.graphs:
            self.graphs[n] = self._capture(n, tree_mask)
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
        return self.model(inputs["tokens"], attention_mask=inputs["mask"], position_ids=inputs["positions"],
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

        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):
                self._run(inputs)
                restore()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = self._run(inputs)
        restore()
        return graph, inputs, output
