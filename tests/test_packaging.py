"""The package's shape: the wheel carries configs/ and the built-in trees, and an installed medusa_train
uses them (not a checkout); config/ is the first stage of the data flow and imports no later one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "medusa_train", "configs")  # all the build reads

INSTALLED_CHECK = """
import sys
from pathlib import Path

import medusa_train
from medusa_train import TokenTree
from medusa_train.config.compose import compose_config
from medusa_train.config.paths import CONFIG_DIR

site = Path(sys.argv[1]).resolve()
assert Path(medusa_train.__file__).resolve().is_relative_to(site), medusa_train.__file__
assert CONFIG_DIR.resolve() == site / "medusa_train" / "configs", CONFIG_DIR
train = compose_config("train", ["+recipe=medusa1", "debug=smoke"])
assert train.method == "medusa1" and train.heads.num_heads == 4, (train.method, train.heads)
assert train.trainer.max_steps == 12 and train.data.max_length == 256, train  # a preset over the defaults
evaluate = compose_config("evaluate", ["heads=somewhere", "tree=small"])
assert (evaluate.heads, evaluate.tree) == ("somewhere", "small")
tree = TokenTree.from_name("default")
assert tree.num_nodes == 64, tree
print("installed medusa_train works from", site)
"""


@pytest.mark.slow
@pytest.mark.integration
def test_the_wheel_carries_configs_and_trees_and_works_without_the_checkout(tmp_path):
    # Built from a clean copy: a build in the checkout would leave build/ there, and a later build
    # would ship stale files from it.
    source = tmp_path / "source"
    source.mkdir()
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, source / name)
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    pip = [sys.executable, "-m", "pip"]
    built = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), "."],
                           cwd=source, env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert "BuildBackendWarning" not in built.stderr, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("medusa_train-*.whl")

    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "medusa_train").rglob("*.py")
               if "__pycache__" not in p.parts}
    configs = {f"medusa_train/configs/{p.relative_to(ROOT / 'configs').as_posix()}"
               for p in (ROOT / "configs").rglob("*.yaml")}
    assert "medusa_train/configs/tree/default.yaml" in configs
    assert not (modules | configs) - names, sorted((modules | configs) - names)
    assert "medusa_train/backbone/rows.cpp" in names  # the row kernel is compiled where it runs, from its source

    site = tmp_path / "site"
    # --target installs beside the environment: the environment's own (editable) install is left alone
    installed = subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], env=env,
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]

    elsewhere = tmp_path / "elsewhere"  # neither the checkout nor the wheel's folder is the working directory
    elsewhere.mkdir()
    ran = subprocess.run([sys.executable, "-c", INSTALLED_CHECK, str(site)], cwd=elsewhere,
                         env={**env, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"},
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert "installed medusa_train works from" in ran.stdout

    # the wheel's console command: every stage listed, and a training preset composed from the wheel's configs
    command = site / "bin" / "medusa-train"
    assert command.is_file(), sorted(p.name for p in (site / "bin").iterdir()) if (site / "bin").is_dir() else site
    run_env = {**env, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    listed = subprocess.run([str(command), "--help"], cwd=elsewhere, env=run_env, capture_output=True, text=True,
                            timeout=120)
    assert listed.returncode == 0, listed.stderr[-3000:]
    for name in ("distill", "capture", "train", "build-tree", "evaluate", "export", "choose-k", "demo"):
        assert f"\n  {name} " in listed.stdout, listed.stdout
    # the K sweep the export's serve line points to runs from the wheel (benchmarks/ is not in it)
    helped = subprocess.run([str(command), "choose-k", "--help"], cwd=elsewhere, env=run_env, capture_output=True,
                            text=True, timeout=120)
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert "medusa-train choose-k draft=<heads dir>" in helped.stdout, helped.stdout
    for key in ("heads", "model", "dtype", "ks", "limit", "max_tokens", "concurrency", "output", "server"):
        assert f"\n{key}:" in helped.stdout, (key, helped.stdout)
    assert "  kv_cache_gib: 2" in helped.stdout, helped.stdout  # the server's keys, from ServerConfig
    composed = subprocess.run([str(command), "train", "experiment=demo", "--cfg", "job"], cwd=elsewhere, env=run_env,
                              capture_output=True, text=True, timeout=120)
    assert composed.returncode == 0, composed.stderr[-3000:]
    assert "vocab_size: 4096" in composed.stdout and "prefix_attention: true" in composed.stdout
    assert not list(elsewhere.iterdir())  # --cfg job writes nothing
