"""The CUDA tier of training (marked ``gpu``: skipped without CUDA; ``pytest -m gpu`` on a machine that has it).

On the packaged model, in bf16 on the GPU:

- Medusa-1: a run killed with SIGKILL after a checkpoint and run again resumes there (optimizer state read
  onto the GPU, never onto another rank's) and trains on as the uninterrupted run does;
- Medusa-2: NF4 weights of bitsandbytes' CUDA backend, LoRA and heads trained jointly with gradient
  checkpointing, the export merged into the original weights;
- capture, then training on the captured states: the shards sized in bytes for the states' real dtype, and
  the training on states equal to the online training;
- flash attention for training where it is installed.

The CPU tier shows each property on CPU (tests/training, tests/data); these run the same code on CUDA kernels,
so equalities are to bf16 rounding, not bit-exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT
from helpers.backbones import PACKAGED_MODEL
from helpers.training import (
    compose_config,
    kill_after_checkpoint,
    make_chat_jsonl,
    read_metrics,
    resumed_at,
    train_overrides,
)

from medusa_train.cli.train import run
from medusa_train.config.model import flash_attention_available

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    return make_chat_jsonl(tmp_path_factory.mktemp("gpu") / "chat.jsonl", n=64)


def _overrides(data, out, **extra) -> list[str]:
    """The packaged model in bf16 on the GPU (autocast bf16), short examples."""
    values = {"model.dtype": "bfloat16", "trainer.mixed_precision": "bfloat16", "data.max_length": 128,
              "heads.num_heads": 3, **extra}
    return train_overrides(PACKAGED_MODEL, data, out, **values)


def _train_cmd(data, out, **extra) -> list[str]:
    return [sys.executable, "train.py", "+recipe=medusa1", "debug=smoke",
            *_overrides(data, out, **{"trainer.max_steps": 40, "trainer.save_every": 5, "trainer.eval_every": 0,
                                      "trainer.keep_last": 20, "data.batch_size": 2, **extra})]


def _train_losses(out) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(out) if m["split"] == "train"}


@pytest.mark.integration
def test_medusa1_bf16_killed_and_rerun_resumes_on_the_gpu(chats, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    reference = subprocess.run(_train_cmd(chats, tmp_path / "ref"), cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=900)
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert "train: peak GPU memory" in reference.stdout  # every command says what it held on the GPU

    crashed = tmp_path / "crashed"
    kill_after_checkpoint(_train_cmd(chats, crashed), crashed, 10, env, timeout=600)
    before = read_metrics(crashed)

    resumed = subprocess.run(_train_cmd(chats, crashed), cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    step = resumed_at(resumed.stdout)
    assert step >= 10
    after = read_metrics(crashed)
    assert after[:len(before)] == before
    ref, again = _train_losses(tmp_path / "ref"), {m["step"]: m["loss"] for m in after[len(before):]
                                                   if m["split"] == "train"}
    assert sorted(again) == list(range(step + 1, 41))
    for s, loss in again.items():  # CUDA kernels in bf16: equal to rounding, not bit for bit
        assert loss == pytest.approx(ref[s], rel=2e-2), s

    # the checkpoint's optimizer state lands on this process's GPU (map_location), whatever device wrote it
    from safetensors.torch import load_file

    from medusa_train.training import checkpoint

    path = checkpoint.latest_checkpoint(crashed)
    weights = {n: torch.nn.Parameter(t.to("cuda")) for n, t in load_file(str(path / "trainable.safetensors")).items()}
    optimizer = torch.optim.AdamW(list(weights.values()), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    checkpoint.load_checkpoint(path, weights, optimizer, scheduler)
    moments = [v for st in optimizer.state.values() for k, v in st.items() if k != "step"]
    assert moments and all(t.device.type == "cuda" for t in moments)


def test_medusa2_on_bitsandbytes_cuda_trains_lora_and_heads_and_merges_into_the_original(chats, tmp_path):
    import bitsandbytes as bnb

    from medusa_train.backbone.merge import read_backbone_info
    from medusa_train.export.run import save_run_export
    from medusa_train.families.medusa.recipe_medusa2 import Medusa2Recipe
    from medusa_train.model.load import load_adapted_export

    cfg = compose_config(_overrides(chats, tmp_path, **{"trainer.max_steps": 6, "trainer.eval_every": 3,
                                                         "trainer.save_every": 3, "peft.r": 8, "peft.alpha": 16,
                                                         "loss.head_warmup_steps": 2,
                                                         "trainer.merge_export": "true"}), recipe="medusa2")
    assert cfg.model.quantization == "nf4" and cfg.peft.gradient_checkpointing
    recipe = Medusa2Recipe(cfg)
    recipe.setup()
    layers = [m for m in recipe.peft_model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and all(m.weight.device.type == "cuda" and m.weight.quant_type == "nf4" for m in layers)
    decoder_layers = recipe.peft_model.get_base_model().get_decoder().layers
    assert all(layer.gradient_checkpointing for layer in decoder_layers)
    torch.cuda.reset_peak_memory_stats()
    record = recipe.train()
    print(f"medusa2 on CUDA: peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB; last eval {record}")
    save_run_export(recipe.trained())
    recipe.cleanup()

    train = [m for m in read_metrics(tmp_path) if m["split"] == "train"]
    assert [m["step"] for m in train] == list(range(1, 7))
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in train)
    evals = [m for m in read_metrics(tmp_path) if m["split"] == "eval"]
    assert evals[0]["base/kl"] == pytest.approx(0.0, abs=1e-6) and evals[-1]["base/kl"] > 0  # the LoRA moved it
    export = tmp_path / "export"
    assert read_backbone_info(export)["merged_from"] == "original"
    merged, tokenizer = load_adapted_export(export, "merged", dtype="bfloat16")
    ids = torch.tensor([[5, 17, 42, 99, 123, 7]])
    with torch.no_grad():
        logits = merged.to("cuda")(ids.to("cuda"), return_base_logits=True).base_logits
    assert torch.isfinite(logits).all()


@pytest.mark.integration
def test_capture_then_training_on_states_equals_training_online(chats, tmp_path):
    from medusa_train.data.capture import read_index

    common = {"trainer.max_steps": 6, "trainer.eval_every": 3, "trainer.save_every": 0, "data.batch_size": 4,
              "data.cache_dir": tmp_path / "states", "data.shard_bytes": 64 * 1160}  # 64 tokens of bf16 at 576
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    captured = subprocess.run([sys.executable, "scripts/capture.py", "+recipe=medusa1", "debug=smoke",
                               *_overrides(chats, tmp_path / "capture", **common)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert captured.returncode == 0, captured.stderr[-3000:]
    assert "capture done" in captured.stdout
    folders = sorted((tmp_path / "states").glob("*-train"))
    assert len(folders) == 1
    index = json.loads((folders[0] / "index.json").read_text())
    assert read_index(folders[0], index["key"]) is not None
    assert index["bytes_per_token"] == pytest.approx(576 * 2 + 8, rel=0.05)  # bf16 states under autocast + label
    assert len(index["shards"]) > 1 and all(s["tokens"] <= 64 or s["examples"] == 1 for s in index["shards"])

    run(compose_config(_overrides(chats, tmp_path / "on-states", **common, **{"data.cache_hidden_states": "true"})))
    run(compose_config(_overrides(chats, tmp_path / "online", **common)))
    on_states, online = _train_losses(tmp_path / "on-states"), _train_losses(tmp_path / "online")
    assert sorted(on_states) == sorted(online) == list(range(1, 7))
    for s in online:
        assert on_states[s] == pytest.approx(online[s], rel=2e-2), s


@pytest.mark.skipif(not flash_attention_available("flash_attention_2"), reason="flash-attn is not installed")
def test_medusa1_trains_with_flash_attention_2(chats, tmp_path):
    cfg = compose_config(_overrides(chats, tmp_path, **{"model.attn_implementation": "flash_attention_2",
                                                        "trainer.max_steps": 4, "trainer.eval_every": 0}))
    run(cfg)
    losses = _train_losses(tmp_path)
    assert sorted(losses) == [1, 2, 3, 4] and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
