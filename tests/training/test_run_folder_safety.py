"""A run folder is safe (issue 57): checkpoints hold nothing that runs when read, one run writes a folder at a time,
a resume refuses what would mix two runs (another lr, other examples, fewer steps) unless told to continue with new
settings (which then take effect and are recorded), a run's own files never block it, and a fresh start keeps the old
record aside. Tiny random models; the integration test trains through ``train.py`` as a user does."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import ROOT
from helpers.training import (
    WORDS,
    compose_config,
    make_model_dir,
    read_metrics,
    train_command,
    train_overrides,
)

from medusa_train.config.check import FileProblem
from medusa_train.training import checkpoint
from medusa_train.training.loop import cosine_schedule
from medusa_train.training.resume import resume_problems
from medusa_train.training.run_folder import RunFolder


# ------------------------------------------------------------------------------------ checkpoints run no code
def _optimizer(seed: int = 0):
    torch.manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(4, 3))
    optimizer = torch.optim.AdamW([weight], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    weight.sum().backward()
    optimizer.step()
    scheduler.step()
    return {"w": weight}, optimizer, scheduler


def _saved(tmp_path):
    params, optimizer, scheduler = _optimizer()
    return checkpoint.save_checkpoint(tmp_path, 1, params, optimizer, scheduler, {"epoch": 0, "micro_in_epoch": 1},
                                      [checkpoint.rng_state()], keep_last=1)


class _Payload:
    """A pickle that runs a command when it is loaded by a reader that allows it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("name", ["optimizer.pt", "rng.pt"])
def test_a_crafted_pickle_in_a_checkpoint_does_not_run(tmp_path, name):
    path = _saved(tmp_path / "run")
    marker = tmp_path / "ran"
    (path / {"rng.pt": "rng.json", "optimizer.pt": "optimizer.safetensors"}[name]).unlink(missing_ok=True)  # older
    with open(path / name, "wb") as f:
        pickle.dump({"optimizer": _Payload(marker), "scheduler": {}}, f)
    with pytest.raises(Exception) as err:
        checkpoint.load_checkpoint(path, *_optimizer(seed=1))
    assert not marker.exists()  # the command in the pickle never ran
    assert isinstance(err.value, FileProblem) and f"{name}: cannot be read" in str(err.value)
    assert "weights_only=False" not in "".join(p.read_text() for p in (ROOT / "medusa_train").rglob("*.py"))


def test_rng_states_round_trip_through_json_and_an_older_rng_pt_still_reads(tmp_path):
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1)  # not the seeded start
    state = checkpoint.rng_state()
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    params, optimizer, scheduler = _optimizer()  # draws from the generators: they are elsewhere now
    path = checkpoint.save_checkpoint(tmp_path / "run", 1, params, optimizer, scheduler,
                                      {"epoch": 0, "micro_in_epoch": 1}, [state], keep_last=1)
    assert isinstance(json.loads((path / "rng.json").read_text()), list)  # plain JSON
    [saved] = checkpoint.read_rng(path)
    checkpoint.set_rng_state(saved)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
    torch.save([state], path / "rng.pt")  # what checkpoints held before
    (path / "rng.json").unlink()
    [legacy] = checkpoint.read_rng(path)
    checkpoint.set_rng_state(legacy)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_optimizer_state_round_trips_without_pickles_and_an_older_optimizer_pt_still_reads(tmp_path):
    params, optimizer, scheduler = _optimizer()
    path = _saved(tmp_path / "run")
    with open(path / "optimizer.safetensors", "rb") as f:
        assert f.read(8) and b"pickle" not in f.read()
    for layout in ("safetensors", "pt"):
        if layout == "pt":  # what checkpoints held before
            torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                       path / "optimizer.pt")
            (path / "optimizer.safetensors").unlink()
        fresh, fresh_optimizer, fresh_scheduler = _optimizer(seed=1)
        checkpoint.load_checkpoint(path, fresh, fresh_optimizer, fresh_scheduler)
        torch.testing.assert_close(fresh["w"], params["w"], rtol=0, atol=0)
        for (a, b) in zip(fresh_optimizer.state.values(), optimizer.state.values(), strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            assert a["step"].device.type == "cpu"
        assert fresh_scheduler.state_dict() == scheduler.state_dict()


@pytest.mark.parametrize("name,content", [("trainable.safetensors", b"\x00garbage"), ("optimizer.safetensors", b"garbage"),
                                          ("state.json", b"{not json"), ("rng.json", b"")])
def test_a_corrupt_checkpoint_file_is_named_in_one_line(tmp_path, name, content):
    path = _saved(tmp_path / "run")
    (path / name).write_bytes(content)
    for read in (lambda: checkpoint.load_checkpoint(path, *_optimizer(seed=1)), lambda: checkpoint.check_readable(path)):
        with pytest.raises(FileProblem) as err:
            read()
        assert str(err.value).startswith(f"{path / name}: cannot be read") and "\n" not in str(err.value)


# ------------------------------------------------------------------------------------ one run per folder
def test_the_folder_lock_refuses_a_second_run_and_a_killed_holder_leaves_it_free(tmp_path):
    folder = RunFolder(tmp_path / "run")
    with folder.lock(), pytest.raises(FileProblem, match=f"pid {os.getpid()} on"):
        with folder.lock():
            pass
    with folder.lock():  # released on exit
        pass
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom medusa_train.training.run_folder import "
                               f"RunFolder\nwith RunFolder(__import__('pathlib').Path({str(folder.root)!r})).lock():\n"
                               "    print('held', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(FileProblem, match="another training run is writing it"):
        with folder.lock():
            pass
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with folder.lock():  # a kill -9 leaves no stale lock
        pass


def _files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("command", [["train.py", "+recipe=medusa1", "heads.num_heads=0", "trainer.output_dir={}"],
                                     ["-m", "medusa_train", "evaluate", "draft={}/absent-draft", "output_dir={}"]])
def test_a_refused_command_writes_nothing_into_the_folder_it_names(tmp_path, command):
    """Hydra writes no record (``.hydra/``) or log of its own: a command refused by its checks changes nothing in an
    earlier run's folder, and creates no folder where none was."""
    earlier = tmp_path / "earlier"
    (earlier / ".hydra").mkdir(parents=True)
    (earlier / ".hydra" / "config.yaml").write_text("mine: true\n")
    (earlier / "notes.txt").write_text("an earlier run's\n")
    before = _files(earlier)
    for folder in (earlier, tmp_path / "absent"):
        done = subprocess.run([sys.executable, *(arg.replace("{}", str(folder)) for arg in command)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr[-3000:]
        assert "Traceback" not in done.stderr
    assert _files(earlier) == before and sorted(p.name for p in earlier.iterdir()) == [".hydra", "notes.txt"]
    assert not (tmp_path / "absent").exists()


def test_resume_never_into_a_folder_of_checkpoints_is_refused(tmp_path):
    _saved(tmp_path)
    [problem] = resume_problems(compose_config([f"trainer.output_dir={tmp_path}", "trainer.resume=never"]))
    assert problem.startswith("trainer.resume=never:") and "holds another run's checkpoints (step-0000001)" in problem


# ------------------------------------------------------------------------------------ resume, as a user runs it
def _counting_chat(path, n=60, seed=0, change=None):
    """Conversations with 60 distinct prompts (a validation set of a few holds out whole prompts)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            start = rng.randrange(10)
            reply = " ".join(WORDS[(start + j) % 10] for j in range(rng.randrange(12, 30)))
            if change is not None and i == change:
                reply = "ten nine eight"
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Count from {WORDS[start]}, take {i}."},
                                             {"role": "assistant", "content": reply}]}) + "\n")
    return path


def _train(model_dir, data, out, *extra, steps=4):
    return train_command(model_dir, data, out, *extra, **{"trainer.max_steps": steps, "trainer.save_every": 2,
                                                         "trainer.eval_every": 2, "data.validation.size": 2,
                                                         "data.validation.max_new_tokens": 8})


@pytest.mark.integration
def test_a_validated_run_trains_longer_and_a_resume_refuses_what_would_mix_runs(tmp_path):
    model_dir, data = make_model_dir(tmp_path / "model"), _counting_chat(tmp_path / "chat.jsonl")
    out = tmp_path / "run"
    first = _train(model_dir, data, out)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (out / "export" / "validation.json").is_file()  # the walk ran: the export records it

    # the README's way to train longer: the run's own validation.json does not block it
    longer = _train(model_dir, data, out, steps=6)
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / 'step-0000004'} at step 4" in longer.stdout
    records = read_metrics(out)

    # fewer steps than the checkpoint's, other examples, another lr (an explicit checkpoint too): refused, nothing run
    fewer = _train(model_dir, data, out, steps=2)
    assert fewer.returncode == 2 and "trainer.max_steps=2: this run has 2 steps in all, fewer than the 6" in fewer.stderr
    edited = _counting_chat(tmp_path / "edited.jsonl", change=7)
    shutil.copy(edited, data)
    changed = _train(model_dir, data, out, steps=8)
    assert changed.returncode == 2 and f"data.source={data}: its examples differ" in changed.stderr
    _counting_chat(data)  # the data as it was
    latest = out / "checkpoints" / "step-0000006"
    explicit = _train(model_dir, data, out, "optim.lr=0.05", f"trainer.resume={latest}", steps=8)
    assert explicit.returncode == 2, explicit.stderr[-3000:]
    assert "optim.lr=0.05: the run in trainer.output_dir=" in explicit.stderr and "with optim.lr=0.01" in explicit.stderr
    assert read_metrics(out) == records

    # on purpose: the new lr takes effect from the checkpoint's step, and the record says so
    purpose = _train(model_dir, data, out, "optim.lr=0.05", f"trainer.resume={latest}",
                     "trainer.resume_new_settings=true", steps=8)
    assert purpose.returncode == 0, purpose.stderr[-3000:]
    after = read_metrics(out)
    [note] = [r for r in after if r["split"] == "resume"]
    assert note["step"] == 6 and note["changed"] == {"optim.lr": [0.01, 0.05]}
    cfg = compose_config(train_overrides(model_dir, data, out, **{"trainer.max_steps": 8, "optim.lr": 0.05}))
    schedule = cosine_schedule(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.05),
                               cfg.optim.warmup_steps, 8, cfg.optim.min_lr_ratio)
    for _ in range(7):
        schedule.step()
    [step7] = [r for r in after if r["split"] == "train" and r["step"] == 7]
    assert step7["lr"] == pytest.approx(schedule.get_last_lr()[0], rel=1e-6)
    assert json.loads((out / "export" / "training_config.json").read_text())["trainer"]["resume_new_settings"]

    # a fresh start after the checkpoints are moved away: the old record is kept aside, the new one starts empty
    shutil.move(out / "checkpoints", tmp_path / "old-checkpoints")
    fresh = _train(model_dir, data, out, "optim.lr=0.05")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert read_metrics(out)[0]["step"] == 0 and [r["step"] for r in read_metrics(out)].count(4) == 2  # train + eval
    assert [json.loads(line) for line in (out / "metrics.1.jsonl").read_text().splitlines()] == after


@pytest.mark.integration
def test_a_second_training_into_a_folder_in_use_is_refused(tmp_path):
    model_dir, data = make_model_dir(tmp_path / "model"), _counting_chat(tmp_path / "chat.jsonl")
    out = tmp_path / "run"
    with RunFolder(out).lock():
        second = _train(model_dir, data, out)
    assert second.returncode == 2 and "another training run is writing it" in second.stderr
    assert "Traceback" not in second.stderr and sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing else
    again = _train(model_dir, data, out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [".lock", "checkpoints", "export", "metrics.jsonl"]

    # a corrupt checkpoint is named in one line before anything loads
    weights = out / "checkpoints" / "step-0000004" / "trainable.safetensors"
    weights.write_bytes(b"\x00" * 16)
    corrupt = _train(model_dir, data, out, steps=6)
    assert corrupt.returncode == 2 and corrupt.stderr.strip().splitlines()[-1].startswith(f"{weights}: cannot be read")
    assert "Traceback" not in corrupt.stderr and "trainable parameters" not in corrupt.stdout


@pytest.mark.integration
def test_a_validation_set_of_no_prompts_is_said_to_be_none_not_walked(tmp_path):
    """Five distinct prompts give no validation prompt (at most a tenth of the source): no "K=1 1.000" is logged or
    recorded; the log says there is none."""
    from helpers.training import make_chat_jsonl

    model_dir, data = make_model_dir(tmp_path / "model"), make_chat_jsonl(tmp_path / "chat.jsonl")
    run = _train(model_dir, data, tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "validation: none (0 prompts of" in run.stdout and "K=1" not in run.stdout
    assert not (tmp_path / "run" / "export" / "validation.json").exists()
    assert not any(k.startswith("validation/") for r in read_metrics(tmp_path / "run") for k in r)
