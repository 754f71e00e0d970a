"""The test harness's launcher (tests/helpers/launch.py): a run past its limit ends with every process it
started, ranks in sessions of their own included, and the failure shows where each one waited."""

import sys
import textwrap

import psutil
import pytest
from helpers.launch import run_launched

pytestmark = pytest.mark.integration  # every test here starts processes

# A "launcher" that starts a "rank" in a session of its own, as torchrun does, both waiting forever.
RANK = textwrap.dedent("""
    import faulthandler, signal, time
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    def wait_in_a_collective():
        time.sleep(1000)
    wait_in_a_collective()
""")
LAUNCHER = textwrap.dedent(f"""
    import faulthandler, signal, subprocess, sys, time
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    rank = subprocess.Popen([sys.executable, "-c", {RANK!r}], start_new_session=True)
    print("RANK_PID", rank.pid, flush=True)
    time.sleep(1000)
""")


def test_a_run_past_its_limit_is_killed_whole_and_fails_with_every_process_stack(tmp_path):
    with pytest.raises(pytest.fail.Exception) as failure:
        run_launched([sys.executable, "-c", LAUNCHER], timeout=5, cwd=tmp_path)
    message = str(failure.value)
    assert "did not finish in 5 s" in message
    assert "wait_in_a_collective" in message  # the rank's stack, printed before it was killed
    rank = int(message.split("RANK_PID ")[1].split()[0])
    assert not psutil.pid_exists(rank) or psutil.Process(rank).status() == psutil.STATUS_ZOMBIE


def test_a_run_within_its_limit_returns_its_output_and_exit_code(tmp_path):
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    result = run_launched([sys.executable, "-c", code], timeout=60, cwd=tmp_path)
    assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n")  # the streams kept apart
