"""Two processes (gloo, through accelerate's DDP) train exactly what one process trains on the same global batch.

One process with ``optim.grad_accum_steps=2`` sees micro-batches 0 and 1 in its first step; two processes
with ``grad_accum_steps=1`` see micro-batch 0 on rank 0 and 1 on rank 1 (each rank reads every
``world``-th batch of the same order), so the averaged gradients, the logged losses and the exported
heads must agree to float rounding.
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers.launch import ACCELERATE, accelerate_cmd, free_port, run_launched
from helpers.training import make_chat_jsonl, make_model_dir, read_metrics, train_overrides
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
METRICS = ("loss", "head1/loss", "head2/loss", "head3/loss", "head1/top1", "head3/top5")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    return make_model_dir(root / "model"), make_chat_jsonl(root / "chat.jsonl", n=48)


def launch(script: str, overrides: list[str], processes: int, recipe: str = "medusa1") -> subprocess.CompletedProcess:
    args = [script, f"+recipe={recipe}", "debug=smoke", *overrides]
    cmd = accelerate_cmd(processes, *args) if processes > 1 else [sys.executable, *args]
    result = run_launched(cmd, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def assert_same_run(one: Path, two: Path, files: tuple[str, ...] = ("model.safetensors",)) -> None:
    a, b = read_metrics(one), read_metrics(two)
    assert [(m["step"], m["split"]) for m in a] == [(m["step"], m["split"]) for m in b]
    assert len([m for m in a if m["split"] == "train"]) == 8
    for x, y in zip(a, b):
        for name in METRICS:
            assert y[name] == pytest.approx(x[name], rel=1e-5, abs=1e-6), (x["step"], x["split"], name)
    for file in files:
        saved_a, saved_b = load_file(one / "export" / file), load_file(two / "export" / file)
        assert saved_a.keys() == saved_b.keys() and saved_a
        for name in saved_a:
            torch.testing.assert_close(saved_b[name], saved_a[name], rtol=1e-5, atol=1e-5)


# (online without accumulation is the accumulating case's last micro-batch: not run on its own, for CI's time)
@pytest.mark.parametrize("captured, accumulate, sharded", [(True, 1, False), (False, 2, False), (False, 2, True)],
                         ids=["captured", "online-accumulating", "online-sharded-backbone"])
@pytest.mark.integration
def test_two_processes_equal_one_with_the_same_global_batch(tiny, tmp_path, captured, accumulate, sharded):
    """``accumulate`` micro-batches per process and step (no_sync before the last) against one process
    with twice as many; ``sharded``: the two processes hold half of each backbone layer (model.fsdp)."""
    model_dir, data = tiny
    common = {"trainer.max_steps": 8, "trainer.eval_every": 4, "trainer.save_every": 4, "data.batch_size": 2,
              "heads.prefix_attention": "true", "heads.next_token_input": "true", "heads.path_input": "true"}
    if sharded:  # 3 held-out batches: rank 1 must run a padding forward, or the layers' all-gathers never meet
        common["data.eval_size"] = 6
    if captured:
        common.update({"data.cache_hidden_states": "true", "data.cache_dir": tmp_path / "states",
                       "data.shard_bytes": 300 * (64 * 4 + 8)})  # 300 tokens of hidden 64 in float32
        out = launch("scripts/capture.py", train_overrides(model_dir, data, tmp_path / "capture", **common), 2)
        assert "capture done" in out.stdout
        assert len(list((tmp_path / "states").glob("*-train/shard-*.safetensors"))) > 4
    launch("train.py", train_overrides(model_dir, data, tmp_path / "one", **common,
                                       **{"optim.grad_accum_steps": 2 * accumulate}), 1)
    two = launch("train.py", train_overrides(model_dir, data, tmp_path / "two", **common,
                                             **{"optim.grad_accum_steps": accumulate, "model.fsdp": str(sharded).lower()}), 2)
    assert "heads identical on all 2 processes" in two.stdout
    # freed before the process group is destroyed (loop.finish), or the group's destructor can deadlock at exit
    assert "DDP wrapper is still referenced" not in two.stdout
    if sharded:
        held = re.search(r"(\d+) \S+ layers, ([\d,]+) of its ([\d,]+) parameters held by each", two.stdout)
        assert held, two.stdout[-2000:]
        layers = sum(p.numel() for n, p in load_file(model_dir / "model.safetensors").items() if ".layers." in n)
        whole, mine = int(held[3].replace(",", "")), int(held[2].replace(",", ""))
        assert whole - mine == layers // 2  # each process holds half of every layer, the rest whole
        assert "read by process 0 and broadcast" in two.stdout  # rank 1 built it without weights
    assert_same_run(tmp_path / "one", tmp_path / "two")


@pytest.mark.integration
def test_a_checkpoint_resumes_only_with_the_number_of_processes_that_wrote_it(tiny, tmp_path):
    model_dir, data = tiny
    overrides = train_overrides(model_dir, data, tmp_path / "run", **{"trainer.max_steps": 4, "trainer.save_every": 2,
                                                                      "trainer.eval_every": 0})
    launch("train.py", [*overrides, "trainer.max_steps=2"], 1)  # leaves checkpoints/step-0000002
    result = run_launched(accelerate_cmd(2, "train.py", "+recipe=medusa1", "debug=smoke", *overrides), timeout=600)
    assert result.returncode != 0
    assert "was written by 1 process(es), this run has 2: resume with --num_processes 1" in result.stderr


@pytest.mark.integration
def test_medusa2_jointly_with_lora_on_two_processes_equals_one(tiny, tmp_path):
    """The joint step (4-bit backbone + LoRA + heads, backbone loss and heads' loss, one backward into the
    backbone) runs inside the DDP-wrapped module too: LoRA and heads come out as one process's."""
    model_dir, data = tiny
    common = {"trainer.max_steps": 8, "trainer.eval_every": 4, "trainer.save_every": 4, "data.batch_size": 2,
              "peft.r": 4, "peft.alpha": 8, "peft.dropout": 0.0, "loss.head_warmup_steps": 0, "loss.base": "distill",
              "trainer.merge_export": "false"}
    launch("train.py", train_overrides(model_dir, data, tmp_path / "one", **common, **{"optim.grad_accum_steps": 2}),
           1, "medusa2")
    two = launch("train.py", train_overrides(model_dir, data, tmp_path / "two", **common), 2, "medusa2")
    assert "heads identical on all 2 processes" in two.stdout
    assert_same_run(tmp_path / "one", tmp_path / "two", ("model.safetensors", "adapter/adapter_model.safetensors"))


@pytest.mark.integration
def test_killing_one_rank_and_rerunning_resumes_every_rank_from_the_same_step(tiny, tmp_path):
    model_dir, data = tiny
    common = {"trainer.max_steps": 40, "trainer.eval_every": 0, "trainer.save_every": 4, "data.batch_size": 2,
              "trainer.log_every": 4}
    cmd = accelerate_cmd(2, "train.py", "+recipe=medusa1", "debug=smoke",
                         *train_overrides(model_dir, data, tmp_path / "killed", **common))
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    first, deadline, started = tmp_path / "killed/checkpoints/step-0000004", time.monotonic() + 600, []
    try:
        while not first.exists() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        started = psutil.Process(launcher.pid).children(recursive=True)
        ranks = [c for c in started if "train.py" in " ".join(c.cmdline()) and c.environ().get("RANK") == "1"]
        assert len(ranks) == 1, "rank 1 was not found running after the first checkpoint"
        ranks[0].kill()
        try:  # torchrun normally stops the other rank within seconds; once it left rank 0 blocked in a collective
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    finally:  # the ranks run in sessions of their own: whatever is left goes with the launcher
        for process in [*started, psutil.Process(launcher.pid)] if launcher.poll() is None else started:
            try:
                process.kill()
            except psutil.Error:
                pass
    assert launcher.wait(timeout=60) != 0
    saved = sorted(p.name for p in (tmp_path / "killed/checkpoints").iterdir() if p.name.startswith("step-"))
    assert saved and saved[-1] != "step-0000040"  # killed before the end
    resumed = run_launched(cmd, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    step = int(saved[-1].split("-")[1])
    # (the two ranks' lines may interleave on the shared stdout)
    assert sorted(re.findall(r"rank (\d) resumed at step (\d+)", resumed.stdout)) == [("0", str(step)), ("1", str(step))]
    launch("train.py", train_overrides(model_dir, data, tmp_path / "whole", **common), 2)
    heads_a = load_file(tmp_path / "whole/export/model.safetensors")
    heads_b = load_file(tmp_path / "killed/export/model.safetensors")
    for name in heads_a:
        torch.testing.assert_close(heads_b[name], heads_a[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("engine", ["DEEPSPEED", "FSDP"])  # FSDP: an unsharded model (Medusa-2) under it
def test_engines_the_recipes_do_not_support_yet_stop_with_what_to_launch_instead(engine):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from medusa_train.training.loop import wrap

    accelerator = SimpleNamespace(num_processes=2, distributed_type=DistributedType[engine])
    with pytest.raises(ValueError, match=f"{engine}.*not supported.*configs/accelerate/ddp.yaml"):
        wrap(torch.nn.Linear(2, 2), accelerator)


def test_a_sharded_backbone_is_refused_where_it_cannot_run_naming_the_key():
    from helpers.training import compose_config

    from medusa_train.config.check import ConfigError

    with pytest.raises(ConfigError) as err:
        compose_config(["model.fsdp=true", "data.cache_hidden_states=true", "model.quantization=nf4"])
    assert [p.split(":")[0] for p in err.value.problems] == ["model.fsdp=true with model.quantization=nf4",
                                                             "model.fsdp=true with data.cache_hidden_states=true"]
    # Medusa-2 shards a 4-bit NF4 backbone (FSDP-QLoRA, tests/training/test_fsdp_qlora.py); 8-bit is refused
    with pytest.raises(ConfigError, match=r"model.fsdp=true with model.quantization=int8: .*nf4.*ddp.yaml"):
        compose_config(["model.fsdp=true", "model.quantization=int8"], recipe="medusa2")


@pytest.mark.integration
def test_accelerates_fsdp_without_a_gpu_is_refused_instead_of_running_each_process_alone(tiny, tmp_path):
    """accelerate turns an FSDP config into independent single-process runs on CPU (measured: distributed_type NO
    in both), which would write the same output folder twice over."""
    model_dir, data = tiny
    config = tmp_path / "fsdp.yaml"
    config.write_text((ROOT / "configs/accelerate/fsdp.yaml").read_text().replace("use_cpu: false", "use_cpu: true"))
    result = run_launched([ACCELERATE, "launch", "--config_file", str(config), "--num_processes", "2",
                           "--main_process_port", str(free_port()), "train.py", "+recipe=medusa1", "debug=smoke",
                           *train_overrides(model_dir, data, tmp_path / "run")], timeout=600)
    assert result.returncode != 0
    assert "2 processes were launched but accelerate made each a run of its own" in result.stderr
    assert "model.fsdp=true" in result.stderr and not (tmp_path / "run/metrics.jsonl").exists()
