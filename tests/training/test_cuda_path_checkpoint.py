"""Resume puts the optimizer state on this process's device, whichever device the saving process had.

On CPU the property is shown with a checkpoint of the older layout (``optimizer.pt``) as a GPU machine writes it: ``torch.save`` tags each
storage with its device, and a storage tagged ``cuda:0`` (the tag is all that differs from a CPU save)
cannot be read unmapped where there is no ``cuda:0``; ``load_checkpoint`` reads it onto the device of the
parameters. The ``gpu`` case saves from real ``cuda:0`` tensors.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from medusa_train.training import checkpoint

TAG = {"device": None}


def _tag_as(storage):  # tags every storage saved inside `saved_as(...)` with another device
    return TAG["device"]


@contextlib.contextmanager
def saved_as(device: str):
    """``torch.save`` inside writes storages tagged ``device``, as a process on that device writes them."""
    entry = (0, _tag_as, lambda storage, location: None)
    torch.serialization.register_package(*entry)
    TAG["device"] = device
    try:
        yield
    finally:
        TAG["device"] = None
        registry = torch.serialization._package_registry
        if entry in registry:
            registry.remove(entry)


def _trained(device="cpu", seed=0):
    torch.manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(8, 4, device=device))
    bias = torch.nn.Parameter(torch.randn(8, device=device))
    optimizer = torch.optim.AdamW([weight, bias], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for _ in range(2):
        (weight.sum() + bias.square().sum()).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return {"w": weight, "b": bias}, optimizer, scheduler


def _state_tensors(optimizer, moments_only=False):
    return [v for state in optimizer.state.values() for k, v in state.items()
            if torch.is_tensor(v) and not (moments_only and k == "step")]


def test_optimizer_state_written_on_cuda_0_resumes_onto_this_process_device(tmp_path):
    """A checkpoint of the layout before optimizer.safetensors (whose tensors carry no device: ``read_optimizer``
    places them by its ``on_cpu`` list, the ``gpu`` case below)."""
    params, optimizer, scheduler = _trained()
    path = checkpoint.save_checkpoint(tmp_path, 2, params, optimizer, scheduler,
                                      {"epoch": 0, "micro_in_epoch": 2}, [checkpoint.rng_state()], keep_last=1)
    (path / "optimizer.safetensors").unlink()
    with saved_as("cuda:0"):
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, path / "optimizer.pt")
    if not torch.cuda.is_available():  # the file really is a cuda:0 one: unmapped, it cannot be read here
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(path / "optimizer.pt", weights_only=True)

    fresh, fresh_optimizer, fresh_scheduler = _trained(seed=1)
    state, rng = checkpoint.load_checkpoint(path, fresh, fresh_optimizer, fresh_scheduler)

    assert state["step"] == 2 and len(rng) == 1 and rng[0]["torch"].device.type == "cpu"
    loaded = _state_tensors(fresh_optimizer)
    assert loaded and all(t.device == fresh["w"].device for t in loaded)
    for got, want in zip(loaded, _state_tensors(optimizer), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_parameter_device_is_the_optimized_parameters_device():
    params, optimizer, _ = _trained()
    assert checkpoint.parameter_device(optimizer) == params["w"].device
    assert checkpoint.parameter_device(torch.optim.SGD([{"params": []}], lr=0.1)) == torch.device("cpu")


@pytest.mark.gpu
def test_state_saved_on_cuda_0_lands_on_the_resuming_process_device(tmp_path):
    params, optimizer, scheduler = _trained("cuda:0")
    path = checkpoint.save_checkpoint(tmp_path, 2, params, optimizer, scheduler,
                                      {"epoch": 0, "micro_in_epoch": 2}, [checkpoint.rng_state()], keep_last=1)
    targets = ["cpu"] + ([f"cuda:{torch.cuda.device_count() - 1}"] if torch.cuda.device_count() > 1 else [])
    for device in targets:
        fresh, fresh_optimizer, fresh_scheduler = _trained(device, seed=1)
        before = torch.cuda.memory_allocated(0)
        checkpoint.load_checkpoint(path, fresh, fresh_optimizer, fresh_scheduler)
        moments = _state_tensors(fresh_optimizer, moments_only=True)
        assert moments and all(t.device == torch.device(device) for t in moments)
        steps = [s["step"] for s in fresh_optimizer.state.values()]  # AdamW keeps its counters on the CPU
        assert all(t.device.type == "cpu" for t in steps)
        assert torch.cuda.memory_allocated(0) <= before  # nothing of the state went through cuda:0
