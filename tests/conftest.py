"""Shared fixtures: tiny random backbones built in-process, and the packaged real model (slow).
The helpers behind them live in ``tests/helpers/``; test modules import from there, never from here."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# ``make test`` runs the suite in several processes (pytest-xdist, ``-n auto``): each gets its share of the cores
# for torch and the processes it starts, since two OpenMP pools on one core crawl (``one_thread`` below)
# and the vLLM servers they start compute on that share too (``VLLM_CPU_NUM_OF_RESERVED_CPU``: the rest kept from
# the engine's OpenMP threads, which are bound to their cores): an engine bound to every core beside another worker's
# torch waits on a thread that is not running (measured on the 2-core AMX CPU: a float32 step of 200-460 ms in
# the suite against ~95 ms on one core alone). A user's server keeps none by default (tests/engine/test_server.py)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(max(0, (os.cpu_count() or 1) - _share)))

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers.backbones import PACKAGED_MODEL, make_tiny_backbone  # noqa: E402


@pytest.fixture
def one_thread():
    """One torch thread: tiny models gain nothing from more, and on a shared CPU two OpenMP
    threads per process crawl (measured: ~7x slower generation steps under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["llama", "qwen2"])
def tiny_backbone(request):
    """Two architectures, so nothing silently depends on Llama's module names."""
    return make_tiny_backbone(request.param)


@pytest.fixture
def tiny_llama():
    return make_tiny_backbone("llama")


@pytest.fixture(scope="session")
def packaged_backbone():
    """The real packaged SmolLM2-135M-Instruct in float32 (slow: first use converts it, ~20 s)."""
    from medusa_train import load_backbone

    return load_backbone(PACKAGED_MODEL, dtype="float32")


#: tests (node id prefixes) that run one after another in one process, first, while ``make test``'s other processes
#: (pytest-xdist, ``-n auto``) run the rest beside them: the engine tests share their servers (session fixtures)
#: and take the longest
SERIAL_FIRST = ("tests/engine/test_vllm",)
#: the longest modules after them (about 1 to 6 minutes each here), so no worker is left with one at the end
LONG_NEXT = ("tests/training/test_distributed.py", "tests/training/test_cuda_path_gradient_checkpointing.py",
             "tests/training/test_fsdp_qlora.py", "tests/decoding/test_acceptance.py", "tests/decoding/test_generate.py",
             "tests/training/test_targets.py", "tests/backbone/test_load.py", "tests/training/test_medusa1.py",
             "tests/training/test_medusa2.py", "tests/evaluation/test_sampled_check.py")


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduling by module (a module's fixtures are made once), with ``SERIAL_FIRST`` one unit: one worker.
    Its ``loadgroup`` would group with marks, but under pytest 9.2 it cannot rename node ids, so its groups are
    ignored."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # keep the order below (xdist would put the modules with most tests first)

    class SerialFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "serial" if nodeid.startswith(SERIAL_FIRST) else super()._split_scope(nodeid)

    return SerialFirst(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: without it they are skipped (and counted), not failed. The ``SERIAL_FIRST``
    tests are collected first, so a worker starts on them at once, then the ``LONG_NEXT`` modules."""
    def rank(item) -> int:
        if item.nodeid.startswith(SERIAL_FIRST):
            return 0
        return next((1 + i for i, module in enumerate(LONG_NEXT) if item.nodeid.startswith(module)), len(LONG_NEXT) + 1)

    items.sort(key=rank)  # stable: the order within each part
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
