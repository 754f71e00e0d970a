"""Cost of one Medusa verify step relative to one plain decoding step, by tree size.

    python -m benchmarks decode dtype=bfloat16 context=256 repeats=20 device=cpu

For each tree (root only, a chain of ``num_heads``, and the first 16/32/64 nodes of ``default`` in
their listed, most-likely-first order) it times, at the same context length:

- a plain step: the backbone over 1 new token + LM head + argmax;
- a verify step: the heads' top-k at the last token, one backbone pass over every tree node
  (4D tree mask), the LM head at every node, greedy acceptance and KV compaction; and its parts
  alone (the heads' candidates, the backbone pass, the LM head + argmax over the nodes), the rest
  being acceptance, cache compaction, the mask and host syncs.

``relative cost`` = verify / plain is the accept length at which Medusa breaks even; the expected
speedup is ``accept_length / relative cost``, with the accept length either given (``accept_length=``)
or the tree's expected value under the assumed head accuracies of ``default`` (heads at
initialisation are used here: only cost is measured).

Options (``key=value``): model, dtype (bfloat16), device (cuda if available, else cpu), context (256),
repeats (20), warmup (3), num_heads (4), sizes (``1,chain,16,32,64``), threads, accept_length, seed,
reads (``plain``; ``next_token`` or ``path``: heads that read the next token or their tree path, whose
candidates cost one head call per tree depth; ``prefix``: path heads reading through a prefix attention
layer, which also runs over each step's accepted tokens), share_lm_head (false), draft_vocab (K: heads
scoring a K-token draft vocabulary, ``heads.draft_vocab_size=K``; the first K token ids stand in for the
data's most frequent ones, which costs the same), output (the JSON
written, default ``outputs/bench/decode-<dtype>-<reads>.json``; a PNG plot of the curve goes beside it).

``scripts/build_tree.py nodes=auto`` measures the same kind of curve for the fitted tree itself
(``medusa_train/tree/cost.py``) and picks its size from it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks.bench_options import bench_options
from benchmarks.steps import DecodeStepParts
from medusa_train import MedusaModel, load_backbone
from medusa_train.backbone.rows import linear_path, use_row_kernel
from medusa_train.decoding import MedusaTree
from medusa_train.tree.cost import median_times
from medusa_train.tree.fit import assumed_rank_accuracies, expected_accept_length

DEFAULTS = dict(model="packaged:smollm2-135m-instruct", dtype="bfloat16", device=None, context=256, repeats=20,
                warmup=3, num_heads=4, sizes="1,chain,16,32,64", threads=None, accept_length=None, seed=0,
                reads="plain", share_lm_head="false", draft_vocab=None, output=None)


def trees_to_measure(sizes: str, num_heads: int) -> list[tuple[str, MedusaTree]]:
    """``1`` = root only, ``chain`` = each head's top-1, ``N`` = the first N nodes of ``default``."""
    default = MedusaTree.from_name("default").truncated(max_depth=num_heads)
    trees = []
    for size in str(sizes).split(","):
        size = size.strip()
        if size == "chain":
            trees.append((f"chain({num_heads})", MedusaTree.chain(num_heads)))
        elif int(size) == 1:
            trees.append(("root only", MedusaTree([])))
        else:
            trees.append((f"default[:{size}]", default.truncated(max_nodes=int(size))))
    return trees


PARTS = ("verify", "candidates", "forward", "lm_head")  #: what each tree's step is timed as, whole and by part


def measure(model: MedusaModel, trees, context: int, repeats: int, warmup: int,
            seed: int) -> tuple[float, float, list]:
    """Median seconds at ``context`` cached tokens: a plain step (the model's own mask path, as in
    ``generate``), the same step given an explicit 4D mask, and for each tree its verify step and, alone,
    the parts of it: the heads' candidates, the backbone's pass over the nodes, the LM head (+ argmax)
    over the nodes: ``(plain, plain_explicit, [(name, tree, {part: seconds})])``."""
    steps = DecodeStepParts(model, context, seed)
    timed = [steps.plain_step, lambda: steps.plain_step(explicit_mask=True)]
    for _, tree in trees:
        timed += [steps.verify_step(tree), steps.candidates_step(tree), steps.forward_step(tree),
                  steps.lm_head_step(tree.num_nodes)]
    seconds = median_times(timed, repeats, warmup, steps.device)
    n = len(PARTS)
    return seconds[0], seconds[1], [(name, tree, dict(zip(PARTS, seconds[2 + n * i: 2 + n * (i + 1)])))
                                    for i, (name, tree) in enumerate(trees)]


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
    backbone, _ = load_backbone(opts["model"], dtype=opts["dtype"])
    backbone.to(device)
    _, linear_note = use_row_kernel(backbone)
    print(linear_note)
    model = MedusaModel.from_backbone(backbone, num_heads=num_heads, share_lm_head=opts["share_lm_head"] == "true",
                                      next_token_input=opts["reads"] != "plain",
                                      path_input=opts["reads"] in ("path", "prefix"),
                                      prefix_attention=opts["reads"] == "prefix",
                                      token_map=torch.arange(int(opts["draft_vocab"])) if opts["draft_vocab"] else None)
    model.eval()
    trees = trees_to_measure(opts["sizes"], num_heads)
    plain, plain_explicit, results = measure(model, trees, context, int(opts["repeats"]), int(opts["warmup"]), int(opts["seed"]))

    accuracies = assumed_rank_accuracies()
    given = opts["accept_length"]
    source = f"given ({given})" if given is not None else "expected under the assumed head accuracies"
    print(f"\nDecode cost: {opts['model']}, {opts['dtype']}, {device}, threads={torch.get_num_threads()}, "
          f"context={context}, {num_heads} heads reading {opts['reads']}"
          f"{', shared LM head' if opts['share_lm_head'] == 'true' else ''}, scoring "
          f"{model.config.head_vocab_size} tokens, median of {opts['repeats']}. "
          f"Plain step: {plain * 1e3:.2f} ms ({plain_explicit * 1e3:.2f} ms when given an explicit 4D mask). "
          f"Accept length: {source}.\n")
    print("| tree | nodes | verify step (ms) | heads' candidates | backbone pass | LM head + argmax | the rest "
          "(acceptance, cache, mask, host) | relative cost (= break-even accept length) | accept length | "
          "expected speedup |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for name, tree, part in results:
        ms = {k: v * 1e3 for k, v in part.items()}
        rest = ms["verify"] - ms["candidates"] - ms["forward"] - ms["lm_head"]
        relative = part["verify"] / plain
        accept = float(given) if given is not None else expected_accept_length(tree.choices, accuracies)
        print(f"| {name} | {tree.num_nodes} | {ms['verify']:.2f} | {ms['candidates']:.2f} | {ms['forward']:.2f} | "
              f"{ms['lm_head']:.2f} | {rest:.2f} | {relative:.2f} | {accept:.2f} | {accept / relative:.2f}x |")
        rows.append({"tree": name, "nodes": tree.num_nodes, "verify_ms": ms["verify"],
                     "candidates_ms": ms["candidates"], "forward_ms": ms["forward"], "lm_head_ms": ms["lm_head"],
                     "rest_ms": rest, "relative_cost": relative,
                     "accept_length": accept, "expected_speedup": accept / relative})
    draft = f"-vocab{opts['draft_vocab']}" if opts["draft_vocab"] else ""
    output = Path(opts["output"] or f"outputs/bench/decode-{opts['dtype']}-{opts['reads']}{draft}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in opts.items() if k != "output"} | {"device": str(device),
                                                                  "threads": torch.get_num_threads(),
                                                                  "linear_layers": linear_path(backbone)}
    output.write_text(json.dumps({"settings": settings, "plain_ms": plain * 1e3,
                                  "plain_explicit_mask_ms": plain_explicit * 1e3, "trees": rows}, indent=1) + "\n")
    print(f"\nwrote {output}" + (f" and {plot(rows, plain, settings, output.with_suffix('.png'))}"
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
