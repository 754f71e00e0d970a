"""Distillation test setups: multi-turn ShareGPT sources, a small distill config, and reading its output."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = "the a one two three quick brown fox jumps over lazy dog hello there how are you today fine".split()
# Tiny-model runs: random weights loop and rarely stop, so keep every non-empty reply.
KEEP_ALL = {"filters": {"skip_truncated": False, "max_repeated_fraction": None}}


def make_multiturn_jsonl(path: Path, n: int, seed: int = 0, extra: list[dict] | None = None) -> Path:
    """ShareGPT records of 1-3 user turns (some with a system turn), prompts of varied length."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            turns = [{"from": "system", "value": "Be brief."}] if i % 3 == 0 else []
            for _ in range(rng.randint(1, 3)):
                turns.append({"from": "human", "value": " ".join(rng.choices(WORDS, k=rng.randint(2, 20)))})
                turns.append({"from": "gpt", "value": "a reply from another model"})
            f.write(json.dumps({"conversations": turns}) + "\n")
        for record in extra or []:
            f.write(json.dumps(record) + "\n")
    return path


def tiny_config(model_dir: Path, source: Path, output: Path, **overrides) -> dict:
    config = {"model": {"name_or_path": str(model_dir), "dtype": "float32"}, "source": str(source),
              "output": str(output), "num_prompts": None, "max_turns": 2, "max_prompt_tokens": 256,
              "batch_size": 4, "sort_window": 2, "exclude_benchmark": None, "progress": False,
              "generation": {"max_new_tokens": 24},
              "validation": {"size": 0}}  # tests that hold a validation set out set their own
    for key, value in overrides.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) and key in config else value
    return config


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
