"""One CUDA graph captured the way every graphed pass here is (the backbone's tree sizes, the heads' reads and
guesses): after warm-up runs on a side stream, with what they wrote that a later step reads put back."""

from __future__ import annotations

import torch


def capture(run, device: torch.device, warmup: int, restore) -> tuple[torch.cuda.CUDAGraph, object]:
    """``run()`` captured into a CUDA graph after ``warmup`` runs on a side stream (what capture needs: its kernels
    chosen, its memory allocated); ``restore()`` after the warm-up and after the capture undoes what they wrote that
    a later step reads (a length advanced). Returns the graph and ``run``'s output, the tensors a replay refills."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            run()
            restore()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = run()
    restore()
    return graph, output
