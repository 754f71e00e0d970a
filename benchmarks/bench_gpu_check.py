"""The GPU check that fits a loan (``scripts/gpu_check.sh`` runs it on the device; any CUDA machine can run it):

    python -m benchmarks gpu_check heads=<export> trees=<tree64.yaml>,<tree128.yaml> draft=<an EAGLE-3 export> \
        draft_tree=<tree.yaml> prompts=<validation prompts .jsonl> out=outputs/gpu-check

Trees are fitted here beforehand (``build-tree nodes=64|128 lookup_depth=8``: the walk needs no GPU), so the device
only decodes, in bfloat16, ``mtbench`` MT-Bench first turns of ``new_tokens`` tokens each:

1. the heads with the first tree (a hybrid: heads' nodes and a lookup chain) beside HF ``generate``, plain decoding
   replayed from CUDA graphs (evaluate's default on CUDA: every row's speedup divides by the faster plain), the draft
   alone and the lookup chain alone (the report's rows), tokens per forward and tokens/s; then the same again with HF
   prompt lookup beside it (each report's ``plain_steadiness`` says whether its plain steps were steady);
2. the heads with each further tree (``generate`` beside it);
3. the EAGLE-3 draft with its tree (``generate`` beside it);
4. with the time left under ``budget_s``: where a graphed step's time goes (``benchmarks loop graphs=true``, the
   first tree, one round: the heads' candidates, the tree pass, the LM head, acceptance and compaction per step,
   each synchronised, beside the timed steps);
5. with the time still left: figures before decoding in float32 (the backbone's greedy continuations of
   ``parity`` validation prompts, made there; the heads walked along them beside what decoding them accepts).

Writes ``summary.json`` and ``summary.md`` under ``out`` (with each stage's report) after every stage, printed too.
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
    from medusa_train.decoding import TokenTree, tree_generate
    from medusa_train.model.load import load_exported_draft
    from medusa_train.model.walk import walk_figures

    model, tokenizer = load_exported_draft(heads, EvalModelConfig(dtype="float32"), device)
    sequences = continuations(model.backbone, tokenizer, prompts, new_tokens, root=out / "continuations").sequences[:count]
    depth = min(model.config.depth, 3)
    tree16 = TokenTree.from_name("default").truncated(max_nodes=16, max_depth=depth)
    trees = {f"K{k}": TokenTree.chain(k) for k in range(1, depth + 1)} | {"tree16": tree16}
    walked = walk_figures(model, sequences, chains=range(1, depth + 1), tree_choices=tree16.choices)
    expected = {f"K{k}": walked[f"chain{k}"] for k in range(1, depth + 1)} | {"tree16": walked["tree"]}
    eos = eos_token_ids(model.backbone, tokenizer)
    rows = {}
    for name, tree in trees.items():
        gained = steps = same = 0
        for ids, prompt_len in sequences:
            outcome = tree_generate(model, ids[:, :prompt_len], tree, max_new_tokens=new_tokens, eos_token_id=eos)
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


def decode(heads: str, tree: str, folder: Path, device: str, limit: int, new_tokens: int, prompt_lookup: bool) -> dict:
    """``evaluate`` on MT-Bench first turns in bfloat16: each row's tokens per forward, tokens/s and speedup."""
    from medusa_train.cli.evaluate import build_eval_config
    from medusa_train.cli.evaluate import run as evaluate

    report = evaluate(build_eval_config({
        "heads": heads, "tree": tree, "bench": {"source": "packaged:mt-bench", "limit": limit, "turns": 1},
        "generation": {"max_new_tokens": new_tokens}, "model": {"dtype": "bfloat16"}, "device": device,
        "progress": False, "baselines": {"prompt_lookup": prompt_lookup}, "output_dir": str(folder)}))
    return {"tree": tree, "plain_steadiness": report["plain_steadiness"], "rows": {k: {"tokens_per_forward": round(m["tokens_per_forward"], 3),
                                       "tokens_per_s": round(m["tokens_per_s"], 1), "speedup": round(m["speedup"], 3)}
                                   for k, m in report["methods"].items()},
            "expected": report.get("expected"), "mismatches": report["mismatches"],
            "plain_reference": report["plain_reference"], "graph_captures": report["settings"]["graph_captures"],
            "draft_graph_captures": report["settings"]["draft_graph_captures"],
            "garbage_collections": report["settings"]["garbage_collections"]}


def main(heads: str, trees: str, draft: str | None = None, draft_tree: str = "chain", prompts: str | None = None,
         out: str = "outputs/gpu-check", device: str | None = None, mtbench: str = "8", new_tokens: str = "128",
         parity_prompts: str = "8", budget_s: str = "420") -> int:
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    summary: dict = {"device": torch.cuda.get_device_name(0) if device == "cuda" else device,
                     "torch": torch.__version__, "heads": heads, "draft": draft, "runs": {}}
    started = time.perf_counter()
    first, *others = trees.split(",")
    # the first tree twice: without prompt lookup, then with it. On 2026-12-01 the first evaluation in the process
    # (which had prompt lookup) timed its graphed plain decoding 7-10x slower on 2 of 8 prompts in both device
    # calls, the second was steady: this order tells whether being first or prompt lookup does it
    runs = [(f"heads, {Path(first).stem}, first evaluation", heads, first, False),
            (f"heads, {Path(first).stem}", heads, first, True)]
    runs += [(f"heads, {Path(t).stem}", heads, t, False) for t in others]
    runs += [(f"EAGLE-3, {Path(draft_tree).stem}", draft, draft_tree, False)] if draft else []
    for i, (name, draft, tree, prompt_lookup) in enumerate(runs):
        summary["runs"][name] = decode(draft, tree, folder / f"eval-{i}", device, int(mtbench), int(new_tokens),
                                       prompt_lookup=prompt_lookup)
        summary["runs"][name]["seconds"] = round(time.perf_counter() - started, 1)
        save(folder, summary)  # each stage's figures land as soon as they exist: a loan can end mid-run
    if time.perf_counter() - started < float(budget_s) - 90:  # one round of the loop took ~45 s (estimated)
        from benchmarks.bench_loop import main as loop

        loop(heads=heads, tree=first, dtype="bfloat16", prompts=mtbench, max_new_tokens=new_tokens, rounds=1,
             repeats=5, graphs="true" if device == "cuda" else "false", output=str(folder / "loop.json"))
        looped = json.loads((folder / "loop.json").read_text())
        summary["loop"] = {**looped["rounds"][0], "graphs": looped["graphs"]}
        summary["loop"]["seconds"] = round(time.perf_counter() - started, 1)
        save(folder, summary)
    if prompts and time.perf_counter() - started < float(budget_s):
        from medusa_train.data.benchmarks import load_benchmark

        texts = [p.turns[0] for p in load_benchmark(prompts)]
        summary["parity"] = parity(heads, texts[:2 * int(parity_prompts)], int(parity_prompts), device, 64, folder)
    summary["total_s"] = round(time.perf_counter() - started, 1)
    save(folder, summary)
    lines = [f"# GPU check on {summary['device']} (torch {summary['torch']}), {mtbench} MT-Bench first turns, "
             f"{new_tokens} tokens, bfloat16", ""]
    for name, run in summary["runs"].items():
        lines.append(f"## {name} ({run['tree']}): mismatches {run['mismatches']}, expected {run['expected']}, "
                     f"CUDA graphs captured {run['graph_captures']} (the draft's: {run['draft_graph_captures']})")
        lines += [f"- {k}: {r['tokens_per_forward']} tokens per forward, {r['tokens_per_s']} tokens/s, "
                  f"{r['speedup']}x over {run['plain_reference']} (the faster plain)" for k, r in run["rows"].items()]
        steady = run["plain_steadiness"]
        if steady and steady["unsteady"]:
            lines.append(f"- unsteady plain reference: median {steady['median_ms']:.2f} ms a step; "
                         + ", ".join(f"prompt {u['id']} {u['ms']:.1f} ms" for u in steady["unsteady"]))
    if "loop" in summary:
        loop_round = summary["loop"]
        kind = "a graphed step" if loop_round["graphs"] else "an eager step"
        lines += ["", f"## {kind}, {Path(first).stem}: {loop_round['real']['verify_ms']:.2f} ms "
                  f"({loop_round['real']['accepted_length']:.2f} tokens a step; timed verify "
                  f"{loop_round['timed']['verify_ms']:.2f} ms, plain step {loop_round['timed']['plain_ms']:.2f} ms)",
                  *(f"- {name}: {ms:.2f} ms a step" for name, ms in loop_round["phases_ms"].items())]
    if "parity" in summary:
        lines += ["", "## figures before decoding, float32: expected (walk) beside measured (decoding), tokens per step",
                  *(f"- {k}: {r['expected']:.3f} expected, {r['measured']:.3f} measured (gap {r['gap']:+.3f}; "
                    f"{r['texts_equal']}/{r['texts']} texts equal)" for k, r in summary["parity"]["rows"].items())]
    (folder / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0
