"""RMS norms on the row kernel (``medusa_train/backbone/row_norms.py``): a backbone's Llama-style norms, each row alone.

What they must hold: transformers' norm to float32 accuracy (bf16: within one rounding step, almost always equal); each
row's output bitwise the same whatever rows share the call and however many threads; autograd, and a norm of another
formula, left to the class's own forward; ``use_row_kernel`` switching a backbone's norms and every way back restoring
them, the state dict untouched.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers.backbones import make_tiny_backbone
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from medusa_train.backbone.native import cpu_isa
from medusa_train.backbone.row_layers import row_kernel_during, use_row_kernel, without_row_kernel
from medusa_train.backbone.row_norms import is_row_norm, norms_for, step_rms_norm, switch_norms
from medusa_train.backbone.rows import row_dtypes

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(cpu_isa() is None or shutil.which("c++") is None,
                       reason="the row kernel is built for AVX2/AVX-512 CPUs with a C++ compiler"),
]


def _dtypes():
    return [torch.float32, torch.bfloat16]


def _norm(width: int, dtype) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(width, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(width, generator=torch.Generator().manual_seed(width)) + 0.5)
    return norm.to(dtype).eval().requires_grad_(False)  # as a decoding backbone's


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("rows, width", [(1, 576), (16, 576), (64, 576), (5, 64), (7, 100), (2, 8)])
def test_the_kernels_norm_is_transformers_norm(dtype, rows, width):
    if dtype not in row_dtypes():
        pytest.skip(f"the row kernel does not take {dtype} here")
    norm = _norm(width, dtype)
    x = (3 * torch.randn(1, rows, width, generator=torch.Generator().manual_seed(rows))).to(dtype)
    with torch.no_grad():
        theirs = norm(x)
        ours = step_rms_norm(x, norm.weight, norm.variance_epsilon)
    assert ours is not None and ours.dtype == dtype and ours.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    else:  # one rounding step at most, and that rarely (the squares summed in another order)
        assert ((ours.float() - theirs.float()).abs() <= theirs.float().abs() * 2 ** -7).all()
        assert (ours == theirs).float().mean() >= 0.98


@pytest.mark.parametrize("dtype", _dtypes())
def test_a_row_is_bitwise_the_same_alone_beside_others_and_over_any_threads(dtype):
    if dtype not in row_dtypes():
        pytest.skip(f"the row kernel does not take {dtype} here")
    norm = _norm(576, dtype)
    x = torch.randn(200, 576, generator=torch.Generator().manual_seed(1)).to(dtype)
    together = step_rms_norm(x, norm.weight, 1e-5)
    for i, n in [(0, 1), (17, 1), (3, 12), (100, 64)]:
        assert torch.equal(step_rms_norm(x[i:i + n], norm.weight, 1e-5), together[i:i + n])
    torch.set_num_threads(2)
    try:
        assert torch.equal(step_rms_norm(x, norm.weight, 1e-5), together)
    finally:
        torch.set_num_threads(1)


def test_autograd_and_other_devices_dtypes_take_the_classs_own_forward():
    norm = _norm(64, torch.float32)
    x = torch.randn(2, 64, requires_grad=True)
    assert step_rms_norm(x, norm.weight, 1e-5) is None  # autograd
    assert step_rms_norm(x.detach().double(), norm.weight.double(), 1e-5) is None  # a dtype it does not take
    assert step_rms_norm(x.detach(), norm.weight[:32], 1e-5) is None  # a weight of another shape
    assert switch_norms(norm) == 1 and is_row_norm(norm)
    out = norm(x)  # through the switched class, with autograd: the class's own forward, bitwise
    out.sum().backward()
    assert x.grad is not None and torch.equal(out, LlamaRMSNorm.forward(norm, x))


class OddRMSNorm(LlamaRMSNorm):
    """Named as the norms are, with their attributes, but of another formula (Gemma-like: ``1 + weight``)."""

    def forward(self, x):
        return LlamaRMSNorm.forward(self, x) * (1 + self.weight) / self.weight


def test_a_norm_of_another_formula_stays_as_it_is():
    odd = OddRMSNorm(64)
    with torch.no_grad():
        odd.weight.fill_(0.5)
    assert switch_norms(odd) == 0 and type(odd) is OddRMSNorm


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_use_row_kernel_switches_a_backbones_norms_and_every_way_back_restores_them(arch):
    backbone = make_tiny_backbone(arch, layers=2)
    state = {k: v.clone() for k, v in backbone.state_dict().items()}
    kinds = {type(m) for m in backbone.modules() if type(m).__name__.endswith("RMSNorm")}
    ids = torch.randint(3, 200, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = backbone(ids).logits
    count, message = use_row_kernel(backbone)
    assert count > 0 and "and 5 RMS norms" in message  # two a layer and the last
    assert sum(is_row_norm(m) for m in backbone.modules()) == 5
    with torch.no_grad():
        after = backbone(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert backbone.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in backbone.state_dict().items())
    without_row_kernel(backbone)
    assert {type(m) for m in backbone.modules() if type(m).__name__.endswith("RMSNorm")} == kinds
    with row_kernel_during(backbone):
        assert sum(is_row_norm(m) for m in backbone.modules()) == 5
    assert not any(is_row_norm(m) for m in backbone.modules())
    assert norms_for("cpu", torch.float32) == "row kernel" and norms_for("cuda", torch.float32) == "torch"
