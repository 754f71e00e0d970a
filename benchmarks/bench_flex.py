"""Tree attention through FlexAttention beside SDPA's masked path: one layer's attention over a verify step.

    python -m benchmarks flex dtype=float32 context=256 sizes=2,4,8,16,32,64 repeats=30

At the packaged backbone's attention shape (9 query heads, 3 key/value heads, head size 64; ``heads``,
``kv_heads``, ``head_dim`` to change it) and ``context`` cached tokens, for a tree of N nodes (the first N of
``default``) it times: SDPA with the decoder's 4D additive tree mask (what the decoder runs), and
``flex_attention`` with the same tree as a block mask, eager and compiled (``torch.compile``, as FlexAttention
is meant to run). The outputs are checked equal first. Nothing here changes the decoder: its attention stays
SDPA unless this table says flex is faster where it runs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.bench_options import bench_options
from medusa_train.decoding import TokenTree
from medusa_train.tree.cost import device_name, median_times

DEFAULTS = dict(dtype="float32", device=None, context=256, sizes="2,4,8,16,32,64", repeats=30, warmup=3,
                heads=9, kv_heads=3, head_dim=64, threads=None, compile="true", output=None)


def main(**overrides) -> int:
    opts = bench_options(DEFAULTS, overrides)
    if opts is None:
        return 2
    from torch.nn.attention.flex_attention import flex_attention

    device = torch.device(opts["device"] or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, opts["dtype"])
    context, heads, kv, dim = int(opts["context"]), int(opts["heads"]), int(opts["kv_heads"]), int(opts["head_dim"])
    default = TokenTree.from_name("default")
    compiled = torch.compile(flex_attention, dynamic=False) if opts["compile"] == "true" else None
    rows = []
    print(f"\nTree attention, one layer: {heads} query / {kv} key-value heads of {dim}, {opts['dtype']}, "
          f"{device_name(device)}, context {context}, median of {opts['repeats']}\n")
    print("| nodes | SDPA, 4D additive mask (ms) | flex_attention eager (ms) | flex_attention compiled (ms) | "
          "compile (s) | max difference |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in (int(s) for s in str(opts["sizes"]).split(",")):
        row = time_tree(default.truncated(max_nodes=n), context, heads, kv, dim, dtype, device, compiled, opts)
        ms = [row["sdpa_ms"], row["flex_eager_ms"], row["flex_compiled_ms"]]
        print(f"| {n} | {ms[0]:.3f} | {ms[1]:.3f} | "
              + (f"{ms[2]:.3f} | {row['compile_s']:.1f}" if ms[2] else "- | -") + f" | {row['max_difference']:.1e} |")
        rows.append(row)
    output = Path(opts["output"] or f"outputs/bench/flex-{opts['dtype']}-{device.type}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"settings": {**opts, "device": device_name(device)}, "rows": rows}, indent=1) + "\n")
    print(f"\nwrote {output}")
    return 0


def time_tree(tree: TokenTree, context: int, heads: int, kv: int, dim: int, dtype, device, compiled, opts) -> dict:
    """One tree size: SDPA with the additive mask, flex_attention eager and (``compiled``) compiled; outputs
    checked against SDPA's first."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n = tree.num_nodes
    g = torch.Generator().manual_seed(n)
    q = torch.randn(1, heads, n, dim, generator=g).to(device, dtype)
    k, v = (torch.randn(1, kv, context + n, dim, generator=g).to(device, dtype) for _ in range(2))
    additive = torch.zeros(1, 1, n, context + n, dtype=dtype)
    additive[0, 0, :, context:] = tree.attention_mask(dtype)
    additive = additive.to(device)
    visible = tree.visibility.to(device)

    def tree_mask(b, h, q_idx, kv_idx):  # the prefix, and the tree's own ancestors
        return (kv_idx < context) | visible[q_idx, (kv_idx - context).clamp(min=0)]

    block = create_block_mask(tree_mask, None, None, n, context + n, device=str(device), BLOCK_SIZE=128)
    steps = [lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=additive, enable_gqa=True),
             lambda: flex_attention(q, k, v, block_mask=block, enable_gqa=True)]
    reference = steps[0]()
    difference = (steps[1]() - reference).abs().max().item()
    compile_s = None
    if compiled is not None:
        started = time.perf_counter()
        out = compiled(q, k, v, block_mask=block, enable_gqa=True)
        compile_s = time.perf_counter() - started
        difference = max(difference, (out - reference).abs().max().item())
        steps.append(lambda: compiled(q, k, v, block_mask=block, enable_gqa=True))
    seconds = [s * 1e3 for s in median_times(steps, int(opts["repeats"]), int(opts["warmup"]), device)]
    return {"nodes": n, "sdpa_ms": seconds[0], "flex_eager_ms": seconds[1],
            "flex_compiled_ms": seconds[2] if compiled is not None else None, "compile_s": compile_s,
            "max_difference": difference}
