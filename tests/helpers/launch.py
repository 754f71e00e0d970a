"""Run a command that may start several processes (``accelerate launch``) and never outlive it.

torchrun starts each rank in a session of its own (``start_new_session=True`` in torch's
``SubprocessHandler``), so killing the launcher's process group leaves the ranks running, holding the
CPU and the output pipes: a test reading those pipes then waits forever (a CI run once spent its whole
budget so). Here a run that passes its time limit has every rank's Python stacks printed (the commands
register ``faulthandler`` on SIGUSR1, ``medusa_train.cli.entry``), then the whole process tree is killed,
and the test fails with the output's tail, stacks included.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers import ROOT

ACCELERATE = str(Path(sys.executable).parent / "accelerate")


def free_port() -> int:
    """A TCP port free now: each launch gets its own rendezvous port, so no run meets another's store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_cmd(processes: int, *args: str) -> list[str]:
    """``accelerate launch --cpu --num_processes N`` on a port of its own, then ``args`` (script and overrides)."""
    return [ACCELERATE, "launch", "--cpu", "--num_processes", str(processes), "--main_process_port", str(free_port()),
            *args]


def kill_tree(root: psutil.Process, dump_stacks: bool, launcher: bool) -> None:
    """SIGUSR1 to the processes that registered a stack dump (every one but an ``accelerate`` ``launcher`` root,
    which SIGUSR1 would end before it printed anything), a moment to write, then SIGKILL to the whole tree; returns
    once every process of it has ended (gone, or a zombie left for its parent to reap), 10 s at most."""
    try:
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    if dump_stacks:
        for p in tree:
            try:
                if p is not root or not launcher:
                    p.send_signal(signal.SIGUSR1)
            except psutil.Error:
                pass
        time.sleep(3)
    for p in tree:
        try:
            p.kill()
        except psutil.Error:
            pass
    # a killed process closes its pipes before it turns zombie, so the output can end while it still runs
    deadline = time.monotonic() + 10
    for p in tree:
        while time.monotonic() < deadline:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.Error:  # gone
                break
            time.sleep(0.02)


def run_launched(cmd: list[str], timeout: float, env: dict | None = None,
                 cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` whose timeout ends every process it started
    (ranks in sessions of their own included) and fails the test with every rank's stacks."""
    env = dict(os.environ, OMP_NUM_THREADS="1") if env is None else env
    process = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)
    root, launcher = psutil.Process(process.pid), cmd[0] == ACCELERATE
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(root, True, launcher)
        try:
            stdout, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # something outside the tree still holds the pipes: give up reading
            process.kill()
            stdout, stderr = "", "(output not readable: a process outside the launched tree holds its pipes)"
        pytest.fail(f"{' '.join(map(str, cmd[:8]))} ... did not finish in {timeout:.0f} s; its processes' stacks and "
                    f"output:\n{stdout[-2000:]}\n{stderr[-12000:]}")
    finally:
        kill_tree(root, False, launcher)  # ranks a failing launcher left behind
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
