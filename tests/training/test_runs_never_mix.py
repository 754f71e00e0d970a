"""Runs never mix: the same command resumes; another run's settings in the same folder stop before loading."""

from __future__ import annotations

import json

import pytest
from helpers.training import (
    compose_config,
    make_chat_jsonl,
    make_model_dir,
    read_metrics,
    train_command,
    train_overrides,
)

from medusa_train.training import checkpoint
from medusa_train.training.resume import differences, resume_problems


def _train(model_dir, data, out, *extra):
    return train_command(model_dir, data, out, *extra, **{"trainer.max_steps": 4, "trainer.save_every": 2,
                                                         "trainer.eval_every": 0, "data.max_samples": 40})


@pytest.mark.integration
def test_a_second_run_with_other_settings_is_refused_and_the_same_one_resumes(tmp_path):
    model_dir, data = make_model_dir(tmp_path / "model"), make_chat_jsonl(tmp_path / "chat.jsonl")
    out = tmp_path / "run"
    first = _train(model_dir, data, out)
    assert first.returncode == 0, first.stderr[-3000:]
    latest = checkpoint.latest_checkpoint(out)
    assert json.loads((latest / "config.json").read_text())["optim"]["lr"] == 0.01  # the settings travel with it
    records = read_metrics(out)

    # the sequence: a new lr and data cap (and more steps) into the same folder
    mixed = _train(model_dir, data, out, "optim.lr=5e-2", "data.max_samples=200", "trainer.max_steps=24")
    assert mixed.returncode == 2
    assert "optim.lr=0.05: the run in trainer.output_dir=" in mixed.stderr and "with optim.lr=0.01" in mixed.stderr
    assert "data.max_samples=200:" in mixed.stderr and "with data.max_samples=40" in mixed.stderr
    assert "trainer.max_steps" not in mixed.stderr  # a key that may change on resume is not a difference
    assert f"trainer.resume={latest}" in mixed.stderr and "another trainer.output_dir" in mixed.stderr
    assert "resumed from" not in mixed.stdout and read_metrics(out) == records  # nothing loaded, nothing written

    # the same command with more steps continues the run (as the README promises)
    again = _train(model_dir, data, out, "trainer.max_steps=6")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {latest} at step 4" in again.stdout
    assert read_metrics(out)[:len(records)] == records
    assert checkpoint.latest_checkpoint(out).name == "step-0000006"

    # an explicit checkpoint with another lr is refused too (issue 57: it kept the old schedule); on purpose it is not
    cfg = compose_config(train_overrides(model_dir, data, out, **{"optim.lr": 0.05, "trainer.resume": str(latest),
                                                                "data.max_samples": 40}))
    [lr, how] = resume_problems(cfg)
    assert lr.startswith("optim.lr=0.05: ") and "trainer.resume_new_settings=true" in how
    cfg.trainer.resume_new_settings = True
    assert resume_problems(cfg) == []


def test_a_checkpoint_without_stored_settings_is_not_resumed_blindly(tmp_path):
    folder = checkpoint.checkpoints_dir(tmp_path) / "step-0000002"
    folder.mkdir(parents=True)
    (folder / "state.json").write_text("{}")
    [problem] = resume_problems(compose_config([f"trainer.output_dir={tmp_path}"]))
    assert "does not say which settings wrote it" in problem and f"trainer.resume={folder}" in problem


def test_differences_name_nested_keys_and_ignore_resumable_ones():
    stored = {"optim": {"lr": 1e-3, "betas": [0.9, 0.999]}, "trainer": {"max_steps": 10, "seed": 1}, "logger": None}
    current = {"optim": {"lr": 1e-3, "betas": [0.9, 0.99]}, "trainer": {"max_steps": 20, "seed": 2},
               "logger": {"project": "p"}}
    assert differences(stored, current) == [("optim.betas", [0.9, 0.999], [0.9, 0.99]), ("trainer.seed", 1, 2)]


def test_a_checkpoint_written_before_a_setting_existed_resumes_at_its_default():
    """A checkpoint from before ``eagle3`` was a section resumes a run at the defaults; the new section's other values
    are still named."""
    from medusa_train.config.train import TrainConfig, to_dict
    from medusa_train.training.resume import differences

    current = to_dict(TrainConfig())
    stored = {k: v for k, v in current.items() if k != "eagle3"}
    assert differences(stored, current) == []
    changed = to_dict(TrainConfig())
    changed["eagle3"]["ttt_steps"] = 3
    assert differences(stored, changed) == [("eagle3.ttt_steps", 7, 3)]


def test_a_checkpoint_written_before_the_renames_resumes_under_the_new_names():
    """``heads.vocab_size`` is ``heads.draft_vocab_size`` now and ``bf16`` is spelled ``bfloat16``: a checkpoint with
    the old names and the same values resumes; one with another draft vocabulary is still refused, by its new name."""
    from medusa_train.config.train import TrainConfig, to_dict

    current = to_dict(TrainConfig())
    current["heads"]["draft_vocab_size"] = 4096
    stored = json.loads(json.dumps(current))
    stored["heads"]["vocab_size"] = stored["heads"].pop("draft_vocab_size")
    stored["eagle3"]["vocab_size"] = stored["eagle3"].pop("draft_vocab_size")
    stored["trainer"]["mixed_precision"] = "bf16"
    assert current["trainer"]["mixed_precision"] == "bfloat16"
    assert differences(stored, current) == []
    stored["heads"]["vocab_size"] = 2048
    assert differences(stored, current) == [("heads.draft_vocab_size", 2048, 4096)]
