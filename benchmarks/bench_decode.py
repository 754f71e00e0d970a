"""Cost of one Medusa verify step relative to one plain decoding step, by tree size.

    python -m benchmarks decode dtype=bfloat16 context=256 repeats=20 device=cpu

For each tree (root only, a chain of ``num_heads``, and the first 16/32/64 nodes of ``default`` in
their listed, most-likely-first order) it times, at the same context length:

- a plain step: the backbone over 1 new token + LM head + argmax;
- a verify step: the heads' top-k at the last token, one backbone pass over every tree node
  (4D tree mask), the LM head at every node, greedy acceptance and KV compaction; and its parts
  alone (the heads' candidates, the backbone pass, the LM head + argmax over the nodes), the rest
  being acceptance, cache compaction, the mask and host syncs.

Each step is timed twice where the backbone is a float32 CPU one, taking turns: with torch's GEMM and with the
row kernel (``medusa_train/backbone/rows.py``; ``linears=gemm|rows|both``), and set against the memory limit of a
step: the weight bytes a step reads over the bandwidth measured here (a 1 GiB buffer summed on a CPU, copied on
a GPU). ``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2`` runs an AVX2 CPU's
code paths (torch's, MKL's, oneDNN's and the kernel's) on a newer CPU: its instructions, not its memory.

``relative cost`` = verify / plain is the accept length at which Medusa breaks even; the expected
speedup is ``accept_length / relative cost``, with the accept length either given (``accept_length=``)
or the tree's expected value under the assumed head accuracies of ``default`` (heads at
initialisation are used here: only cost is measured).

Options (``key=value``): model, dtype (bfloat16), device (cuda if available, else cpu), context (256),
repeats (20), warmup (3), num_heads (4), sizes (``1,chain,16,32,64``), threads, accept_length, seed,
linears (``both``), attention (``step``: the step attention, ``backbone/step_attention.py``; ``sdpa``: SDPA's
paths alone, as without it; ``both``: the two in turns, each beside every linear path), reads (``plain``; ``next_token`` or ``path``: heads that read the next token or their tree path, whose
candidates cost one head call per tree depth; ``prefix``: path heads reading through a prefix attention
layer, which also runs over each step's accepted tokens), share_lm_head (false), draft_vocab (K: heads
scoring a K-token draft vocabulary, ``heads.draft_vocab_size=K``; the first K token ids stand in for the
data's most frequent ones, which costs the same), output (the JSON
written, default ``outputs/bench/decode-<dtype>-<reads>.json``; a PNG plot of the curve goes beside it), shape
(``135m``, ``1b``, ``8b``: a random-weight Llama of that shape built on the device instead of ``model``; no
weights to carry), graphs (``true`` on CUDA: also each backbone pass captured in a CUDA graph over a static cache and
replayed, ``decoding/graphs.py``: a server's step; ``compiled``: each captured pass compiled by inductor first, its
element-wise ops fused; ``scripts/gpu_step_cost.sh`` runs the three shapes).

``scripts/build_tree.py nodes=auto`` measures the same kind of curve for the fitted tree itself
(``medusa_train/tree/cost.py``) and picks its size from it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from benchmarks.bench_options import bench_options
from benchmarks.steps import DecodeStepParts
from medusa_train import MedusaModel, load_backbone
from medusa_train.backbone.attention import use_grouped_attention
from medusa_train.backbone.row_layers import linear_path, use_row_kernel
from medusa_train.backbone.rows import RowLinear
from medusa_train.decoding import TokenTree
from medusa_train.tree.cost import device_name, median_times
from medusa_train.tree.fit import assumed_rank_accuracies, expected_accept_length

DEFAULTS = dict(model="packaged:smollm2-135m-instruct", dtype="bfloat16", device=None, context=256, repeats=20,
                warmup=3, num_heads=4, sizes="1,chain,16,32,64", threads=None, accept_length=None, seed=0,
                reads="plain", share_lm_head="false", draft_vocab=None, linears="both", attention="step", shape=None,
                graphs="false", output=None)

#: random-weight Llama shapes (``shape=``): nothing to download or carry, the step costs what the real model's does
SHAPES = {"135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
          "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
          "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)}


def trees_to_measure(sizes: str, num_heads: int) -> list[tuple[str, TokenTree]]:
    """``1`` = root only, ``chain`` = each head's top-1, ``N`` = the first N nodes of ``default``."""
    default = TokenTree.from_name("default").truncated(max_depth=num_heads)
    trees = []
    for size in str(sizes).split(","):
        size = size.strip()
        if size == "chain":
            trees.append((f"chain({num_heads})", TokenTree.chain(num_heads)))
        elif int(size) == 1:
            trees.append(("root only", TokenTree([])))
        else:
            trees.append((f"default[:{size}]", default.truncated(max_nodes=int(size))))
    return trees


LINEAR_NAMES = {"gemm": "torch's GEMM", "rows": "the row kernel (medusa_train/backbone/rows.py)"}
ATTENTION_NAMES = {"step": "the step attention (medusa_train/backbone/step_attention.py)", "sdpa": "SDPA's paths"}


def path_name(linear: str, attention: str, attentions: list[str]) -> str:
    """A timed path's key: its linear path, and its attention where more than the step attention is timed."""
    return linear if attentions == ["step"] else f"{linear}, {attention}"
PARTS = ("verify", "candidates", "forward", "lm_head")  #: what each tree's step is timed as, whole and by part


def measure(model: MedusaModel, trees, context: int, repeats: int, warmup: int,
            seed: int, linears: list[str], attentions: list[str] = ("step",)) -> dict[str, tuple[float, float, list]]:
    """Median seconds at ``context`` cached tokens, for each linear path in ``linears`` (``gemm``: torch's;
    ``rows``: the row kernel) beside each attention in ``attentions`` (``step``: the step attention; ``sdpa``:
    SDPA's paths alone), all taking turns in every round: a plain step (the model's own mask path, as in
    ``generate``), the same step given an explicit 4D mask, and for each tree its verify step and, alone,
    the parts of it: the heads' candidates, the backbone's pass over the nodes, the LM head (+ argmax)
    over the nodes: ``{path_name: (plain, plain_explicit, [(name, tree, {part: seconds})])}``."""
    steps = DecodeStepParts(model, context, seed)
    switched = [m for m in model.modules() if type(m) is RowLinear]  # found once: switching stays cheap

    def switch_to(cls, step_kernel: bool) -> None:  # inside every timed step: class assignments, one registration
        for layer in switched:
            layer.__class__ = cls
        use_grouped_attention(step_kernel=step_kernel)

    timed, paths = [], [(linear, attention) for linear in linears for attention in attentions]
    for linear, attention in paths:
        switch = functools.partial(switch_to, torch.nn.Linear if linear == "gemm" else RowLinear, attention == "step")
        own = [steps.plain_step, lambda: steps.plain_step(explicit_mask=True)]
        for _, tree in trees:
            own += [steps.verify_step(tree), steps.candidates_step(tree), steps.forward_step(tree),
                    steps.lm_head_step(tree.num_nodes)]
        timed += [lambda fn=fn, switch=switch: (switch(), fn())[1] for fn in own]
    seconds = median_times(timed, repeats, warmup, steps.device)
    use_grouped_attention()
    n, per_path = len(PARTS), len(timed) // len(paths)
    results = {}
    for i, (linear, attention) in enumerate(paths):
        own = seconds[i * per_path:(i + 1) * per_path]
        results[path_name(linear, attention, list(attentions))] = (
            own[0], own[1], [(name, tree, dict(zip(PARTS, own[2 + n * j: 2 + n * (j + 1)])))
                             for j, (name, tree) in enumerate(trees)])
    return results


def shaped_backbone(shape: str, dtype: str, device: torch.device):
    """A random-weight Llama of ``SHAPES[shape]``, built on ``device`` in ``dtype`` (eval mode, frozen)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.name_or_path = f"shape:{shape}"
    return model.eval().requires_grad_(False)


@torch.no_grad()
def graphed_steps(model: MedusaModel, trees, context: int, repeats: int, warmup: int, compiled: bool = False) -> dict:
    """The backbone's pass over each tree, captured in a CUDA graph over a static cache and replayed (what a server
    pays), and the plain step (one node) likewise: median milliseconds, taking turns."""
    from medusa_train.decoding.graphs import StaticSteps

    device = model.lm_head.weight.device
    sizes = [tree for _, tree in trees]
    graphed = StaticSteps(model, graphs=True, compiled=compiled)
    if compiled:  # a compilation per tree size: more sizes than dynamo's default recompile limit
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(sizes) + 2)
    cache = graphed.cache_for(context + max(t.num_nodes for t in sizes) + 1)
    model(torch.randint(0, model.lm_head.weight.shape[0], (1, context), device=device), past_key_values=cache,
          use_cache=True)
    dtype = model.lm_head.weight.dtype

    def step(tree):
        tokens = torch.zeros(tree.num_nodes, dtype=torch.long, device=device)
        mask, offsets = tree.attention_mask(dtype).to(device), tree.position_offsets.to(device)

        def run():
            graphed(model, tokens, mask, offsets, cache, context)
            for layer in cache.layers:
                layer.cumulative_length.fill_(context)  # the nodes dropped again: every step sees the same context
        return run

    plain_tree = TokenTree([])
    seconds = median_times([step(plain_tree)] + [step(t) for t in sizes], repeats, warmup, device)
    return {"plain_ms": seconds[0] * 1e3,
            "trees": [{"tree": name, "nodes": tree.num_nodes, "forward_ms": s * 1e3}
                      for (name, tree), s in zip(trees, seconds[1:])]}


def weight_bytes_per_step(backbone) -> int:
    """Bytes of weights one decoding step reads: every parameter once, except the input embedding table (one
    row of it; read whole only where it is also the LM head)."""
    embedding, head = backbone.get_input_embeddings().weight, backbone.get_output_embeddings().weight
    tensors = {p.data_ptr(): p for p in backbone.parameters() if p is not embedding} | {head.data_ptr(): head}
    return sum(p.numel() * p.element_size() for p in tensors.values())


def read_bandwidth(device: torch.device, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second this device reads from memory: the median of summing a ``gib`` GiB float32 buffer (on a
    CPU larger than its last-level cache, in 2 MB pages where Linux gives them, as the row kernel's packed weights
    are: ``backbone/huge_pages.py``; in 4 KB pages the AMX CPU read 16.5 GB/s where it reads 28 in 2 MB) or, on CUDA,
    of copying one (bytes read + written, as a copy rate)."""
    from medusa_train.backbone import huge_pages

    count = int(gib * 2**30) // 4
    buffer = (torch.ones(count, device=device) if device.type != "cpu"
              else huge_pages.empty((count,), torch.float32).fill_(1.0))
    copy = torch.empty_like(buffer) if device.type == "cuda" else None
    fn = (lambda: copy.copy_(buffer)) if copy is not None else (lambda: buffer.sum())
    seconds = median_times([fn], repeats, 1, device)[0]
    return buffer.numel() * 4 * (2 if copy is not None else 1) / seconds


def main(**overrides) -> int:
    """Run the benchmark and print a Markdown table. Options: see the module docstring."""
    opts = bench_options(DEFAULTS, overrides)
    if opts is None:
        return 2
    device = torch.device(opts["device"] or ("cuda" if torch.cuda.is_available() else "cpu"))
    num_heads, context = int(opts["num_heads"]), int(opts["context"])
    if opts["reads"] not in ("plain", "next_token", "path", "prefix"):
        print(f"reads={opts['reads']}: must be plain, next_token, path or prefix")
        return 2
    if opts["shape"] and opts["shape"] not in SHAPES:
        print(f"shape={opts['shape']}: must be one of {sorted(SHAPES)}")
        return 2
    if opts["graphs"] in ("true", "compiled") and device.type != "cuda":
        print(f"graphs={opts['graphs']} times CUDA graphs: it needs device=cuda")
        return 2
    backbone = shaped_backbone(opts["shape"], opts["dtype"], device) if opts["shape"] else \
        load_backbone(opts["model"], dtype=opts["dtype"])[0].to(device)
    print(use_row_kernel(backbone)[1])
    use_grouped_attention()  # as load_exported_draft does: medusa_train/backbone/attention.py
    model = MedusaModel.from_backbone(backbone, num_heads=num_heads, share_lm_head=opts["share_lm_head"] == "true",
                                      next_token_input=opts["reads"] != "plain",
                                      path_input=opts["reads"] in ("path", "prefix"),
                                      prefix_attention=opts["reads"] == "prefix",
                                      token_map=torch.arange(int(opts["draft_vocab"])) if opts["draft_vocab"] else None)
    model.eval()
    for part in model.draft_modules():  # as load_heads does: the heads' few rows a step go the backbone's way
        use_row_kernel(part)
    trees = trees_to_measure(opts["sizes"], num_heads)
    linears = {"both": ["gemm", "rows"], "gemm": ["gemm"], "rows": ["rows"]}.get(opts["linears"])
    if linears is None:
        print(f"linears={opts['linears']}: must be both, gemm or rows")
        return 2
    if linear_path(backbone) == "torch GEMM":
        linears = ["gemm"]  # not a float32 CPU backbone, or no kernel here (said above)
    attentions = {"both": ["step", "sdpa"], "step": ["step"], "sdpa": ["sdpa"]}.get(opts["attention"])
    if attentions is None:
        print(f"attention={opts['attention']}: must be step, sdpa or both")
        return 2
    limit_bytes = weight_bytes_per_step(backbone)
    bandwidth = read_bandwidth(device)
    limit_ms = limit_bytes / bandwidth * 1e3
    measured = measure(model, trees, context, int(opts["repeats"]), int(opts["warmup"]), int(opts["seed"]), linears,
                       attentions)
    roof = None
    if device.type == "cpu" and opts["dtype"] == "float32":  # the arithmetic's side of the limit (benchmarks/roof.py)
        from benchmarks.roof import compute_roof, linear_macs_per_token
        from medusa_train.backbone.rows import pack_weight, rows_linear

        packed = {}  # the kernel's weights packed once, as a switched layer holds them

        def kernel(x, w):
            if id(w) not in packed:
                packed[id(w)] = (w, pack_weight(w))
            return rows_linear(x, w, packed[id(w)][1])

        paths = {"gemm": torch.nn.functional.linear, "rows": kernel}
        roof = compute_roof({p: paths[p] for p in linears}, sorted({1} | {t.num_nodes for _, t in trees}),
                            backbone.config.hidden_size, linear_macs_per_token(backbone))

    accuracies = assumed_rank_accuracies()
    given = opts["accept_length"]
    source = f"given ({given})" if given is not None else "expected under the assumed head accuracies"
    machine = device_name(device)
    print(f"\nDecode cost: {backbone.name_or_path}, {opts['dtype']}, {machine}, context={context}, {num_heads} heads "
          f"reading {opts['reads']}{', shared LM head' if opts['share_lm_head'] == 'true' else ''}, scoring "
          f"{model.config.head_vocab_size} tokens, median of {opts['repeats']}. Memory limit of a step: "
          f"{limit_bytes / 1e6:.0f} MB of weights / {bandwidth / 1e9:.1f} GB/s {'copied' if device.type == 'cuda' else 'read'}"
          f" = {limit_ms:.2f} ms. Accept length: {source}.")
    report = {"settings": {k: v for k, v in opts.items() if k != "output"}
              | {"device": machine, "threads": torch.get_num_threads(), "cpu_capability":
                 torch.backends.cpu.get_cpu_capability()},
              "weight_bytes_per_step": limit_bytes, "bandwidth_bytes_per_s": bandwidth, "limit_ms": limit_ms,
              "linears": {}, "compute_roof": roof}
    if roof:
        fma = roof["fma_peak_macs_per_s"]
        print(f"Compute limit (benchmarks/roof.py): {roof['macs_per_token'] / 1e6:.0f} M multiply-adds a token at "
              f"{roof['peak_macs_per_s'] / 1e9:.1f} G/s ("
              + (f"the FMA chains' peak {fma / 1e9:.1f}; " if fma else "the fastest rate measured; ")
              + f"torch's GEMM at 1024 cubed: {roof['gemm_1024_macs_per_s'] / 1e9:.1f}): "
              + ", ".join(f"{n} tokens {ms:.2f} ms" for n, ms in roof["compute_limit_ms"].items())
              + "; each path's rate at that many rows, from the caches (G/s): "
              + "; ".join(f"{p} " + ", ".join(f"{n}: {r / 1e9:.1f}" for n, r in rates.items())
                          for p, rates in roof["path_macs_per_s"].items()))
    for path in measured:
        plain, plain_explicit, results = measured[path]
        linear, _, attention = path.partition(", ")
        names = LINEAR_NAMES[linear] + (f", {ATTENTION_NAMES[attention]}" if attention else "")
        print(f"\n{names}: plain step {plain * 1e3:.2f} ms ({plain / (limit_ms / 1e3):.2f}x the memory "
              f"limit; {plain_explicit * 1e3:.2f} ms given an explicit 4D mask)\n")
        print("| tree | nodes | verify step (ms) | heads' candidates | backbone pass | LM head + argmax | the rest "
              "(acceptance, cache, mask, host) | verify / plain step | backbone pass / plain step | accept length | "
              "expected speedup |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        rows = []
        for name, tree, part in results:
            ms = {k: v * 1e3 for k, v in part.items()}
            rest = ms["verify"] - ms["candidates"] - ms["forward"] - ms["lm_head"]
            relative = part["verify"] / plain
            accept = float(given) if given is not None else expected_accept_length(tree.choices, accuracies)
            print(f"| {name} | {tree.num_nodes} | {ms['verify']:.2f} | {ms['candidates']:.2f} | {ms['forward']:.2f} | "
                  f"{ms['lm_head']:.2f} | {rest:.2f} | {relative:.2f} | {part['forward'] / plain:.2f} | {accept:.2f} | "
                  f"{accept / relative:.2f}x |")
            rows.append({"tree": name, "nodes": tree.num_nodes, "verify_ms": ms["verify"],
                         "candidates_ms": ms["candidates"], "forward_ms": ms["forward"], "lm_head_ms": ms["lm_head"],
                         "rest_ms": rest, "relative_cost": relative, "forward_relative": part["forward"] / plain,
                         "accept_length": accept, "expected_speedup": accept / relative})
        report["linears"][path] = {"plain_ms": plain * 1e3, "plain_explicit_mask_ms": plain_explicit * 1e3,
                                   "trees": rows}
    if opts["graphs"] in ("true", "compiled"):  # compiled: inductor's fused kernels inside each captured graph
        report["graphed"] = graphed_steps(model, trees, context, int(opts["repeats"]), int(opts["warmup"]),
                                          compiled=opts["graphs"] == "compiled")
        report["graphed"]["compiled"] = opts["graphs"] == "compiled"
        plain = report["graphed"]["plain_ms"]
        print(f"\nCUDA graphs over a static cache: plain step {plain:.2f} ms ({plain / limit_ms:.2f}x the memory limit)"
              "\n\n| tree | nodes | backbone pass, graphed (ms) | / graphed plain step |\n|---|---:|---:|---:|")
        for row in report["graphed"]["trees"]:
            print(f"| {row['tree']} | {row['nodes']} | {row['forward_ms']:.2f} | {row['forward_ms'] / plain:.2f} |")
    draft = f"-vocab{opts['draft_vocab']}" if opts["draft_vocab"] else ""
    output = Path(opts["output"] or f"outputs/bench/decode-{opts['dtype']}-{opts['reads']}{draft}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=1) + "\n")
    last = report["linears"][list(measured)[-1]]
    print(f"\nwrote {output}" + (f" and {plot(last['trees'], last['plain_ms'] / 1e3, report['settings'] | {'device': str(device)}, output.with_suffix('.png'))}"
                                 if _has_matplotlib() else " (pip install matplotlib for the plot)"))
    return 0


def _has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def plot(rows: list[dict], plain: float, settings: dict, path: Path) -> Path:
    """Verify-step cost in plain steps against tree size (the break-even accepted length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["nodes"] for r in rows], [r["relative_cost"] for r in rows], "o-")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("tree nodes (root included)")
    ax.set_ylabel("verify step / plain step")
    ax.set_title(f"{settings['dtype']} on {settings['device']}, {settings['threads']} threads: plain step "
                 f"{plain * 1e3:.1f} ms", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    import sys

    raise SystemExit(main(**dict(arg.split("=", 1) for arg in sys.argv[1:])))
