"""``scripts/export.py``: convert Medusa heads to another checkpoint layout.

    python scripts/export.py heads=<heads dir> format=native|medusa_v1|vllm output=<dir>

Options: ``configs/commands/export.yaml`` (schema: ``medusa_train.config.export.ExportConfig``); the
work is ``medusa_train.model.export.export_folder``.
"""

from __future__ import annotations

import sys
from dataclasses import asdict

from medusa_train.config.check import parse_config
from medusa_train.config.export import ExportConfig, check_export_config


def build_export_config(raw) -> ExportConfig:
    """A validated ``ExportConfig``: required keys, the layout and its options, every problem at once."""
    from medusa_train.model.export import option_problems

    return parse_config(ExportConfig, raw, lambda c: check_export_config(c) + option_problems(
        c.format, c.lm_head_pt, c.max_paths, c.topk))


def run(cfg: ExportConfig) -> None:
    """Convert; a folder that cannot be converted exits with status 2 and says why."""
    from medusa_train.model.export import export_folder

    try:
        path = export_folder(**asdict(cfg))
    except (ValueError, FileNotFoundError) as err:
        print(err, file=sys.stderr)
        sys.exit(2)
    print(f"wrote {cfg.format} heads from {cfg.heads} to {path}")
    if cfg.format == "vllm":
        print(serve_command(path))


SERVING_NAME = "serving.json"  # written into a vllm export by `scripts/benchmark.py vllm_k` (the measured K)


def serve_command(path) -> str:
    """How to serve a vllm export: ``vllm serve`` with the base model's folder (``packaged:`` names resolved),
    the export's dtype and ``--speculative-config``; K is the fastest measured by ``benchmark.py vllm_k``
    when it ran (``serving.json``), else 1 (vLLM's own per-step cost makes more a loss until measured)."""
    import json
    from pathlib import Path

    from medusa_train.backbone.load import resolve_model_path

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    heads = config.get("num_heads") or config.get("medusa_num_heads")
    measured = json.loads((path / SERVING_NAME).read_text()) if (path / SERVING_NAME).is_file() else None
    k = (measured or {}).get("recommended_num_speculative_tokens")
    base = config.get("base_model_name_or_path")
    try:
        base = resolve_model_path(base)[0] if base else "<base model>"
    except (OSError, ValueError):
        pass
    # the dtype K was measured in (the heads' own dtype until then)
    dtype = (measured or {}).get("settings", {}).get("dtype") or config.get("torch_dtype", "auto")
    lines = []
    if measured and k is None:
        lines.append(f"measured ({path / SERVING_NAME}): no K is faster than serving {base} without speculation "
                     "on that machine; the fastest K is shown")
        k = measured["fastest_num_speculative_tokens"]
    elif measured:
        lines.append(f"K={k}: the fastest of K=1..{heads} measured on {measured.get('device', 'this machine')} "
                     f"({path / SERVING_NAME})")
    else:
        k = 1
        lines.append(f"K=1 until measured: choose K in 1..{heads} with `python scripts/benchmark.py vllm_k "
                     f"heads={path}` (one server per K; it writes {SERVING_NAME} here)")
    spec = json.dumps({"method": "medusa", "model": str(path.resolve()), "num_speculative_tokens": k})
    lines.append(f"vllm serve {base} --dtype {dtype} --speculative-config '{spec}'")
    lines.append(f"  (vLLM's CPU build, whose `vllm` script is broken: python -m vllm.entrypoints.openai.api_server "
                 f"--model {base} --dtype {dtype} --enforce-eager --speculative-config '{spec}')")
    return "serve it with vLLM:\n" + "\n".join(lines)


def main() -> None:
    """Entry point of ``scripts/export.py``."""
    from medusa_train.cli.entry import run_command

    run_command("export", build_export_config, run)
