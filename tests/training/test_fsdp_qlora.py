"""FSDP-QLoRA: Medusa-2 with the 4-bit backbone's decoder layers, LoRA included, sharded over two processes
(``model.fsdp=true``, FSDP2 on gloo, bitsandbytes' CPU 4-bit path) trains what one unsharded process trains on
the same global batch, and a checkpoint of the sharded run resumes to the same export as the uninterrupted run.

As in ``test_distributed.py``: one process with ``optim.grad_accum_steps=2`` sees micro-batches 0 and 1 in each
step, two processes see micro-batch 0 on rank 0 and 1 on rank 1; LoRA dropout is off (its masks would come from
each process's own random stream). Measured here: the logged losses are bit-identical for the first seven steps
and differ by ~1e-8 after (the order gradients are summed in), the exports by at most 3e-8.
"""

import re
import shutil
import sys

import pytest
import torch
from helpers.launch import accelerate_cmd, run_launched
from helpers.training import compose_config, make_chat_jsonl, make_model_dir, read_metrics, train_overrides
from safetensors.torch import load_file

from medusa_train.training import checkpoint

METRICS = ("loss", "head1/loss", "head2/loss", "head3/loss", "head1/top1", "head3/top5")
# Medusa-2's own figures, over every process's micro-batches in train records as in eval records
EXTRA_METRICS = ("heads_loss", "base/kl", "base/ce", "base/agreement")
EXPORTED = ("model.safetensors", "adapter/adapter_model.safetensors", "merged/model.safetensors")
COMMON = {"trainer.max_steps": 8, "trainer.eval_every": 4, "trainer.save_every": 4, "trainer.keep_last": 2,
          "data.batch_size": 2, "peft.r": 4, "peft.alpha": 8, "peft.dropout": 0.0, "loss.head_warmup_steps": 0,
          "loss.base": "distill", "trainer.merge_export": "true"}  # checkpointing on: the recipe's default


def launch(overrides: list[str], processes: int):
    args = ["train.py", "+recipe=medusa2", "debug=smoke", *overrides]
    cmd = accelerate_cmd(processes, *args) if processes > 1 else [sys.executable, *args]
    result = run_launched(cmd, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(model folder, data, root)``: ``root/one`` trained by one process, ``root/two`` sharded over two."""
    root = tmp_path_factory.mktemp("fsdp_qlora")
    model_dir, data = make_model_dir(root / "model"), make_chat_jsonl(root / "chat.jsonl", n=48)
    launch(train_overrides(model_dir, data, root / "one", **COMMON, **{"optim.grad_accum_steps": 2}), 1)
    two = launch(train_overrides(model_dir, data, root / "two", **COMMON, **{"model.fsdp": "true"}), 2)
    (root / "two.log").write_text(two.stdout)
    return model_dir, data, root


def assert_same_metrics(a: list[dict], b: list[dict], rel: float) -> None:
    assert [(m["step"], m["split"]) for m in a] == [(m["step"], m["split"]) for m in b]
    for x, y in zip(a, b):
        for name in METRICS + EXTRA_METRICS:
            if name in x:
                assert y[name] == pytest.approx(x[name], rel=rel, abs=rel), (x["step"], x["split"], name)


def assert_same_tensors(a: dict, b: dict, tolerance: float) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=tolerance, atol=tolerance)


@pytest.mark.integration
def test_sharded_medusa2_on_two_processes_trains_what_one_process_trains(runs):
    model_dir, _, root = runs
    log = (root / "two.log").read_text()
    assert "heads identical on all 2 processes" in log
    one, two = read_metrics(root / "one"), read_metrics(root / "two")
    assert len([m for m in two if m["split"] == "train"]) == 8 and "base/kl" in two[-1]
    assert_same_metrics(one, two, rel=1e-6)
    for file in EXPORTED:  # written once, by process 0, from whole tensors
        assert_same_tensors(load_file(root / "one/export" / file), load_file(root / "two/export" / file), 1e-6)
    # the checkpoint holds the LoRA weights and their AdamW moments whole, gathered: as one process's
    for step in ("step-0000004", "step-0000008"):
        assert_same_tensors(load_file(root / "one/checkpoints" / step / "trainable.safetensors"),
                            load_file(root / "two/checkpoints" / step / "trainable.safetensors"), 1e-6)
        moments = [checkpoint.read_optimizer(root / run / "checkpoints" / step, torch.device("cpu"))["optimizer"]
                   for run in ("one", "two")]
        assert moments[0]["state"].keys() == moments[1]["state"].keys()
        for index, state in moments[0]["state"].items():
            assert_same_tensors({k: v for k, v in state.items() if k != "step"},
                                {k: v for k, v in moments[1]["state"][index].items() if k != "step"}, 1e-6)
    # each process holds half of every layer's parameters (4-bit weights, norms, LoRA); the rest whole
    held = re.search(r"(\d+) \S+ layers, ([\d,]+) of its ([\d,]+) parameters held by each", log)
    assert held, log[-2000:]
    whole, mine = int(held[3].replace(",", "")), int(held[2].replace(",", ""))
    outside = sum(t.numel() for n, t in load_file(model_dir / "model.safetensors").items() if ".layers." not in n)
    layers = whole - outside  # the layers' parameters as loaded: packed 4-bit weights, norms and LoRA
    assert int(held[1]) == 2 and layers > 0 and whole - mine == layers // 2
    assert "each process read and quantized the whole checkpoint itself" in log


@pytest.mark.integration
def test_a_sharded_checkpoint_resumes_to_the_uninterrupted_runs_export(runs, tmp_path):
    """Resumed from the sharded run's step-4 checkpoint (every process keeps its shard of the whole LoRA weights
    and AdamW moments saved), two processes finish bit for bit as the run that was never stopped."""
    model_dir, data, root = runs
    shutil.copytree(root / "two/checkpoints/step-0000004", tmp_path / "resumed/checkpoints/step-0000004")
    resumed = launch(train_overrides(model_dir, data, tmp_path / "resumed", **COMMON, **{"model.fsdp": "true"}), 2)
    assert sorted(re.findall(r"rank (\d) resumed at step (\d+)", resumed.stdout)) == [("0", "4"), ("1", "4")]
    whole = [m for m in read_metrics(root / "two") if m["step"] > 4]
    assert_same_metrics(whole, read_metrics(tmp_path / "resumed"), rel=0.0)
    for file in EXPORTED:
        assert_same_tensors(load_file(root / "two/export" / file), load_file(tmp_path / "resumed/export" / file), 0.0)


def test_what_fsdp_qlora_does_not_shard_is_refused_naming_the_key():
    from medusa_train.config.check import ConfigError

    compose_config(["model.fsdp=true"], recipe="medusa2")  # NF4, the recipe's default: sharded
    with pytest.raises(ConfigError) as err:
        compose_config(["model.fsdp=true", "model.quantization=int8", "model.device_map=auto",
                        "trainer.merge_export=true", "trainer.merge_into=dequantized"], recipe="medusa2")
    assert [p.split(":")[0] for p in err.value.problems] == [
        "model.fsdp=true with model.quantization=int8", "model.fsdp=true with trainer.merge_into=dequantized",
        "model.fsdp=true with model.device_map=auto"]
    assert "set model.quantization=nf4" in err.value.problems[0]
    assert "use trainer.merge_into=original" in err.value.problems[1]
    with pytest.raises(ConfigError, match=r"model.fsdp=true with model.quantization=None: .*nf4"):
        compose_config(["model.fsdp=true", "model.quantization=null"], recipe="medusa2")
    with pytest.raises(ConfigError, match=r"model.fsdp=true with data.cache_hidden_states=true"):
        compose_config(["model.fsdp=true", "stage=1", "data.cache_hidden_states=true"], recipe="medusa2")
