"""A tiny but real training setup: a random Llama folder with a BPE chat tokenizer, chat data, overrides
that shrink the real training config to seconds on CPU, and the one way tests compose that config."""

from __future__ import annotations

import json
import random
from pathlib import Path

from helpers.backbones import make_tiny_backbone
from helpers.tokenizers import make_bpe_tokenizer

WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def make_model_dir(path: Path, arch: str = "llama", layers: int = 2) -> Path:
    """Save a tiny random backbone plus a ChatML BPE tokenizer as a Hugging Face folder."""
    tokenizer = make_bpe_tokenizer()
    backbone = make_tiny_backbone(arch, vocab_size=len(tokenizer), layers=layers)
    backbone.config.pad_token_id = tokenizer.pad_token_id
    backbone.config.eos_token_id = tokenizer.eos_token_id
    backbone.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_chat_jsonl(path: Path, n: int = 48, seed: int = 0) -> Path:
    """Conversations whose replies count upwards: easy for heads to learn, so accuracy must rise."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            start = rng.randrange(5)
            reply = " ".join(WORDS[(start + i) % 10] for i in range(rng.randrange(12, 30)))
            record = {"messages": [{"role": "user", "content": f"Count from {WORDS[start]}."},
                                   {"role": "assistant", "content": reply}]}
            f.write(json.dumps(record) + "\n")
    return path


def train_overrides(model_dir: Path, data: Path, output_dir: Path, **extra) -> list[str]:
    """Overrides that shrink the real config to seconds on CPU."""
    values = {"model.name_or_path": model_dir, "model.dtype": "float32", "data.source": data,
              "data.max_samples": "null", "data.max_length": 96, "data.eval_size": 8, "data.batch_size": 4,
              "trainer.output_dir": output_dir, "trainer.mixed_precision": "no", "trainer.log_every": 1,
              "heads.num_heads": 3, "optim.lr": 0.01,
              # the tiny chat data has five prompts: a validation set would hold out all of them (tests that walk it
              # set their own)
              "data.validation.size": 0, **extra}
    return [f"{k}={v}" for k, v in values.items()]


def train_command(model_dir: Path, data: Path, output_dir: Path, *extra: str, **values):
    """``train.py +recipe=medusa1 debug=smoke`` with ``train_overrides`` (``values`` among them) and ``extra`` last,
    run to its end in a process of its own, one thread: the ``CompletedProcess``."""
    import os
    import subprocess
    import sys

    from helpers import ROOT

    cmd = [sys.executable, "train.py", "+recipe=medusa1", "debug=smoke",
           *train_overrides(model_dir, data, output_dir, **values), *extra]
    return subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=600)


def compose_config(overrides: list[str], recipe: str = "medusa1"):
    """The real training config (configs/train.yaml + recipe + the smoke trainer), validated, with
    ``overrides`` applied last: what ``train.py +recipe=<recipe> debug=smoke <overrides>`` would run."""
    from medusa_train.config.compose import compose_config
    from medusa_train.config.train import build_config

    return build_config(compose_config("train", [f"+recipe={recipe}", "debug=smoke", *overrides]))


def read_metrics(output_dir: Path) -> list[dict]:
    """The records a run appended to ``<output_dir>/metrics.jsonl``, in order."""
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def kill_after_checkpoint(cmd: list[str], output_dir: Path, step: int, env: dict, timeout: float) -> None:
    """Start the training command ``cmd`` and SIGKILL it as soon as its checkpoint at ``step`` exists in
    ``output_dir`` (a crash at the worst moment: no chance to clean up); it must not have finished by then."""
    import signal
    import subprocess
    import time

    from helpers import ROOT

    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = output_dir / "checkpoints" / f"step-{step:07d}"
    deadline = time.time() + timeout
    while not checkpoint.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (output_dir / "export").exists(), "the run finished before it could be killed"


def resumed_at(stdout: str) -> int:
    """The step a resumed training run says it continued from (``resumed from <checkpoint> at step N``)."""
    return int(stdout.split("resumed from")[1].split("at step ")[1].split()[0])


def run_train_command(overrides: list[str], monkeypatch) -> int:
    """``medusa-train train +recipe=medusa1 debug=smoke <overrides>`` in this process; its exit status."""
    import sys

    from hydra.core.global_hydra import GlobalHydra

    from medusa_train.cli import train
    from medusa_train.cli.entry import run_command
    from medusa_train.config.paths import CONFIG_DIR

    monkeypatch.setattr(sys, "argv", ["medusa-train", "+recipe=medusa1", "debug=smoke", *overrides])
    try:
        run_command("train", train.build, train.run, config_dir=CONFIG_DIR)
    except SystemExit as done:
        return done.code
    finally:
        GlobalHydra.instance().clear()
    return 0
