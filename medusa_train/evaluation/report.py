"""Writing an evaluation report: ``report.json``, ``report.md`` and ``report.png``.

The PNG (accepted-length histogram + per-category bars) needs matplotlib (``pip install
medusa-train[dev]``); without it the other two files are still written and a warning says so.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_report(report: dict, output_dir: str | os.PathLike) -> dict[str, Path]:
    """Write the report files into ``output_dir`` (created if needed).

    Returns:
        ``{"json": path, "markdown": path, "png": path}`` (no ``png`` without matplotlib).
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "report.json", "markdown": out / "report.md", "png": out / "report.png"}
    body = {k: v for k, v in report.items() if k != "files"}
    body["files"] = {k: str(v) for k, v in files.items()}
    if not plot_report(report, files["png"]):
        del files["png"], body["files"]["png"]
    _atomic_write(files["json"], json.dumps(body, indent=2) + "\n")
    _atomic_write(files["markdown"], render_markdown(report))
    return files


def render_markdown(report: dict) -> str:
    """A human-readable summary: headline numbers, per-head acceptance, per-category table, mismatches."""
    s = report.get("settings", {})
    tps, dtps = report["tokens_per_s"], report["decode_tokens_per_s"]
    mism = report["mismatches"]
    lines = [
        "# Medusa evaluation",
        "",
        f"Heads `{s.get('heads', '?')}` on `{s.get('model', '?')}` ({s.get('dtype', '?')}, {s.get('device', '?')}, "
        f"{s.get('torch_threads', '?')} threads); tree `{s.get('tree', '?')}` ({s.get('tree_nodes', '?')} nodes); "
        f"{report['totals']['count']} generations of up to {s.get('max_new_tokens', '?')} tokens; "
        f"acceptance `{s.get('acceptance', '?')}`, temperature {s.get('temperature', '?')}.",
        "",
        "| metric | value |",
        "|---|---|",
        f"| mean accepted length (tokens / verify step) | {report['mean_accepted_length']:.2f} |",
        f"| speedup (wall clock, prefill + decode) | {report['speedup']:.2f}x |",
        f"| speedup (decode only) | {report['decode_speedup']:.2f}x |",
        f"| tokens/s medusa / plain (wall) | {tps['medusa']:.1f} / {tps['plain']:.1f} |",
        f"| tokens/s medusa / plain (decode) | {dtps['medusa']:.1f} / {dtps['plain']:.1f} |",
        f"| greedy mismatches vs plain decoding | {'n/a (sampling)' if mism is None else mismatch_summary(report)} |",
        "",
        "## Per-head acceptance (fraction of verify steps in which head k's guess was kept)",
        "",
        "| head | " + " | ".join(str(k + 1) for k in range(len(report["per_head_acceptance"]))) + " |",
        "|---|" + "---|" * len(report["per_head_acceptance"]),
        "| acceptance | " + " | ".join(f"{a:.3f}" for a in report["per_head_acceptance"]) + " |",
        "",
        "## Per category",
        "",
        "| category | count | accepted length | speedup | mismatches |",
        "|---|---|---|---|---|",
    ]
    for name, c in report["per_category"].items():
        lines.append(f"| {name} | {c['count']} | {c['accepted_length']:.2f} | {c['speedup']:.2f}x | "
                     f"{'n/a' if c['mismatches'] is None else c['mismatches']} |")
    if report.get("engines"):
        lines += ["", "## What your server will see", "",
                  "| engine | verifies | mean accepted length | served by the engine |", "|---|---|---|---|"]
        for name, row in report["engines"].items():
            value = f"{row['mean_accepted_length']:.3f}" if row["mean_accepted_length"] is not None \
                else f"n/a: {row['reason']}"
            lines.append(f"| {name} | {row['verifies']} | {value} | {served_cell(row.get('served'))} |")
    if report.get("drift"):
        d = report["drift"]
        lines += ["", "## Backbone drift", "",
                  f"Compared with {d['original']} on the original's greedy answers ({d['prompts']} prompts, "
                  f"up to {d['max_new_tokens']} tokens each, {d['num_tokens']} positions):", "",
                  "| mean KL(original \\|\\| evaluated) per token | greedy agreement |", "|---|---|",
                  f"| {d['mean_kl']:.4f} | {d['greedy_agreement']:.1%} |"]
    if report["mismatch_details"]:
        lines += ["", "## Mismatches", "",
                  "`at_rounding`: both tokens' logits are within the dtype's rounding (2 eps max|logit|) of the "
                  "best one, where the tree pass and one-token decoding may round differently; `unexplained` "
                  "(any difference in float32) is a bug.", "",
                  "| id | turn | first differing token | plain / medusa token | base top-2 logit gap | tolerance | kind |",
                  "|---|---|---|---|---|---|---|"]
        for m in report["mismatch_details"]:
            lines.append(f"| {m['id']} | {m['turn']} | {m['position']} | {m['plain_token']} / {m['medusa_token']} | "
                         f"{m['top2_gap']:.3g} | {m.get('tolerance', float('nan')):.3g} | {m.get('kind', '?')} |")
    lines += ["", f"Speedup: {s.get('speedup', '')}.", ""]
    return "\n".join(lines)


def served_cell(served: dict | None) -> str:
    """One engine row's served figures: acceptance length, per position, tokens/s and speedup, outputs."""
    if not served:
        return ""
    parts = []
    if served.get("mean_acceptance_length") is not None:
        positions = "/".join(f"{a:.3f}" for a in served["per_position_acceptance"])
        parts.append(f"acceptance length {served['mean_acceptance_length']:.3f} (per position {positions})")
    tps = served["tokens_per_s"]
    if "speedup" in served:
        parts.append(f"{tps['speculative']:.1f} vs {tps['plain']:.1f} tokens/s without speculation = "
                     f"{served['speedup']:.2f}x")
    for phase in served.get("phases", {}).values():
        if "speedup" in phase:
            what = f"T={phase['temperature']}" if phase["temperature"] else f"concurrency {phase['concurrency']}"
            parts.append(f"{what}: {phase['speedup']:.2f}x")
    if served.get("outputs"):
        o = served["outputs"]
        parts.append(f"greedy outputs identical {o['identical']}/{o['compared']} "
                     f"({o['at_rounding']} at rounding, {o['unexplained']} unexplained)")
    return "; ".join(parts)


def mismatch_summary(report: dict) -> str:
    """``"3 (0 unexplained, 3 at rounding)"``, or the bare count for reports written before the split."""
    if report.get("mismatches_unexplained") is None:
        return str(report["mismatches"])
    return (f"{report['mismatches']} ({report['mismatches_unexplained']} unexplained, "
            f"{report['mismatches_at_rounding']} at rounding)")


def plot_report(report: dict, path: str | os.PathLike) -> bool:
    """Accepted-length histogram and per-category bars as a PNG; ``False`` when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed: report.png skipped (pip install matplotlib)", stacklevel=2)
        return False
    hist = report["accept_length_histogram"]
    cats = report["per_category"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    lengths = sorted(int(k) for k in hist)
    left.bar(lengths, [hist[k] if k in hist else hist[str(k)] for k in lengths], color="#4c72b0")
    left.set_xlabel("tokens accepted per verify step")
    left.set_ylabel("verify steps")
    left.set_xticks(lengths)
    left.set_title(f"accepted length (mean {report['mean_accepted_length']:.2f})")
    names = list(cats)
    x = range(len(names))
    width = 0.4
    right.bar([i - width / 2 for i in x], [cats[n]["accepted_length"] for n in names], width,
              label="accepted length", color="#4c72b0")
    right.bar([i + width / 2 for i in x], [cats[n]["speedup"] for n in names], width, label="speedup (x)",
              color="#dd8452")
    right.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    right.set_xticks(list(x))
    right.set_xticklabels([f"{n}\n(n={cats[n]['count']})" for n in names], rotation=30, ha="right", fontsize=8)
    right.set_title(f"per category (overall speedup {report['speedup']:.2f}x)")
    right.legend()
    fig.tight_layout()
    tmp = Path(path).with_name(f".{Path(path).name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return True
