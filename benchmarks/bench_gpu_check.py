"""The GPU check that fits a loan (``scripts/gpu_check.sh`` runs it on the device; any CUDA machine can run it):

    python -m benchmarks gpu_check heads=<export> prompts=<validation prompts .jsonl> out=outputs/gpu-check

1. Figures before decoding, float32 on the GPU: the backbone's greedy continuations of ``parity`` validation prompts
   (made there), the heads walked along them (the training log's figures: K-chains 1..3 and the built-in tree cut to
   16 nodes) beside what decoding those prompts accepts with each tree.
2. build-tree on the GPU in bfloat16 (``nodes=auto``: the verify step timed at every size there, the lookup chain
   sized by the walk over ``calibration`` validation prompts and checked by the guard's decoding).
3. evaluate, bfloat16: the tree it chose on ``mtbench`` MT-Bench first turns (our decoder beside HF ``generate`` and
   prompt lookup, tokens per forward and tokens/s) and on the validation prompts (expected beside measured).

Writes ``summary.json`` and ``summary.md`` under ``out`` (with each stage's report); prints the summary last.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def parity(heads: str, prompts: list[str], count: int, device: str, new_tokens: int, out: Path) -> dict:
    """Walk beside decoding, float32, on ``device``."""
    import torch

    from medusa_train.backbone.generation import eos_token_ids
    from medusa_train.config.model import EvalModelConfig
    from medusa_train.data.validation import continuations
    from medusa_train.decoding import MedusaTree, medusa_generate
    from medusa_train.model.load import load_heads
    from medusa_train.model.walk import walk_figures

    model, tokenizer = load_heads(heads, EvalModelConfig(dtype="float32"), device)
    sequences = continuations(model.backbone, tokenizer, prompts, new_tokens, root=out / "continuations").sequences[:count]
    depth = min(model.config.depth, 3)
    tree16 = MedusaTree.from_name("default").truncated(max_nodes=16, max_depth=depth)
    trees = {f"K{k}": MedusaTree.chain(k) for k in range(1, depth + 1)} | {"tree16": tree16}
    walked = walk_figures(model, sequences, chains=range(1, depth + 1), tree_choices=tree16.choices)
    expected = {f"K{k}": walked[f"chain{k}"] for k in range(1, depth + 1)} | {"tree16": walked["tree"]}
    eos = eos_token_ids(model.backbone, tokenizer)
    rows = {}
    for name, tree in trees.items():
        gained = steps = same = 0
        for ids, prompt_len in sequences:
            outcome = medusa_generate(model, ids[:, :prompt_len], tree, max_new_tokens=new_tokens, eos_token_id=eos)
            gained, steps = gained + outcome.new_tokens - 1, steps + outcome.steps
            same += torch.equal(outcome.sequences[0].cpu(), ids[0].cpu())
        rows[name] = {"expected": round(expected[name], 4), "measured": round(gained / max(steps, 1), 4),
                      "gap": round(gained / max(steps, 1) - expected[name], 4), "texts_equal": same,
                      "texts": len(sequences)}
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {"device": device, "dtype": "float32", "new_tokens": new_tokens, "rows": rows,
            "outside_draft_vocab": round(walked["outside_draft_vocab"], 4)}


def save(folder: Path, summary: dict) -> None:
    """``summary.json`` as it stands, printed too (stdout may be all that comes back)."""
    text = json.dumps(summary, indent=1)
    (folder / "summary.json").write_text(text + "\n")
    print(f"gpu_check summary so far: {json.dumps(summary)}", flush=True)


def main(heads: str, prompts: str, out: str = "outputs/gpu-check", device: str | None = None, parity_prompts: str = "8",
         calibration: str = "16", mtbench: str = "8", new_tokens: str = "128", max_nodes: str = "128") -> int:
    import torch

    from medusa_train.cli.build_tree import build_build_tree_config
    from medusa_train.cli.build_tree import run as build_tree
    from medusa_train.cli.evaluate import build_eval_config
    from medusa_train.cli.evaluate import run as evaluate
    from medusa_train.data.benchmarks import load_benchmark

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    texts = [p.turns[0] for p in load_benchmark(prompts)]
    summary: dict = {"device": torch.cuda.get_device_name(0) if device == "cuda" else device,
                     "torch": torch.__version__, "heads": heads}
    started = time.perf_counter()
    summary["parity"] = parity(heads, texts[:2 * int(parity_prompts)], int(parity_prompts), device, 64, folder)
    summary["parity_s"] = round(time.perf_counter() - started, 1)
    save(folder, summary)  # each stage's figures land as soon as they exist: a loan can end mid-run
    tree = folder / "tree.yaml"
    fitted = build_tree(build_build_tree_config({
        "heads": heads, "nodes": "auto", "max_nodes": int(max_nodes), "calibration": prompts,
        "num_prompts": int(calibration), "exclude_training_data": False, "max_new_tokens": int(new_tokens),
        "answer_tokens": int(new_tokens), "model": {"dtype": "bfloat16"}, "device": device, "output": str(tree)}))
    summary["tree"] = {k: fitted.get(k) for k in ("expected_accept_length", "lookup_depth")}
    summary["tree"]["nodes"] = len(fitted["choices"]) + 1 + fitted["lookup_depth"]
    summary["tree"].update({k: (fitted.get("auto") or {}).get(k) for k in ("chosen_nodes", "expected_speedup")})
    summary["tree"]["guard"] = fitted.get("guard")
    summary["build_tree_s"] = round(time.perf_counter() - started - summary["parity_s"], 1)
    save(folder, summary)
    for name, bench in (("mtbench", {"source": "packaged:mt-bench", "limit": int(mtbench), "turns": 1}),
                        ("validation", {"source": prompts, "limit": int(calibration), "turns": 1, "pick": "first"})):
        report = evaluate(build_eval_config({
            "heads": heads, "tree": str(tree), "bench": bench, "generation": {"max_new_tokens": int(new_tokens)},
            "model": {"dtype": "bfloat16"}, "device": device, "progress": False,
            "output_dir": str(folder / f"eval-{name}")}))
        methods = report["methods"]
        summary[name] = {"rows": {k: {"tokens_per_forward": round(m["tokens_per_forward"], 3),
                                      "tokens_per_s": round(m["tokens_per_s"], 1), "speedup": round(m["speedup"], 3)}
                                  for k, m in methods.items()},
                         "expected": report.get("expected"), "mismatches": report["mismatches"]}
        save(folder, summary)
    summary["total_s"] = round(time.perf_counter() - started, 1)
    save(folder, summary)
    lines = [f"# GPU check on {summary['device']} (torch {summary['torch']})", "",
             "## figures before decoding, float32: expected (walk) beside measured (decoding), tokens per step",
             *(f"- {k}: {r['expected']:.3f} expected, {r['measured']:.3f} measured (gap {r['gap']:+.3f}; "
               f"{r['texts_equal']}/{r['texts']} texts equal)" for k, r in summary["parity"]["rows"].items()),
             "", f"## tree chosen here (bfloat16): {summary['tree']}", ""]
    for name in ("mtbench", "validation"):
        lines.append(f"## evaluate on {name} (bfloat16): mismatches {summary[name]['mismatches']}, "
                     f"expected {summary[name]['expected']}")
        lines += [f"- {k}: {r['tokens_per_forward']} tokens per forward, {r['tokens_per_s']} tokens/s, "
                  f"{r['speedup']}x over HF generate" for k, r in summary[name]["rows"].items()]
    (folder / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0
