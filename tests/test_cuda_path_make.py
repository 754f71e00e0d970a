"""`make setup` on a GPU machine: the torch index reaches pip as an option, TORCH_SPEC stays one requirement.

`make -B -n` prints the commands both environments (.venv, .venv-vllm) would run, without running them.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
INDEX = "https://example.invalid/whl/cu128"

pytestmark = [pytest.mark.skipif(shutil.which("make") is None, reason="needs make"),
              pytest.mark.integration]  # runs make (a dry run)


def _dry_run(*assignments: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-B", "-n", "setup", *assignments], cwd=ROOT, capture_output=True, text=True)


def _torch_installs(out: str) -> list[list[str]]:
    """Each pip install of torch as pip's argv (after the shell's quoting)."""
    lines = [shlex.split(line) for line in out.splitlines() if "pip install" in line]
    return [argv[argv.index("install") + 1:] for argv in lines
            if any(a.startswith("torch") for a in argv[argv.index("install") + 1:])]


def _requirements(args: list[str]) -> list[str]:
    positional, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("--index-url", "-c", "--extra-index-url"):
            skip = True
        elif not a.startswith("-"):
            positional.append(a)
    return positional


def test_torch_index_url_reaches_pip_as_an_option_in_both_environments():
    done = _dry_run(f"TORCH_INDEX_URL={INDEX}")
    assert done.returncode == 0, done.stderr
    installs = _torch_installs(done.stdout)
    assert len(installs) == 2, done.stdout  # .venv and .venv-vllm
    for args in installs:
        assert args[args.index("--index-url") + 1] == INDEX
        requirements = _requirements(args)
        assert requirements == ["torch==2.13.0"], args  # one requirement, the index not inside it
        assert str(Requirement(requirements[0]).specifier) == "==2.13.0"


def test_without_an_index_pip_uses_its_own_and_a_custom_spec_stays_one_requirement():
    done = _dry_run()
    assert done.returncode == 0, done.stderr
    assert all("--index-url" not in args for args in _torch_installs(done.stdout))
    custom = _dry_run("TORCH_SPEC=torch>=2.13,<2.14", f"TORCH_INDEX_URL={INDEX}", "VLLM_SPEC=")
    installs = _torch_installs(custom.stdout)
    assert len(installs) == 1 and _requirements(installs[0]) == ["torch>=2.13,<2.14"], custom.stdout


def test_pip_options_inside_torch_spec_are_refused_naming_torch_index_url():
    done = _dry_run(f"TORCH_SPEC=torch==2.13.0 --index-url {INDEX}")
    assert done.returncode != 0
    assert "TORCH_INDEX_URL" in done.stderr and "one requirement" in done.stderr
