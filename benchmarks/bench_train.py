"""Training throughput with and without the hidden-state cache (Medusa-1, frozen backbone).

    python -m benchmarks train                      # packaged model, 2 epochs
    python -m benchmarks train samples=128 epochs=3 heads=4 max_length=256 share_lm_head=true

Runs the real recipe twice on the same data: once recomputing the backbone every step, once
with ``data.cache_hidden_states=true``. Reports setup time (for the cached run this includes
the one backbone pass that fills the cache) and tokens/s of each epoch, from metrics.jsonl.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from medusa_train.config.methods import METHODS
from medusa_train.config.train import build_config


def _run(overrides: dict, output_dir: Path) -> tuple[float, list[float]]:
    cfg = build_config(overrides | {"trainer": overrides["trainer"] | {"output_dir": str(output_dir)}})
    recipe = METHODS[cfg.method].recipe_class()(cfg)
    started = time.perf_counter()
    recipe.setup()
    setup_s = time.perf_counter() - started
    recipe.cfg.trainer.log_every = recipe.run.data.steps_per_epoch  # one metrics line per epoch
    recipe.train()
    recipe.cleanup()
    lines = [json.loads(x) for x in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return setup_s, [m["tokens_per_s"] for m in lines if m["split"] == "train"]


def main(model: str = "packaged:smollm2-135m-instruct", samples: str = "96", epochs: str = "2", heads: str = "4",
         max_length: str = "256", batch: str = "4", share_lm_head: str = "false", dtype: str = "bfloat16") -> int:
    base = {
        "model": {"name_or_path": model, "dtype": dtype},
        "data": {"max_samples": int(samples), "max_length": int(max_length), "eval_size": 0, "batch_size": int(batch)},
        "heads": {"num_heads": int(heads), "share_lm_head": share_lm_head == "true"},
        "trainer": {"epochs": int(epochs), "save_every": 0, "eval_every": 0, "resume": "never", "export": False},
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, cached in (("uncached", False), ("cached", True)):
            cfg = json.loads(json.dumps(base))
            cfg["data"]["cache_hidden_states"] = cached
            cfg["data"]["cache_dir"] = str(Path(tmp) / "hidden")
            setup_s, per_epoch = _run(cfg, Path(tmp) / name)
            rows.append((name, setup_s, per_epoch))
    print(f"\nmodel {model}, {samples} conversations x {epochs} epochs, {heads} heads, max_length {max_length}, "
          f"batch {batch}, share_lm_head={share_lm_head}, backbone {dtype}\n")
    print("| run | setup s (incl. caching) | " + " | ".join(f"epoch {i + 1} tok/s" for i in range(int(epochs))) + " |")
    print("|---|---:|" + "---:|" * int(epochs))
    for name, setup_s, per_epoch in rows:
        print(f"| {name} | {setup_s:.1f} | " + " | ".join(f"{t:.0f}" for t in per_epoch) + " |")
    return 0
