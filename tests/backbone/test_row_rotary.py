"""The rotary embedding on the row kernel (``medusa_train/backbone/row_rotary.py``): bitwise transformers'.

What it must hold: bitwise transformers' Llama ``apply_rotary_pos_emb`` in every dtype the kernel takes, for a step's
head-transposed rows and contiguous ones, one or several batch rows, cos and sin for each batch row or one for all; the
calls it does not take (autograd, mixed dtypes, another layout) left to transformers'; ``use_row_kernel`` switching a
family's function only where it computes the same, a backbone's outputs bitwise unchanged, autograd through it
unchanged, and ``without_row_kernel`` restoring transformers' own.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers.backbones import make_tiny_backbone
from transformers.models.llama import modeling_llama

from medusa_train.backbone.native import cpu_isa
from medusa_train.backbone.row_layers import use_row_kernel, without_row_kernel
from medusa_train.backbone.row_rotary import (
    NAME,
    _computes_as_the_kernel,
    step_rotary,
    switch_back,
    switch_rotary,
    switched_modules,
)
from medusa_train.backbone.rows import row_dtypes

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(cpu_isa() is None or shutil.which("c++") is None,
                       reason="the row kernel is built for AVX2/AVX-512 CPUs with a C++ compiler"),
]


def _transformers():
    """transformers' own Llama function, whether or not an earlier test switched the module."""
    function = getattr(modeling_llama, NAME)
    return getattr(function, "step_rotary_of", function)


def _inputs(dtype, batch, tokens, dim, cos_batch, transposed=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    if transposed:  # as transformers' attention makes them: (batch, tokens, heads, dim) viewed head first
        q = (4 * torch.randn(batch, tokens, 9, dim, generator=g)).to(dtype).transpose(1, 2)
        k = (4 * torch.randn(batch, tokens, 3, dim, generator=g)).to(dtype).transpose(1, 2)
    else:
        q = (4 * torch.randn(batch, 9, tokens, dim, generator=g)).to(dtype)
        k = (4 * torch.randn(batch, 3, tokens, dim, generator=g)).to(dtype)
    positions = torch.arange(tokens, dtype=torch.float32)[None, :, None] + 300 * torch.rand(cos_batch, 1, 1, generator=g)
    frequencies = 10000.0 ** -(torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.cat([positions * frequencies, positions * frequencies], -1)
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


def _dtypes():
    return [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("batch, tokens, dim, cos_batch, transposed", [
    (1, 1, 64, 1, True), (1, 16, 64, 1, True), (1, 64, 64, 1, True), (2, 7, 128, 2, True), (3, 5, 32, 1, True),
    (1, 3, 80, 1, False), (2, 4, 64, 2, False), (1, 2, 6, 1, True),
])
def test_the_kernels_rotary_embedding_is_bitwise_transformers(dtype, batch, tokens, dim, cos_batch, transposed):
    if dtype not in row_dtypes():
        pytest.skip(f"the row kernel does not take {dtype} here")
    q, k, cos, sin = _inputs(dtype, batch, tokens, dim, cos_batch, transposed, seed=tokens * dim)
    with torch.no_grad():
        theirs = _transformers()(q, k, cos, sin)
        ours = step_rotary(q, k, cos, sin)
    assert ours is not None
    for t, o in zip(theirs, ours):
        assert o.dtype == t.dtype and o.shape == t.shape
        assert torch.equal(o, t)  # bitwise, every element: each product and sum rounded as torch rounds it
    assert ours[0].stride() == q.stride() and ours[1].stride() == k.stride()  # the input's layout kept


def test_extreme_values_round_as_torch_rounds():
    dtypes = [d for d in _dtypes() if d in row_dtypes()]
    for dtype in dtypes:
        q, k, cos, sin = _inputs(dtype, 1, 8, 64, 1, seed=3)
        info = torch.finfo(dtype)
        q[0, 0, 0, :4] = torch.tensor([info.max, -info.max, info.tiny, 0.0], dtype=dtype)  # overflow to inf, subnormals
        k[0, 0, 1, :3] = torch.tensor([-0.0, info.max, 1e-30], dtype=dtype)
        with torch.no_grad():
            theirs, ours = _transformers()(q, k, cos, sin), step_rotary(q, k, cos, sin)
        for t, o in zip(theirs, ours):
            assert torch.equal(o, t)


def test_calls_it_does_not_take_are_left_to_transformers():
    q, k, cos, sin = _inputs(torch.float32, 1, 4, 64, 1)
    assert step_rotary(q, k, cos, sin, unsqueeze_dim=2) is None
    assert step_rotary(q, k, cos.double(), sin.double()) is None  # mixed dtypes: torch promotes, the kernel does not
    assert step_rotary(q, k, cos[..., :32], sin[..., :32]) is None  # a partial rotary's cos
    assert step_rotary(q[..., ::2], k[..., ::2], cos[..., :32], sin[..., :32]) is None  # strided head dim
    trained = q.clone().requires_grad_(True)
    assert step_rotary(trained, k, cos, sin) is None  # autograd: transformers' ops
    with torch.no_grad():
        assert step_rotary(trained, k, cos, sin) is not None


def test_a_function_of_another_formula_or_other_arguments_is_not_switched():
    def interleaved(q, k, cos, sin, unsqueeze_dim=1):  # GPT-J's pairs (x0, x1), (x2, x3), ...: another formula
        def rotate(x):
            return torch.stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin

    def with_positions(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return _transformers()(q, k, cos, sin, unsqueeze_dim)

    assert _computes_as_the_kernel(_transformers())
    assert not _computes_as_the_kernel(interleaved)
    assert not _computes_as_the_kernel(with_positions)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_switched_familys_backbone_is_bitwise_unchanged_and_without_row_kernel_restores_transformers(arch):
    backbone = make_tiny_backbone(arch, layers=2)
    module = type(backbone.model.layers[0].self_attn).__module__
    switch_back()
    own = getattr(__import__(module, fromlist=[NAME]), NAME)
    ids = torch.randint(3, 200, (1, 9), generator=torch.Generator().manual_seed(2))

    def prefill_and_step():
        with torch.no_grad():
            out = backbone(ids, use_cache=True)
            return out.logits, backbone(ids[:, -1:] + 1, past_key_values=out.past_key_values).logits

    before = prefill_and_step()
    assert switch_rotary(backbone) == 1 and module in switched_modules()
    after = prefill_and_step()
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    switch_back()
    count, message = use_row_kernel(backbone)  # the linears and norms too (the norms round otherwise: not compared)
    assert count > 0 and "and the rotary embedding" in message and module in switched_modules()
    without_row_kernel(backbone)
    assert module not in switched_modules() and getattr(__import__(module, fromlist=[NAME]), NAME) is own


def test_autograd_through_a_switched_family_is_transformers():
    backbone = make_tiny_backbone("llama", layers=1)
    ids = torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(4))
    backbone.requires_grad_(True).train()
    switch_back()
    backbone(ids).logits.square().mean().backward()
    own = {n: p.grad.clone() for n, p in backbone.named_parameters()}
    backbone.zero_grad()
    assert switch_rotary(backbone) == 1
    backbone(ids).logits.square().mean().backward()
    assert all(torch.equal(p.grad, own[n]) for n, p in backbone.named_parameters())
    switch_back()
