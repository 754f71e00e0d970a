"""``accelerate launch --cpu --num_processes N`` re-executes the command under torch.distributed.run as it was
started: ``-m medusa_train capture`` as a module (``medusa-train <command>`` rewrites ``sys.argv``, so the
original command line is what counts), a script as that script."""

import pytest

from medusa_train.cli.launch import started_as


@pytest.mark.parametrize("orig_argv, relaunched", [
    (["python", "-m", "medusa_train", "capture", "a=1"], ["--module", "medusa_train", "capture", "a=1"]),
    (["python", "-u", "-X", "dev", "-m", "medusa_train", "train"], ["--module", "medusa_train", "train"]),
    (["python", "scripts/capture.py", "a=1"], ["scripts/capture.py", "a=1"]),
    (["python", "-W", "ignore", "train.py", "+recipe=medusa1"], ["train.py", "+recipe=medusa1"]),
    (["python", "/venv/bin/medusa-train", "capture", "a=1"], ["/venv/bin/medusa-train", "capture", "a=1"]),
])
def test_the_relaunch_runs_what_was_started(orig_argv, relaunched):
    assert started_as(orig_argv) == relaunched
