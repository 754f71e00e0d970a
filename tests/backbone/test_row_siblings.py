"""Sibling layers on the row kernel (``medusa_train/backbone/row_siblings.py``): one call for the layers that read one
input, each layer's output bitwise what it is alone.

What it must hold: a backbone's prefill, 1-token and 16-token steps bitwise the same with and without sets (float32 and
bfloat16, with and without biases); a member called with another input, or with the same tensor written since, or
after its weight changed, computing its own output; calls the kernel does not take (autograd, a prefill's rows) left to
the layer; copies holding no set until switched; ``without_row_kernel`` letting every set go.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from helpers.backbones import make_tiny_backbone

from medusa_train.backbone.native import cpu_isa
from medusa_train.backbone.row_layers import use_row_kernel, without_row_kernel
from medusa_train.backbone.row_siblings import group_siblings
from medusa_train.backbone.rows import SIBLINGS, row_dtypes, row_range, rows_linear

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(cpu_isa() is None or shutil.which("c++") is None,
                       reason="the row kernel is built for AVX2/AVX-512 CPUs with a C++ compiler"),
]


def _sets(model) -> list:
    return [m.__dict__[SIBLINGS] for m in model.modules() if m.__dict__.get(SIBLINGS, (None,))[0] is not None]


def _steps(backbone, ids):
    """A prefill's logits, then a 1-token and a 16-token step's over it."""
    with torch.no_grad():
        out = backbone(ids, use_cache=True)
        one = backbone(ids[:, -1:] + 1, past_key_values=out.past_key_values).logits
        out = backbone(ids, use_cache=True)
        sixteen = backbone(ids[:, -16:] + 2, past_key_values=out.past_key_values).logits
    return out.logits, one, sixteen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biased query, key and value projections
def test_a_backbones_steps_are_bitwise_the_same_with_and_without_sets(arch, dtype):
    if dtype not in row_dtypes():
        pytest.skip(f"the row kernel does not take {dtype} here")
    backbone = make_tiny_backbone(arch, layers=2, hidden_size=96).to(dtype)
    ids = torch.randint(3, 200, (1, 20), generator=torch.Generator().manual_seed(1))
    count, message = use_row_kernel(backbone)
    assert "10 in sets reading one input" in message  # q, k, v and gate, up in each of 2 layers
    assert len({id(s[0]) for s in _sets(backbone)}) == 4
    together = _steps(backbone, ids)
    for layer in backbone.modules():
        layer.__dict__.pop(SIBLINGS, None)
    alone = _steps(backbone, ids)
    assert all(torch.equal(a, b) for a, b in zip(together, alone))


def _attention(dtype=torch.float32):
    backbone = make_tiny_backbone("qwen2", layers=1, hidden_size=64).to(dtype)
    use_row_kernel(backbone)
    return backbone.model.layers[0].self_attn


def _own(layer, x):
    return rows_linear(x.reshape(-1, x.shape[-1]), layer.weight, bias=layer.bias).reshape(*x.shape[:-1], -1)


def test_a_member_called_with_another_input_or_a_written_one_computes_its_own():
    attention = _attention()
    g = torch.Generator().manual_seed(2)
    x, other = torch.randn(1, 3, 64, generator=g), torch.randn(1, 3, 64, generator=g)
    with torch.no_grad():
        attention.q_proj(x)
        assert torch.equal(attention.k_proj(other), _own(attention.k_proj, other))  # not x's columns
        attention.q_proj(x)
        x.mul_(2)  # written after the set's call: its version counter moved
        assert torch.equal(attention.v_proj(x), _own(attention.v_proj, x))
        assert torch.equal(attention.q_proj(x), _own(attention.q_proj, x))
        assert torch.equal(attention.k_proj(x), _own(attention.k_proj, x))  # from q's call, the same tensor unchanged


def test_a_members_weight_written_or_replaced_is_packed_again():
    attention = _attention()
    x = torch.randn(1, 2, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        attention.q_proj(x)
        attention.k_proj.weight.add_(1.0)  # in place
        assert torch.equal(attention.q_proj(x), _own(attention.q_proj, x))
        assert torch.equal(attention.k_proj(x), _own(attention.k_proj, x))
        attention.v_proj.weight = torch.nn.Parameter(torch.randn(attention.v_proj.weight.shape), requires_grad=False)
        assert torch.equal(attention.q_proj(x), _own(attention.q_proj, x))
        assert torch.equal(attention.v_proj(x), _own(attention.v_proj, x))


def test_calls_the_kernel_does_not_take_are_each_layers_own():
    attention = _attention()
    g = torch.Generator().manual_seed(4)
    many = torch.randn(1, row_range(torch.float32)[1] + 1, 64, generator=g)  # a prefill's rows
    with torch.no_grad():
        assert torch.equal(attention.k_proj(many), torch.nn.functional.linear(many, attention.k_proj.weight,
                                                                              attention.k_proj.bias))
    trained = torch.randn(1, 2, 64, generator=g, requires_grad=True)
    attention.k_proj(trained).sum().backward()  # autograd: F.linear's, gradients flow
    assert trained.grad is not None and trained.grad.abs().sum() > 0


def test_a_copy_holds_no_set_until_switched_and_without_row_kernel_lets_every_set_go():
    backbone = make_tiny_backbone("llama", layers=2)
    use_row_kernel(backbone)
    copied = copy.deepcopy(backbone)
    assert _sets(copied) == [] and len(_sets(backbone)) == 10
    assert group_siblings(copied) == 10 and len(_sets(copied)) == 10
    ids = torch.randint(3, 200, (1, 9), generator=torch.Generator().manual_seed(5))
    assert all(torch.equal(a, b) for a, b in zip(_steps(copied, ids), _steps(backbone, ids)))
    without_row_kernel(backbone)
    assert not any(SIBLINGS in m.__dict__ for m in backbone.modules())
