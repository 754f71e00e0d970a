"""Writing an evaluation report: ``report.json``, ``report.md`` and ``report.png``.

The PNG (accepted-length histogram + per-category bars) needs matplotlib (``pip install
medusa-train[dev]``); without it the other two files are still written and a warning says so.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from medusa_train.config.paths import unwritable
from medusa_train.evaluation.summary import UNSTEADY


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


WRITTEN_BY = "medusa-train evaluate"  #: report.json's mark: the report files beside it are ours
REPORT_NAMES = ("report.json", "report.md", "report.png")


def _ours(report_json: Path) -> bool:
    try:
        body = json.loads(report_json.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(body, dict) and (body.get("written_by") == WRITTEN_BY or ("methods" in body and "files" in body))


def report_output_problem(output_dir: str | os.PathLike, option: str = "output_dir") -> str | None:
    """Why the report must not be written into ``output_dir`` (``None``: it may): report files there that evaluate
    did not write (no ``report.json`` of ours beside them), a file in its place, or a folder that cannot be written.
    Checked before any work."""
    out = Path(output_dir).expanduser()
    if out.exists() and not out.is_dir():
        return f"{option}={out}: is a file, not a folder; choose another {option}="
    present = [name for name in REPORT_NAMES if (out / name).exists()]
    if present and not _ours(out / "report.json"):
        return (f"{option}={out}: holds {', '.join(present)}, which evaluate did not write; nothing was changed: "
                f"choose another {option}= (or move them away)")
    blocked = unwritable(out)
    return f"{option}={out}: {blocked} cannot be written; choose another {option}=" if blocked else None


def write_report(report: dict, output_dir: str | os.PathLike) -> dict[str, Path]:
    """Write the report files into ``output_dir`` (created if needed; refused, naming the files, when it holds report
    files evaluate did not write: ``report_output_problem``).

    Returns:
        ``{"json": path, "markdown": path, "png": path}`` (no ``png`` without matplotlib).
    """
    from medusa_train.config.check import FileProblem

    out = Path(output_dir)
    if problem := report_output_problem(out):
        raise FileProblem(problem)
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "report.json", "markdown": out / "report.md", "png": out / "report.png"}
    body = {"written_by": WRITTEN_BY, **{k: v for k, v in report.items() if k != "files"}}
    body["files"] = {k: str(v) for k, v in files.items()}
    if not plot_report(report, files["png"]):
        del files["png"], body["files"]["png"]
    _atomic_write(files["json"], json.dumps(body, indent=2) + "\n")
    _atomic_write(files["markdown"], render_markdown(report))
    return files


LOOKUP_NAME = "prompt lookup"


def _lookup_label(report: dict) -> str:
    lookup = (report.get("settings") or {}).get("prompt_lookup") or {}
    if not lookup:
        return "HF prompt lookup"
    return f"HF prompt lookup (N={lookup['num_tokens']}, ngram {lookup['max_matching_ngram_size']})"


def headline_lines(report: dict) -> list[str]:
    """What the draft buys over the best free baseline: one line in this process, one served (when measured)."""
    methods = report.get("methods") or {}
    lines = []
    if "draft" in methods and "plain" in methods:
        plain = methods[report.get("plain_reference", "plain")]  # the faster plain decoding: what speedups divide by
        # the headline is the best decoder the run has: the tree as fitted, or its draft alone when that was faster
        best_key = max((k for k in ("draft", "draft_only") if k in methods), key=lambda k: methods[k]["tokens_per_s"])
        m = methods[best_key]
        free = {"plain decoding": plain}
        if "prompt_lookup" in methods:
            free[_lookup_label(report)] = methods["prompt_lookup"]
        best_name, best = max(free.items(), key=lambda item: item[1]["tokens_per_s"])
        lookup = methods.get("prompt_lookup")
        lookup_part = (f"; {_lookup_label(report)} {lookup['speedup']:.2f}x ({_num(lookup['tokens_per_forward'])} "
                       "tokens per forward)") if lookup else ""
        ours = draft = _draft(report)
        if (report.get("settings") or {}).get("lookup_depth"):  # a tree with a lookup chain, its branches decoded or not
            ours = f"{draft} and lookup chain in one tree"
        if "draft_only" in methods:  # a tree with a lookup chain: the hybrid, and each branch alone beside it
            hybrid = f"{draft} and lookup chain in one tree"
            ours = hybrid if best_key == "draft" else f"{draft} alone (faster here than {hybrid})"
            beside = (("draft_only", f"{draft} alone") if best_key == "draft" else ("draft", hybrid),
                      ("lookup_chain", "our lookup chain alone"))
            lookup_part = "".join(f"; {label} {methods[key]['speedup']:.2f}x ({_num(methods[key]['tokens_per_forward'])}"
                                  " tokens per forward)" for key, label in beside) + lookup_part
        lines.append(f"In this process, against {(report.get('settings') or {}).get('plain_decoding', 'HF generate')} "
                     f"({plain['tokens_per_s']:.1f} tokens/s): {ours} {m['speedup']:.2f}x "
                     f"({_num(m['tokens_per_forward'])} tokens per forward){lookup_part}. Over the best free baseline "
                     f"({best_name}) {ours} {_verb(ours, 'buy')} {m['tokens_per_s'] / max(best['tokens_per_s'], 1e-9):.2f}x.")
    if report.get("expected"):
        e = report["expected"]
        lines.append(f"Expected beside measured: {e['tokens_per_forward']:.3f} tokens per forward expected by "
                     f"{e['from']}; {report['mean_accepted_length']:.3f} measured on these prompts (gap {e['gap']:+.3f})")
    served = report.get("served")
    if served:
        from medusa_train.evaluation.served_report import best_free

        rows = served["rows"]
        parts = [f"{name} {_speedup(row)} ({_num(row['tokens_per_step'])} tokens per step)"
                 for name, row in rows.items() if name != "plain"]
        plain = rows.get("plain")
        against = f"against vLLM without speculation ({plain['tokens_per_s']:.1f} tokens/s)" if plain else \
            "(no server without speculation measured)"
        line = f"Served by vLLM, greedy at concurrency 1, {against}: " + ("; ".join(parts) or "no speculative row")
        free = best_free(rows)
        draft = _draft(report)
        if "draft" in rows and free:
            line += (f". Over the best free baseline ({free[0]}) {draft} {_verb(draft, 'buy')} "
                     f"{rows['draft']['tokens_per_s'] / max(free[1]['tokens_per_s'], 1e-9):.2f}x.")
        elif "draft" not in rows:
            line += (f". {draft[0].upper() + draft[1:]} {'were' if _plural(draft) else 'was'} not served: "
                     f"{served['draft_not_served']}.")
        lines.append(line)
    steadiness = report.get("plain_steadiness")
    if steadiness and steadiness["unsteady"]:  # last: the lines above keep their places
        slow = ", ".join(f"{u['id']} ({u['ms']:.1f} ms)" for u in steadiness["unsteady"])
        lines.append(f"Warning: the plain reference ({steadiness['method']}) stepped {steadiness['median_ms']:.2f} ms a "
                     f"token at the median but over {UNSTEADY:g}x that on {len(steadiness['unsteady'])} prompt(s): "
                     f"{slow}. Timed while something else held the machine: the in-process speedups divide by a "
                     "slowed plain decoding and read high. Rerun on an idle machine.")
    return lines


def _draft(report: dict) -> str:
    """What proposed the tree's tokens (the model config's ``draft_name``, kept in the report's settings)."""
    return (report.get("settings") or {}).get("draft") or "the heads"


def _plural(subject: str) -> bool:
    return subject.split(" and ")[0].endswith("s") or " and " in subject


def _verb(subject: str, verb: str) -> str:
    """``verb`` agreeing with ``subject`` (the heads buy; the EAGLE-3 draft buys)."""
    return verb if _plural(subject) else verb + "s"


def _num(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _speedup(row: dict) -> str:
    return "n/a" if row.get("speedup") is None else f"{row['speedup']:.2f}x"


def prompts_decoded(report: dict) -> str:
    """``"24"``, or ``"10 of 24 (the rest not started: max_minutes=6 spent)"`` when the time budget stopped the
    evaluation; from the records for a report written before it said."""
    p = report.get("prompts")
    if not p:
        return str(len({r["id"] for r in report.get("per_prompt", [])}))
    if not p["stopped_at_max_minutes"]:
        return str(p["decoded"])
    return f"{p['decoded']} of {p['offered']} (the rest not started: max_minutes={p['max_minutes']:g} spent)"


def render_markdown(report: dict) -> str:
    """A human-readable summary: what the heads buy over the free baselines first, then the headline numbers,
    every decoder's row, per-head acceptance, per-category table, served rows, mismatches."""
    s = report.get("settings", {})
    tps, dtps = report["tokens_per_s"], report["decode_tokens_per_s"]
    mism = report["mismatches"]
    draft = s.get("draft", "the draft")
    folder = f" `{s['draft_folder']}`" if s.get("draft_folder") else ""  # the command's draft=; absent in-process
    lines = ["# Medusa evaluation", "", *[f"**{line}**" + "\n" for line in headline_lines(report)],
        f"{draft[:1].upper()}{draft[1:]}{folder} on `{s.get('model', '?')}` ({s.get('dtype', '?')}, {s.get('device', '?')}, "
        f"{s.get('torch_threads', '?')} threads); tree `{s.get('tree', '?')}` ({s.get('tree_nodes', '?')} nodes"
        + (f", {s['lookup_depth']} of them a lookup chain matching {s['lookup_ngram'][1]}- down to "
           f"{s['lookup_ngram'][0]}-token suffixes" if s.get("lookup_depth") else "") + "); "
        f"{prompts_decoded(report)} prompts, {report['totals']['count']} generations of up to "
        f"{s.get('max_new_tokens', '?')} tokens; acceptance `{s.get('acceptance', '?')}`, temperature {s.get('temperature', '?')}.",
        "",
        "| metric | value |",
        "|---|---|",
        f"| mean accepted length (tokens after the first / forward after the prefill) | "
        f"{report['mean_accepted_length']:.2f} |",
        f"| speedup over {s.get('plain_decoding', 'plain decoding')} (wall clock, prefill + decode) | "
        f"{report['speedup']:.2f}x |",
        f"| speedup (decode only) | {report['decode_speedup']:.2f}x |",
        f"| tokens/s draft / plain (wall) | {tps['draft']:.1f} / {tps['plain']:.1f} |",
        f"| tokens/s draft / plain (decode) | {dtps['draft']:.1f} / {dtps['plain']:.1f} |",
        f"| greedy mismatches vs plain decoding | {'n/a (sampling)' if mism is None else mismatch_summary(report)} |",
    ]
    if report.get("methods"):
        lines += ["", "## Every decoder in this process (prompt by prompt, in turn)", "",
                  "| decoder | decodes with | tokens per forward | tokens/s | speedup | decode-only speedup | "
                  "greedy outputs identical to plain |", "|---|---|---|---|---|---|---|"]
        for name, row in report["methods"].items():
            label = _lookup_label(report) if name == "prompt_lookup" else name
            o = row.get("outputs")
            outputs = "reference" if name == "plain" else "n/a" if not o else f"{o['identical']}/{o['compared']}"
            lines.append(f"| {label} | {row['decodes_with']} | {_num(row['tokens_per_forward'])} | "
                         f"{row['tokens_per_s']:.1f} | {row['speedup']:.2f}x | {row['decode_speedup']:.2f}x | "
                         f"{outputs} |")
        sweep = (s.get("prompt_lookup") or {}).get("sweep")
        if sweep:
            lines += ["", f"Prompt lookup's settings were the fastest of {len(sweep)} on "
                      f"{s['prompt_lookup']['swept_on']} first turns: " + ", ".join(
                          f"N={r['num_tokens']}/ngram {r['max_matching_ngram_size']} {r['tokens_per_s']:.1f} tok/s"
                          for r in sweep) + "."]
    accepted = report["per_head_acceptance"]  # the heads the tree reaches
    lines += ["", "## Per-head acceptance (fraction of verify steps in which head k's guess was kept)"]
    if accepted:
        lines += ["", "| head | " + " | ".join(str(k + 1) for k in range(len(accepted))) + " |",
                  "|---|" + "---|" * len(accepted),
                  "| acceptance | " + " | ".join(f"{a:.3f}" for a in accepted) + " |"]
    num_heads = (report.get("settings") or {}).get("depth")
    if num_heads and len(accepted) < num_heads:
        unused = f"{len(accepted) + 1}-{num_heads}" if len(accepted) + 1 < num_heads else str(num_heads)
        lines += ["", f"Heads {unused} of {num_heads}: not in the tree (its depth is {len(accepted)}), never tried."]
    if report.get("lookup_acceptance") is not None:
        chain = report["lookup_acceptance"]
        lines += ["", "Lookup chain (fraction of verify steps that kept its first i tokens; those steps' tokens are "
                  "the chain's, not the heads'): " + (", ".join(f"{i + 1}: {a:.3f}" for i, a in enumerate(chain))
                                                      or "never kept") + "."]
    split = "draft_only" in (report.get("methods") or {})
    lines += [
        "",
        "## Per category",
        "",
        "| category | count | accepted length | speedup | " + ("draft alone | our lookup chain alone | " if split else "")
        + "prompt lookup's speedup | mismatches |",
        "|---|---|---|---|" + ("---|---|" if split else "") + "---|---|",
    ]
    for name, c in report["per_category"].items():
        lookup = f"{c['prompt_lookup_speedup']:.2f}x" if c.get("prompt_lookup_speedup") is not None else "n/a"
        branches = "".join(f"{c[f'{k}_speedup']:.2f}x ({_num(c[f'{k}_tokens_per_forward'])}) | "
                           for k in ("draft_only", "lookup_chain")) if split else ""
        lines.append(f"| {name} | {c['count']} | {c['accepted_length']:.2f} | {c['speedup']:.2f}x | {branches}{lookup} | "
                     f"{'n/a' if c['mismatches'] is None else c['mismatches']} |")
    if report.get("engines"):
        lines += ["", "## What each engine would accept (simulated by our decoder on these prompts)", "",
                  "| engine | verifies | tokens per forward |", "|---|---|---|"]
        for name, row in report["engines"].items():
            value = f"{row['mean_accepted_length']:.3f}" if row["mean_accepted_length"] is not None \
                else f"n/a: {row['reason']}"
            lines.append(f"| {name} | {row['verifies']} | {value} |")
    if report.get("served"):
        lines += served_markdown(report["served"], _draft(report))
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
                  "| id | turn | first differing token | plain / draft token | base top-2 logit gap | tolerance | kind |",
                  "|---|---|---|---|---|---|---|"]
        for m in report["mismatch_details"]:
            lines.append(f"| {m['id']} | {m['turn']} | {m['position']} | {m['plain_token']} / {m['draft_token']} | "
                         f"{m['top2_gap']:.3g} | {m.get('tolerance', float('nan')):.3g} | {m.get('kind', '?')} |")
    lines += ["", f"Speedup: {s.get('speedup', '')}. Accepted length: {s.get('accepted_length', '')}.", ""]
    return "\n".join(lines)


def served_markdown(served: dict, draft: str = "the heads") -> list[str]:
    """The served rows: tokens per step (our count), vLLM's per-drafted-step figure beside it, speed, outputs."""
    st = served["settings"]
    lines = ["", "## Served by vLLM", "",
             f"The same conversations through vLLM's chat API ({st.get('dtype')}, up to {st.get('max_tokens')} tokens). "
             f"Tokens per step: {served['tokens_per_step']}. vLLM's acceptance length: "
             f"{served['vllm_acceptance_length']}.", ""]
    if served.get("attached"):
        lines += [f"Attached to servers already running ({', '.join(served['attached'])}): their counters include "
                  "any other traffic they got during the measurement.", ""]
    if served.get("draft_not_served"):
        lines += [f"{draft[0].upper() + draft[1:]} {'were' if _plural(draft) else 'was'} not served: "
                  f"{served['draft_not_served']}.", ""]
    lines += ["| row | decodes with | tokens per step | vLLM acceptance length (per drafted step; share of steps "
              "drafted) | tokens/s | speedup over no speculation | greedy outputs | other phases |",
              "|---|---|---|---|---|---|---|---|"]
    for name, row in served["rows"].items():
        accepted = "n/a" if row["mean_acceptance_length"] is None else (
            f"{row['mean_acceptance_length']:.3f} (" + "/".join(f"{a:.3f}" for a in row["per_position_acceptance"])
            + (f"; {row['drafted_share']:.0%} drafted)" if row.get("drafted_share") is not None else ")"))
        o = row.get("outputs")
        outputs = "reference" if name == "plain" else "n/a" if not o else \
            f"{o['identical']}/{o['compared']} identical ({o['at_rounding']} at rounding, {o['unexplained']} unexplained)"
        phases = []
        for phase in row["phases"].values():
            what = f"T={phase['temperature']}" if phase["temperature"] else f"concurrency {phase['concurrency']}"
            check = phase.get("check")
            if check and check["flagged"]:
                phases.append(f"{what}: {check['summary']}; no speedup shown")
            else:
                text = f"{what}: {_speedup(phase)}" if "speedup" in phase else f"{what}: {phase['tokens_per_s']:.1f} tok/s"
                phases.append(text + (f" ({check['summary']})" if check else ""))
        lines.append(f"| {name} | {row['decodes_with']} | {_num(row['tokens_per_step'])} | {accepted} | "
                     f"{row['tokens_per_s']:.1f} | {_speedup(row)} | {outputs} | {'; '.join(phases)} |")
    return lines


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
