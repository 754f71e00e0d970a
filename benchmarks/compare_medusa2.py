"""Medusa-2 against Medusa-1 at the demo's data and step budget (issue 23), one row per setting.

    .venv/bin/python -m benchmarks.compare_medusa2                      # every row, in order; resumes
    .venv/bin/python -m benchmarks.compare_medusa2 --rows medusa1 m2-default
    nohup .venv/bin/python -m benchmarks.compare_medusa2 > outputs/medusa2-compare.log 2>&1 &

Each row is ``medusa-train demo`` (its current defaults: configs/commands/demo.yaml, experiment=demo) with the
shared settings below plus the row's own overrides, so
every row trains on the same distilled file (distilled once, by the first row), fits its tree the
same way and is evaluated on the same 24 MT-Bench prompts. The demo skips finished stages and
training resumes from its last checkpoint, so re-running this command after a kill picks up where it stopped. After
each row, ``docs/results/medusa2.json`` is rewritten with every finished row, those recorded by earlier sessions with
the same overrides included (commit it: outputs/ does not outlive a session's machine); a partial table is still a
true one. Rows recorded with other settings (the demo's defaults of their day, each row's ``overrides`` says which)
stay in the file under ``earlier``: a row is never compared with one trained otherwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT_DIR = "outputs/medusa2-compare"
# tree.nodes=64: the heads' quality is compared at one fixed tree, not at a size chosen for each row's speed
SHARED = [f"output_dir={OUTPUT_DIR}", "tree.nodes=64"]
ROWS: dict[str, list[str]] = {
    "medusa1": ["recipe=medusa1"],
    # heads on the frozen 4-bit backbone for medusa2.stage1_epochs, then joint epochs (LoRA lr 1e-4, lambda 0.2)
    "m2-default": ["recipe=medusa2"],
    "m2-faithful": ["recipe=medusa2", "medusa2.lr=3.0e-5"],  # the backbone moves less
    "m2-heads-first": ["recipe=medusa2", "medusa2.lr=3.0e-4", "medusa2.head_weight=1.0"],  # heads' loss counts more
    # between m2-default and m2-heads-first: heads' loss as much, the backbone at 2/3 of that lr (agreement 94.96% there)
    "m2-heads-first-lr2e-4": ["recipe=medusa2", "medusa2.lr=2.0e-4", "medusa2.head_weight=1.0"],
}
RESULTS = ROOT / "docs" / "results" / "medusa2.json"


def demo_paths(overrides: list[str]) -> dict[str, Path]:
    """Where ``medusa-train demo`` with ``overrides`` writes (its ``stage_paths``)."""
    from medusa_train.backbone.load import native_bf16
    from medusa_train.config.compose import compose_config
    from medusa_train.config.demo import build_demo_config, resolve_dtypes
    from medusa_train.pipeline.demo import stage_paths

    return stage_paths(resolve_dtypes(build_demo_config(compose_config("demo", overrides)), native_bf16()))


def row_result(name: str, overrides: list[str]) -> dict | None:
    """The row's figures from its finished demo run, or None when the run has no report yet."""
    paths = demo_paths(overrides)
    report_file = paths["report"] / "report.json"
    if not report_file.exists():
        return None
    report = json.loads(report_file.read_text())
    times_file = paths["run"] / "demo-times.json"
    times = json.loads(times_file.read_text()) if times_file.exists() else {}
    drift = report.get("drift") or {"mean_kl": 0.0, "greedy_agreement": 1.0}  # medusa1: the backbone is untouched
    recipe = next(o.split("=", 1)[1] for o in overrides if o.startswith("recipe="))
    return {
        "name": name, "recipe": recipe, "overrides": overrides,
        "command": " ".join(["medusa-train demo", *overrides]),
        "mean_accepted_length": report["mean_accepted_length"],
        "per_head_acceptance": report["per_head_acceptance"],
        "greedy_agreement": drift["greedy_agreement"], "mean_kl": drift["mean_kl"],
        "train_minutes": round(times["train"] / 60, 1) if "train" in times else None,
        "speedup": report["speedup"], "mismatches": report["mismatches"],
        "report": str(report_file),
    }


def settings(overrides: list[str]) -> list[str]:
    """A row's settings: its overrides but the thread count (which changes speed, not what trains)."""
    return [o for o in overrides if not o.startswith("threads=")]


def finished_rows(shared: list[str]) -> tuple[list[dict], list[dict]]:
    """(rows, earlier): every row with a report here or recorded with the same settings, and the recorded rows
    measured with other settings (kept, never mixed into the table).

    A session's outputs/ does not outlive it (a fresh machine starts from the repository), so a row
    measured in an earlier session is kept from ``docs/results/medusa2.json`` unless it was re-run
    here, in which case the new figures replace it.
    """
    recorded = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    earlier = recorded.get("earlier", [])
    same = {}
    for row in recorded.get("rows", []):
        wanted = ROWS.get(row["name"])
        if wanted is not None and settings(row["overrides"]) == settings(shared + wanted):
            same[row["name"]] = row
        else:
            earlier.append(row)
    rows = [row for name in ROWS if (row := row_result(name, shared + ROWS[name]) or same.get(name))]
    return rows, earlier


def write_results(rows: list[dict], earlier: list[dict]) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    partial = RESULTS.with_suffix(".json.partial")
    partial.write_text(json.dumps({"rows": rows, "earlier": earlier}, indent=1) + "\n")
    partial.replace(RESULTS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS),
                        help="which rows to run (default: all, in order)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per stage (the demo's threads=); 1 when other jobs share the CPU")
    args = parser.parse_args()
    shared = SHARED + ([f"threads={args.threads}"] if args.threads else [])
    for name in args.rows:
        overrides = shared + ROWS[name]
        print(f"\n##### {name}: {' '.join(overrides)}  ({time.strftime('%H:%M:%S')})", flush=True)
        result = subprocess.run([sys.executable, "-m", "medusa_train", "demo", *overrides], cwd=ROOT)
        if result.returncode != 0:
            sys.exit(f"row {name} failed (exit {result.returncode}); re-run the same command to resume it")
        rows, earlier = finished_rows(shared)
        write_results(rows, earlier)
        print(f"##### {name} done; {len(rows)} row(s) in {RESULTS.relative_to(ROOT)}", flush=True)


if __name__ == "__main__":
    main()
