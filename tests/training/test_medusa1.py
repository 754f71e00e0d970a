import json
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT
from helpers.launch import accelerate_cmd, run_launched
from helpers.training import (
    compose_config,
    kill_after_checkpoint,
    make_chat_jsonl,
    make_model_dir,
    read_metrics,
    resumed_at,
    train_overrides,
)

from medusa_train import MedusaModel
from medusa_train.cli.train import run
from medusa_train.config.check import ConfigError


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return make_model_dir(root / "model"), make_chat_jsonl(root / "chat.jsonl")


def test_the_real_config_composes_with_the_recipe_and_smoke_trainer():
    cfg = compose_config([])
    assert cfg.method == "medusa1" and cfg.model.name_or_path == "packaged:smollm2-135m-instruct"
    assert cfg.trainer.max_steps == 12 and cfg.trainer.output_dir == "outputs/medusa1-smoke"
    assert cfg.data.source == "packaged:sharegpt-v3" and cfg.trainer.resume == "auto"


def test_every_invalid_value_is_reported_at_once_with_its_key():
    with pytest.raises(ConfigError) as err:
        compose_config(["heads.num_heads=0", "optim.lr=-1", "data.max_length=oops", "trainer.mixed_precision=fp8"])
    assert err.value.problems == ["data.max_length='oops': expected int", "heads.num_heads=0: must be >= 1",
                                  "optim.lr=-1.0: must be > 0",
                                  "trainer.mixed_precision='fp8': must be no, or one of bfloat16, float16 (or bf16, fp16)"]


def test_a_missing_or_unreadable_data_source_is_reported_with_the_other_problems(tmp_path):
    with pytest.raises(ConfigError) as err:
        compose_config([f"data.source={tmp_path}/chats.jsonl", "heads.num_heads=0", "data.chat_template=nope.jinja"])
    assert err.value.problems[1].startswith(f"data.source='{tmp_path}/chats.jsonl': no such file or directory")
    assert "data.chat_template='nope.jinja': must be a Jinja template's text or a file holding one" in err.value.problems
    assert "heads.num_heads=0: must be >= 1" in err.value.problems
    if os.geteuid() != 0:  # root reads everything
        locked = tmp_path / "locked.jsonl"
        locked.write_text("{}\n")
        locked.chmod(0)
        with pytest.raises(ConfigError, match="data.source=.*not readable by this user"):
            compose_config([f"data.source={locked}"])


@pytest.mark.integration
def test_cli_rejects_bad_values_before_loading_anything():
    result = subprocess.run([sys.executable, "train.py", "+recipe=medusa1", "heads.num_heads=0", "optim.lr=-1",
                             "model.name_or_path=/nonexistent"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "heads.num_heads=0: must be >= 1" in result.stderr and "optim.lr=-1.0: must be > 0" in result.stderr
    assert "Loading weights" not in result.stderr + result.stdout


def test_wandb_without_key_or_mode_says_how_to_choose(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", "/nonexistent")
    with pytest.raises(ConfigError, match="WANDB_MODE=offline"):
        compose_config(["logger=wandb"])


def test_training_writes_metrics_and_an_export_and_heads_improve(tiny_setup, tmp_path):
    model_dir, data = tiny_setup
    cfg = compose_config(train_overrides(model_dir, data, tmp_path, **{"trainer.max_steps": 30,
                                                                         "trainer.eval_every": 15}))
    final = run(cfg)
    metrics = read_metrics(tmp_path)
    evals = [m for m in metrics if m["split"] == "eval"]
    assert [m["step"] for m in evals] == [0, 15, 30]
    assert evals[-1]["head1/top1"] > evals[0]["head1/top1"] + 0.2  # counting is easy to learn
    assert evals[-1]["loss"] < evals[0]["loss"]
    assert final["step"] == 30
    assert [m["step"] for m in metrics if m["split"] == "train"] == list(range(1, 31))
    model = MedusaModel.from_pretrained(tmp_path / "export", dtype="float32")
    assert model.config.num_heads == 3 and model.config.base_model_name_or_path == str(model_dir)
    assert json.loads((tmp_path / "export/training_config.json").read_text())["heads"]["num_heads"] == 3
    assert len(list((tmp_path / "checkpoints").iterdir())) <= cfg.trainer.keep_last


def _train_cmd(model_dir, data, out, **extra):
    return [sys.executable, "train.py", "+recipe=medusa1", "debug=smoke",
            *train_overrides(model_dir, data, out, **{"trainer.max_steps": 60, "trainer.save_every": 5,
                                                      "trainer.eval_every": 0, "trainer.keep_last": 20,
                                                      "data.batch_size": 2, **extra})]


@pytest.mark.integration
def test_kill_9_then_rerun_resumes_and_matches_an_uninterrupted_run(tiny_setup, tmp_path):
    model_dir, data = tiny_setup
    env = dict(os.environ, OMP_NUM_THREADS="1")
    reference = subprocess.run(_train_cmd(model_dir, data, tmp_path / "ref"), cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=600)
    assert reference.returncode == 0, reference.stderr[-2000:]

    crashed = tmp_path / "crashed"
    kill_after_checkpoint(_train_cmd(model_dir, data, crashed), crashed, 10, env, timeout=300)
    before = read_metrics(crashed)
    assert before, "metrics written before the crash must survive it"

    resumed = subprocess.run(_train_cmd(model_dir, data, crashed), cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    step = resumed_at(resumed.stdout)
    assert step >= 10
    # each run says which steps it trained, in how long, at what peak memory (the peer table reads this line)
    from benchmarks.bench_peers_score import TRAINED

    for out, first in ((reference.stdout, 1), (resumed.stdout, step + 1)):
        (steps_from, steps_to, seconds, gib), = TRAINED.findall(out)
        assert (int(steps_from), int(steps_to)) == (first, 60) and float(seconds) > 0
        assert 0.2 < float(gib) < 64  # a process holding torch and a backbone: hundreds of MiB, in GiB
    after = read_metrics(crashed)
    assert after[:len(before)] == before  # nothing earlier lost
    ref = {m["step"]: m["loss"] for m in read_metrics(tmp_path / "ref") if m["split"] == "train"}
    resumed_losses = {m["step"]: m["loss"] for m in after[len(before):] if m["split"] == "train"}
    assert sorted(resumed_losses) == list(range(step + 1, 61))
    for s, loss in resumed_losses.items():
        assert loss == pytest.approx(ref[s], rel=1e-6, abs=1e-6), s
    a = MedusaModel.from_pretrained(tmp_path / "ref/export", dtype="float32").heads_state_dict()
    b = MedusaModel.from_pretrained(crashed / "export", dtype="float32").heads_state_dict()
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)


@pytest.mark.integration
def test_two_processes_train_on_different_shards_and_write_one_export(tiny_setup, tmp_path):
    model_dir, data = tiny_setup
    result = run_launched(accelerate_cmd(2, "train.py", "+recipe=medusa1", "debug=smoke",
                                         *train_overrides(model_dir, data, tmp_path,
                                                          **{"trainer.max_steps": 6, "trainer.eval_every": 3})),
                          timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    # the two processes share one stdout: read each rank's line by its pattern, not by line breaks (they interleave)
    shards = dict(re.findall(r"rank (\d) first batch of epoch 0: (\[[\d, ]*\])", result.stdout))
    assert sorted(shards) == ["0", "1"] and shards["0"] != shards["1"], result.stdout[-2000:]
    assert "heads identical on all 2 processes" in result.stdout
    assert (tmp_path / "export/model.safetensors").is_file()
    assert [m["step"] for m in read_metrics(tmp_path) if m["split"] == "train"] == list(range(1, 7))


def read_wandb_history(path: Path) -> dict[int, dict]:
    """The history rows of an offline run's ``.wandb`` file, ``{step: {key: value}}`` (``_``-keys left out).

    The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then 32 KiB
    blocks of chunks (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last) that carry
    serialized ``wandb_internal_pb2.Record`` messages; a block's tail shorter than a chunk header is padding."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    block, pos, pending, rows = 32768, 7, b"", {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (2, 3):
            pending += chunk
            continue
        assert kind in (1, 4), kind
        record = wandb_internal_pb2.Record.FromString(pending + chunk)
        pending = b""
        if record.WhichOneof("record_type") == "history":
            row = rows.setdefault(record.history.step.num, {})
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    row[key] = json.loads(item.value_json)
    return rows


def test_wandb_offline_logs_exactly_the_metrics_jsonl_records(tiny_setup, tmp_path, monkeypatch):
    """Every figure of metrics.jsonl reaches the offline W&B run as ``<split>/<key>`` at its step, and
    nothing else does (train and eval records of one step share one history row)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    model_dir, data = tiny_setup
    run(compose_config(["logger=wandb", *train_overrides(model_dir, data, tmp_path, **{"trainer.max_steps": 3,
                                                                                     "trainer.eval_every": 2})]))
    (offline,) = (tmp_path / "wandb").glob("offline-run-*")
    (log,) = offline.glob("run-*.wandb")
    expected: dict[int, dict] = {}
    for record in read_metrics(tmp_path):
        row = expected.setdefault(record["step"], {})
        row.update({f"{record['split']}/{k}": v for k, v in record.items() if k not in ("step", "split")})
    assert sorted(expected) == [0, 1, 2, 3] and "eval/loss" in expected[2] and "train/loss" in expected[2]
    # W&B's own service process writes the offline file; under a loaded machine its last blocks land a moment after
    # the run has finished (seen in a parallel test run): read it until it holds the run or 60 s have passed
    deadline = time.monotonic() + 60
    while read_wandb_history(log) != expected and time.monotonic() < deadline:
        time.sleep(0.5)
    assert read_wandb_history(log) == expected
