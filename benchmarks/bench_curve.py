"""A learning curve users can plan with: tokens per step against the number of distilled conversations.

    python -m benchmarks curve                       # every point: train (resumed), serve, summarise, plot
    python -m benchmarks curve stage=summary         # only the summary and the plot from what is there

For each curve (``experiments``: the EAGLE-3 draft, ``eagle3``, the servable Medusa heads, ``served``, and the P-EAGLE
draft, ``peagle``, trained with EAGLE-3's preset) and each
size N (``sizes``), one training on the first N conversations of ``data`` (``scripts/curve_train.sh``: the demo's
training settings, bf16 where native, resumed from its checkpoints when run again), then:

- **validation**: the training log's walk over the validation prompts (``validation/K1..K3`` of the export's
  ``validation.json``: what decoding them with a K-chain accepts, computed before decoding);
- **served**: ``medusa-train choose-k source=validation ks=[1,2,3]`` on the first ``served_prompts`` validation
  prompts, ``max_tokens`` tokens each, one vLLM server per K: tokens per step as vLLM accepts them.

Writes ``<out>/summary.json`` and ``<out>/summary.md`` (a table, and a least-squares line of tokens per step against
log2(conversations): what doubling the data buys) and ``docs/results/learning-curve.png``. Every stage is skipped
when its output exists, so the same command resumes. One heavy job at a time: each stage runs alone.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

DEFAULTS = dict(data="outputs/curve/distill-vllm-2800.jsonl", sizes="300,1200,2400", experiments="eagle3,served,peagle",
                ks="1,2,3", served_prompts=16, max_tokens=128, dtype="bfloat16", out="outputs/curve",
                plot="docs/results/learning-curve.png", stage="all")
RECIPES = {"eagle3": "eagle3", "served": "medusa1", "peagle": "peagle"}  #: the training recipe of each curve
PRESETS = {"peagle": "eagle3"}  #: the experiment preset of a curve not named after its own (P-EAGLE trains as EAGLE-3)
LABELS = {"eagle3": "EAGLE-3 draft", "served": "Medusa heads (experiment=served)",
          "peagle": "P-EAGLE draft (K tokens in one draft pass)"}


def run_folder(out: Path, experiment: str, size: int) -> Path:
    return out / f"{experiment}-{size}"


def train(opts: dict, experiment: str, size: int) -> None:
    """``scripts/curve_train.sh`` for one point (skipped when its export exists; resumed otherwise)."""
    log = Path(opts["out"]) / f"{experiment}-{size}.log"
    print(f"== train {experiment} on {size:,} conversations (log: {log})", flush=True)
    with open(log, "a") as f:
        subprocess.run(["bash", "scripts/curve_train.sh", RECIPES[experiment], PRESETS.get(experiment, experiment),
                        str(size)], check=True, stdout=f, stderr=subprocess.STDOUT,
                       env={**offline_env(), "DATA": opts["data"], "DTYPE": opts["dtype"], "NAME": experiment})


def serve(opts: dict, experiment: str, size: int) -> None:
    """choose-k over ``ks`` on the validation prompts (skipped when its JSON exists)."""
    folder = run_folder(Path(opts["out"]), experiment, size)
    target = folder / "served.json"
    if target.is_file():
        return
    print(f"== serve {experiment}-{size} at K={opts['ks']} in vLLM", flush=True)
    choose_k(folder / "export", "validation", target, opts["ks"], opts["served_prompts"], opts["max_tokens"],
             opts["dtype"])


def choose_k(export: Path, source: str, target: Path, ks: str, prompts, max_tokens, dtype: str) -> None:
    """``medusa-train choose-k`` of ``export`` at each of ``ks`` (comma list) on the first ``prompts`` of ``source``,
    one vLLM server per K at concurrency 1, its result written to ``target``."""
    subprocess.run([sys.executable, "-m", "medusa_train", "choose-k", f"heads={export}", f"dtype={dtype}",
                    f"ks=[{ks}]", f"limit={prompts}", f"max_tokens={max_tokens}", "concurrency=1",
                    f"source={source}", f"output={target}"], check=True, env=offline_env())


def point(opts: dict, experiment: str, size: int) -> dict | None:
    """One point's figures, or None when its training has not finished."""
    folder = run_folder(Path(opts["out"]), experiment, size)
    walked = folder / "export" / "validation.json"
    if not walked.is_file():
        return None
    validation = json.loads(walked.read_text())
    ks = [int(k) for k in str(opts["ks"]).split(",")]
    row = {"experiment": experiment, "conversations": size, "step": validation.get("step"),
           "validation": {k: validation.get(f"validation/K{k}") for k in ks}}
    served = folder / "served.json"
    if served.is_file():
        record = json.loads(served.read_text())
        rows = {r["k"]: r for r in record["rows"] if r.get("server", "draft") in ("draft", "plain")}
        row["served"] = {k: rows[k]["tokens_per_step"] for k in ks if k in rows}
        if passing := record.get("to_pass_best_free"):  # choose-k served the free baselines beside it
            row["to_pass"] = {"server": passing["server"], "tokens_per_s": passing["tokens_per_s"],
                              "needs": {int(k): v["needs"] for k, v in passing["by_k"].items()}}
    return row


def slope(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least squares ``y = a + b log2(x)``: ``(a, b)``, b being what doubling the data adds; None under two points."""
    if len({x for x, _ in points}) < 2:
        return None
    xs, ys = [math.log2(x) for x, _ in points], [y for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def summarise(opts: dict) -> dict:
    rows = [r for e in str(opts["experiments"]).split(",") for n in _sizes(opts) if (r := point(opts, e, n))]
    lines = {}
    for e in {r["experiment"] for r in rows}:
        for kind in ("validation", "served"):
            for k in [int(k) for k in str(opts["ks"]).split(",")]:
                pts = [(r["conversations"], r[kind][k]) for r in rows
                       if r["experiment"] == e and r.get(kind, {}).get(k) is not None]
                if fit := slope(pts):
                    lines[f"{e}/{kind}/K{k}"] = {"intercept": round(fit[0], 4), "per_doubling": round(fit[1], 4),
                                                 "points": len(pts)}
    summary = {"settings": {k: opts[k] for k in ("data", "sizes", "ks", "served_prompts", "max_tokens", "dtype")},
               "machine": _machine(), "rows": rows, "lines": lines, "crossings": crossings(rows, lines)}
    out = Path(opts["out"])
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(markdown(summary))
    print(markdown(summary))
    return summary


def crossings(rows: list[dict], lines: dict) -> list[dict]:
    """Where each served line would pass the best free baseline: at the largest point served beside it, the tokens per
    step the draft needs at K (``choose-k``'s ``to_pass_best_free``: its step costs what it cost there), and the
    conversations at which the line reaches them (``2 ** ((needs - intercept) / per_doubling)``; None where the line
    does not rise). Arithmetic on the fitted line, not a measurement: the step's cost held, the line extended."""
    found = []
    for e in sorted({r["experiment"] for r in rows}):
        beside = [r for r in rows if r["experiment"] == e and r.get("to_pass")]
        if not beside:
            continue
        last = max(beside, key=lambda r: r["conversations"])
        for k, needs in sorted(last["to_pass"]["needs"].items()):
            fit = lines.get(f"{e}/served/K{k}")
            at = None
            if fit and fit["per_doubling"] > 0:
                at = round(2 ** ((needs - fit["intercept"]) / fit["per_doubling"]))
            found.append({"experiment": e, "k": k, "free": last["to_pass"]["server"], "at": last["conversations"],
                          "has": last["served"].get(k), "needs": needs, "conversations_to_pass": at})
    return found


def markdown(summary: dict) -> str:
    ks = [int(k) for k in str(summary["settings"]["ks"]).split(",")]
    head = "| draft | conversations | " + " | ".join(f"walked K={k}" for k in ks) + " | " + " | ".join(
        f"served K={k}" for k in ks) + " |"
    lines = [head, "|---|---:|" + "---:|" * (2 * len(ks))]
    for r in summary["rows"]:
        cells = [_fmt(r["validation"].get(k)) for k in ks] + [_fmt(r.get("served", {}).get(k)) for k in ks]
        lines.append(f"| {LABELS.get(r['experiment'], r['experiment'])} | {r['conversations']:,} | " + " | ".join(cells)
                     + " |")
    lines.append("")
    for name, fit in summary["lines"].items():
        lines.append(f"- {name}: {fit['intercept']:+.3f} {fit['per_doubling']:+.3f} log2(conversations) "
                     f"({fit['points']} points): each doubling adds {fit['per_doubling']:.3f} tokens per step")
    for c in summary.get("crossings", []):
        where = (f"the line reaches it near {c['conversations_to_pass']:,} conversations" if c["conversations_to_pass"]
                 else "no rising served line to extend (one point, or flat)")
        lines.append(f"- {c['experiment']} K={c['k']} at {c['at']:,} conversations: {_fmt(c['has'])} tokens per step; "
                     f"to pass {c['free']} it needs {c['needs']:.3f}: {where}")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True, sharex=True)
    ks = [int(k) for k in str(summary["settings"]["ks"]).split(",")]
    for ax, e in zip(axes, ("eagle3", "served")):
        rows = [r for r in summary["rows"] if r["experiment"] == e]
        for k, colour in zip(ks, ("tab:blue", "tab:orange", "tab:green")):
            for kind, style in (("validation", "--o"), ("served", "-s")):
                pts = [(r["conversations"], r.get(kind, {}).get(k)) for r in rows]
                pts = [(x, y) for x, y in pts if y is not None]
                if pts:
                    ax.plot(*zip(*pts), style, color=colour, label=f"K={k} {'walked' if kind == 'validation' else 'served (vLLM)'}")
        ax.set_xscale("log", base=2)
        sizes = [int(n) for n in str(summary["settings"]["sizes"]).split(",")]
        ax.set_xticks(sizes, [f"{n:,}" for n in sizes])
        ax.minorticks_off()
        ax.set_title(LABELS[e])
        ax.set_xlabel("distilled conversations")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tokens per step (validation prompts)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Learning curve, SmolLM2-135M-Instruct, {summary['machine']}", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(**overrides) -> int:
    from benchmarks.bench_options import bench_options

    opts = bench_options(DEFAULTS, overrides)
    if opts is None:
        return 2
    if not Path(opts["data"]).is_file():
        print(f"data={opts['data']}: no such file; distill it first (docs/results.md#learning-curve gives the command)")
        return 2
    Path(opts["out"]).mkdir(parents=True, exist_ok=True)
    if opts["stage"] in ("all", "train", "serve"):
        for size in _sizes(opts):
            for e in str(opts["experiments"]).split(","):
                if opts["stage"] in ("all", "train"):
                    train(opts, e, size)
                if opts["stage"] in ("all", "serve"):
                    serve(opts, e, size)
    summary = summarise(opts)
    if where := plot(summary, Path(opts["plot"])):
        print(f"plot: {where}")
    return 0


def _sizes(opts: dict) -> list[int]:
    return [int(n) for n in str(opts["sizes"]).split(",")]


def _fmt(value) -> str:
    return "" if value is None else f"{value:.3f}"


def offline_env() -> dict:
    import os

    return {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}


def _machine() -> str:
    from medusa_train.evaluation.choose_k import device_description

    return device_description()
