"""Shared fixtures: tiny random backbones built in-process, and the packaged real model (slow).
The helpers behind them live in ``tests/helpers/``; test modules import from there, never from here."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: without it they are skipped (and counted), not failed."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
