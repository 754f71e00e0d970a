"""The peer table: Model Optimizer's drafts (``python -m benchmarks peers``) and ours at the same data, each scored by
the same commands on the same prompts. Runs in the project's environment (``.venv``), after the peers' trainings:

    python -m benchmarks peers_score
    python -m benchmarks peers_score drafts=theirs=outputs/peers/c1200/eagle3-peer,ours=outputs/curve/eagle3-1200

Each draft is a run folder holding ``export/`` (a peer run of ``benchmarks/bench_peers.py``, or one of our training
runs); per draft, each stage skipped when its file exists in the run folder:

1. ``walk.json``: our validation walk (``training/validation_walk.py``, as training logs it) of the export on the
   validation prompts, with the validation settings of the matching experiment of ours (``eagle3`` for an EAGLE-3
   draft, ``served`` for Medusa heads): tokens per step at K = 1..3 as a chain, what the training log would promise.
2. ``served.json``: ``medusa-train choose-k source=validation ks=[1,2,3]`` on the first ``prompts`` validation prompts
   (one vLLM server per K): tokens per step as vLLM accepts them (the learning curve's ``served`` figures).
3. ``served-mtbench.json``: the same on the first ``prompts`` MT-Bench first turns.
4. ``eval-chain<K>/report.json``: ``medusa-train evaluate`` with our decoder and a K-chain (K = the largest of
   ``ks`` the draft reaches) on the same MT-Bench first turns beside HF ``generate``: tokens per step, speedup,
   mismatches (greedy: must be 0 unexplained).

Then ``score.json`` and ``score.md`` under ``out``: one row per draft with the peers' training time and peak memory
(their ``result.json``) or ours (the training log's last ``trained steps ... peak memory`` line, where it has one).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from benchmarks.bench_curve import choose_k, offline_env

#: label=run folder: Model Optimizer's runs (``bench_peers``: ``-peer`` at its defaults, ``-ours`` at our step budget)
#: and ours at the same 1,200 conversations (the learning curve's points)
DEFAULTS = {"drafts": "modelopt-eagle3-defaults=outputs/peers/c1200/eagle3-peer,"
                      "modelopt-eagle3-our-budget=outputs/peers/c1200/eagle3-ours,"
                      "medusa-train-eagle3=outputs/curve/eagle3-1200,"
                      "modelopt-medusa-defaults=outputs/peers/c1200/medusa-peer,"
                      "modelopt-medusa-our-budget=outputs/peers/c1200/medusa-ours,"
                      "medusa-train-medusa-served=outputs/curve/served-1200",
            "data": "outputs/curve/distill-vllm-2800.jsonl", "model": "packaged:smollm2-135m-instruct",
            "ks": "1,2,3", "prompts": "16", "max_tokens": "128", "dtype": "bfloat16", "out": "outputs/peers/c1200",
            "stages": "walk,served,served-mtbench,decode", "threads": ""}
#: the experiment of ours whose validation settings a family's draft is walked with
EXPERIMENTS = {"eagle3": ("eagle3", "eagle3"), "medusa": ("medusa1", "served")}


def drafts_of(opts: dict) -> dict[str, Path]:
    pairs = [d.split("=", 1) for d in opts["drafts"].split(",") if d.strip()]
    return {label.strip(): Path(folder.strip()) for label, folder in pairs}


def ks_of(opts: dict, depth: int) -> list[int]:
    return [k for k in (int(x) for x in opts["ks"].split(",")) if k <= depth]


# ---------------------------------------------------------------------------------------------- stages
def walk(opts: dict, folder: Path) -> dict:
    """Our validation walk of ``folder/export`` (in this process), as the matching experiment's training logs it."""
    import accelerate
    import torch

    from medusa_train.config.compose import compose_config
    from medusa_train.config.evaluate import EvalModelConfig
    from medusa_train.config.train import build_config
    from medusa_train.model.load import load_exported_draft, read_exported_draft
    from medusa_train.training import validation_walk

    heads = read_exported_draft(folder / "export")
    recipe, experiment = EXPERIMENTS[heads.family.name]
    cfg = build_config(compose_config("train", [f"+recipe={recipe}", f"experiment={experiment}",
                                                f"data.source={opts['data']}", f"model.name_or_path={opts['model']}",
                                                f"model.dtype={opts['dtype']}"]))
    bf16 = opts["dtype"] == "bfloat16"
    acc = accelerate.Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="bf16" if bf16 else "no")
    model, tokenizer = load_exported_draft(heads, EvalModelConfig(name_or_path=opts["model"], dtype=opts["dtype"]),
                                  device=str(acc.device))
    walked = validation_walk.prepare(cfg, acc, tokenizer, model.backbone, heads.family.captured(model.config))
    served = walked.first(int(opts["prompts"])).record(model, acc)  # the prompts choose-k serves
    return {**walked.record(model, acc), "depth": model.config.depth, "family": heads.family.name,
            "on_served_prompts": {k: v for k, v in served.items() if k.startswith("validation/K")},
            "walked_with": f"+recipe={recipe} experiment={experiment}'s data.validation, {opts['dtype']}"}


def serve(opts: dict, folder: Path, source: str, target: Path, depth: int) -> None:
    """vLLM's tokens per step for the draft at each K it reaches (the learning curve's served figures)."""
    choose_k(folder / "export", source, target, ",".join(map(str, ks_of(opts, depth))), opts["prompts"],
             opts["max_tokens"], opts["dtype"])


def chain_tree(out: Path, k: int) -> Path:
    """A K-chain tree file (each depth's top guess), for ``evaluate tree=``."""
    path = out / "trees" / f"chain-{k}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("choices: [" + ", ".join("[" + ", ".join(["0"] * (d + 1)) + "]" for d in range(k)) + "]\n")
    return path


def decode(opts: dict, folder: Path, out: Path, k: int) -> Path:
    target = folder / f"eval-chain{k}"
    if not (target / "report.json").is_file():
        subprocess.run([sys.executable, "-m", "medusa_train", "evaluate", f"heads={folder / 'export'}",
                        f"tree={chain_tree(out, k)}", f"model.dtype={opts['dtype']}", f"bench.limit={opts['prompts']}",
                        "bench.turns=1", f"generation.max_new_tokens={opts['max_tokens']}",
                        "baselines.prompt_lookup=false", f"output_dir={target}"], check=True, env=offline_env())
    return target / "report.json"


# ---------------------------------------------------------------------------------------------- the table
TRAINED = re.compile(r"trained steps (\d+)-(\d+) in ([\d.]+) s \([\d.]+ min\); peak memory ([\d.]+) GiB resident")


def training_figures(folder: Path) -> dict:
    """Training time and peak memory: a peer run's ``result.json``, or our run's log (``<folder>.log``, the curve's
    log beside the run folder, or ``entry.log`` inside it)."""
    result = folder / "result.json"
    if result.is_file():
        r = json.loads(result.read_text())
        return {"train_min": round(r["train_s"] / 60, 1), "peak_gib": round(r["peak_rss_mib"] / 1024, 2),
                "steps": r["steps"], "examples": r["examples"], "hyper": r["hyper"], "trained_by": "nvidia-modelopt"}
    for log in (folder.parent / f"{folder.name}.log", folder / "entry.log"):
        found = TRAINED.findall(log.read_text(errors="replace")) if log.is_file() else []
        if found:
            first, last, seconds, gib = found[-1]
            return {"train_min": round(float(seconds) / 60, 1), "peak_gib": float(gib), "steps": int(last),
                    "resumed_from": int(first) - 1 if int(first) > 1 else None, "trained_by": "medusa-train"}
    return {"trained_by": "medusa-train", "train_min": None, "peak_gib": None}


def row(label: str, folder: Path, opts: dict) -> dict:
    walked = json.loads((folder / "walk.json").read_text()) if (folder / "walk.json").is_file() else {}
    r = {"draft": label, "folder": str(folder), **training_figures(folder),
         "walked": {k: walked.get(f"validation/K{k}") for k in ks_of(opts, walked.get("depth", 9))},
         # walked on the prompts served on the validation set (the first ``prompts``): compared like with like
         "walked_served_prompts": {k: (walked.get("on_served_prompts") or {}).get(f"validation/K{k}")
                                   for k in ks_of(opts, walked.get("depth", 9))}}
    logged = folder / "export" / "validation.json"
    if logged.is_file():
        figures = json.loads(logged.read_text())
        r["training_log"] = {k: figures.get(f"validation/K{k}") for k in r["walked"]}
    for name, key in (("served.json", "served_validation"), ("served-mtbench.json", "served_mtbench")):
        if (folder / name).is_file():
            r[key] = {x["k"]: round(x["tokens_per_step"], 4) for x in json.loads((folder / name).read_text())["rows"]
                      if x["k"] > 0}
    reports = sorted(folder.glob("eval-chain*/report.json"))
    if reports:
        rep = json.loads(reports[-1].read_text())
        r["decoded_mtbench"] = {"k": int(reports[-1].parent.name.removeprefix("eval-chain")),
                                "tokens_per_step": round(rep["mean_accepted_length"], 4),
                                "speedup": round(rep["speedup"], 3), "mismatches": rep["mismatches"],
                                "unexplained": rep["mismatches_unexplained"]}
    return r


def markdown(rows: list[dict], opts: dict) -> str:
    ks = [int(x) for x in opts["ks"].split(",")]

    def cells(d: dict | None):
        return [f"{d[k]:.3f}" if d and d.get(k) is not None else "" for k in ks]

    head = ["draft", "train min", "peak GiB", *[f"walked K={k}" for k in ks],
            *[f"walked on the served prompts K={k}" for k in ks], *[f"served val K={k}" for k in ks],
            *[f"served MT-Bench K={k}" for k in ks], "ours decoding MT-Bench (K, tokens/step, speedup, unexplained)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        d = r.get("decoded_mtbench")
        decoded = f"K={d['k']}: {d['tokens_per_step']:.3f}, {d['speedup']:.2f}x, {d['unexplained']}" if d else ""
        lines.append("| " + " | ".join([r["draft"], str(r.get("train_min") or ""), str(r.get("peak_gib") or ""),
                                         *cells(r.get("walked")), *cells(r.get("walked_served_prompts")),
                                         *cells(r.get("served_validation")),
                                         *cells(r.get("served_mtbench")), decoded]) + " |")
    return "\n".join(lines) + "\n"


def main(**overrides) -> int:
    from benchmarks.bench_options import bench_options

    opts = bench_options(DEFAULTS, overrides)
    if opts is None:
        return 2
    out = Path(opts["out"])
    stages = {s.strip() for s in opts["stages"].split(",") if s.strip()}
    drafts = drafts_of(opts)
    missing = [f"{label} ({folder / 'export'})" for label, folder in drafts.items()
               if not (folder / "export" / "config.json").is_file()]
    for label, folder in drafts.items():
        if not (folder / "export" / "config.json").is_file():
            continue
        if "walk" in stages and not (folder / "walk.json").is_file():
            print(f"== walk {label} on the validation prompts", flush=True)
            (folder / "walk.json").write_text(json.dumps(walk(opts, folder), indent=1) + "\n")
        depth = json.loads((folder / "walk.json").read_text())["depth"] if (folder / "walk.json").is_file() else 3
        if "served" in stages and not (folder / "served.json").is_file():
            print(f"== serve {label} on the validation prompts in vLLM", flush=True)
            serve(opts, folder, "validation", folder / "served.json", depth)
        if "served-mtbench" in stages and not (folder / "served-mtbench.json").is_file():
            print(f"== serve {label} on MT-Bench in vLLM", flush=True)
            serve(opts, folder, "packaged:mt-bench", folder / "served-mtbench.json", depth)
        if "decode" in stages:
            print(f"== decode {label} on MT-Bench with our decoder", flush=True)
            decode(opts, folder, out, max(ks_of(opts, depth)))
    rows = [row(label, folder, opts) for label, folder in drafts.items() if (folder / "export").is_dir()]
    out.mkdir(parents=True, exist_ok=True)
    (out / "score.json").write_text(json.dumps({"settings": opts, "rows": rows, "not_trained": missing}, indent=1) + "\n")
    table = markdown(rows, opts)
    (out / "score.md").write_text(table)
    print(table)
    if missing:
        print("not trained yet (no export): " + ", ".join(missing))
    return 0
