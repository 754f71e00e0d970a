"""The step attention (``medusa_train/backbone/step_attention.py``): a decoding step's query rows over a CPU cache.

What it must hold: the attention itself (against float64 arithmetic on the same inputs); each row bitwise the same
alone, beside other rows, over any number of threads, and with masked-out keys between its own (a tree node against
the same token in a plain step); masks boolean or additive alike; the AVX2 build as the AVX-512 one; calls it does not
take left to SDPA; and what it is for: greedy tree decoding in bfloat16 token for token plain greedy decoding, which
SDPA's paths do not give.
"""

from __future__ import annotations

import shutil
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from helpers.backbones import make_tiny_backbone
from helpers.decoding import hf_greedy, install_oracle_heads, prompts
from transformers import AttentionInterface

from medusa_train import MedusaModel
from medusa_train.backbone import native
from medusa_train.backbone import step_attention as step
from medusa_train.backbone.attention import attention_for, head_dim_of, use_grouped_attention
from medusa_train.backbone.native import cpu_isa
from medusa_train.backbone.row_layers import use_row_kernel
from medusa_train.backbone.rows import row_dtypes
from medusa_train.decoding import TokenTree, tree_generate

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(cpu_isa() is None or shutil.which("c++") is None,
                       reason="the step attention is built for AVX2/AVX-512 CPUs with a C++ compiler"),
]


@pytest.fixture(scope="module")
def kernel():
    built = step.step_kernel()
    assert not isinstance(built, str), built
    return built


def _inputs(heads: int, key_heads: int, queries: int, keys: int, dim: int, dtype, seed: int = 0):
    """A query as transformers hands it over (a transposed view of (1, queries, heads, dim)), and keys and values
    as a cache's first ``keys`` of a longer buffer (each head's block contiguous, the heads ``keys + 5`` apart)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, queries, heads, dim, generator=g).to(dtype).transpose(1, 2)
    k, v = (torch.randn(1, key_heads, keys + 5, dim, generator=g).to(dtype)[:, :, :keys] for _ in range(2))
    return q, k, v


def _exact(q, k, v, mask=None) -> torch.Tensor:
    """The attention in float64 over the same inputs, (1, queries, heads, dim)."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                          enable_gqa=q.shape[1] != k.shape[1]).transpose(1, 2)


def _tree_mask(queries: int, keys: int, dtype) -> torch.Tensor:
    """An additive mask as a verify step's: the cache seen by all, each node's own chain of ancestors (here: every
    other node before it, a gap between), what lies after it hidden (``finfo.min``)."""
    mask = torch.zeros(1, 1, queries, keys, dtype=dtype)
    past = keys - queries
    for i in range(queries):
        for j in range(queries):
            if j > i or (i - j) % 2:
                mask[0, 0, i, past + j] = torch.finfo(dtype).min
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, key_heads, dim", [(9, 3, 64), (4, 4, 128), (8, 1, 32), (6, 2, 80)])
@pytest.mark.parametrize("queries, keys", [(1, 1), (1, 200), (5, 17), (12, 140), (64, 70)])
def test_the_step_attention_is_the_attention(kernel, dtype, heads, key_heads, dim, queries, keys):
    q, k, v = _inputs(heads, key_heads, queries, keys, dim, dtype, seed=queries + keys)
    masks = [None] if queries == 1 else [_tree_mask(queries, keys, dtype)]
    if queries > 1:
        masks.append(masks[0] == 0)  # the same mask as booleans (True: attend)
    tolerance = dict(rtol=1e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -8)
    for mask in masks:
        got = step.attend(kernel, q, k, v, mask, dim ** -0.5)
        assert got is not None and got.dtype == dtype and got.shape == (1, queries, heads, dim) and got.is_contiguous()
        exact = _exact(q, k, v, None if mask is None else (mask == 0 if mask.dtype != torch.bool else mask))
        torch.testing.assert_close(got.double(), exact, **tolerance)
        if dtype == torch.bfloat16:  # rounded once: within half a bf16 step of the float64 value
            assert torch.equal(got, exact.to(torch.bfloat16)) or (got.double() - exact).abs().max() <= \
                exact.abs().max() * 2 ** -8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_bitwise_the_same_alone_beside_others_and_over_any_threads(kernel, dtype):
    q, k, v = _inputs(9, 3, 16, 150, 64, dtype, seed=3)
    mask = torch.zeros(1, 1, 16, 150, dtype=torch.float32)
    together = step.attend(kernel, q, k, v, mask, 0.125)
    for i, n in [(0, 1), (5, 1), (2, 3), (7, 9)]:
        alone = step.attend(kernel, q[:, :, i:i + n], k, v, mask[:, :, i:i + n], 0.125)
        assert torch.equal(alone, together[:, i:i + n])
    for h in range(9):  # one head alone (its key head alone beside it)
        alone = step.attend(kernel, q[:, h:h + 1], k[:, h // 3: h // 3 + 1], v[:, h // 3: h // 3 + 1], mask, 0.125)
        assert torch.equal(alone[:, :, 0], together[:, :, h])
    torch.set_num_threads(2)
    try:
        assert torch.equal(step.attend(kernel, q, k, v, mask, 0.125), together)
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("boolean", [False, True])
def test_masked_out_keys_between_a_rows_own_change_nothing(kernel, dtype, boolean):
    """A tree node sees the cache and its ancestors, with its siblings' keys masked out between them: it attends
    bitwise as the same token attends in a plain step, whose cache holds its ancestors alone, in order."""
    q, k, v = _inputs(9, 3, 6, 60, 64, dtype, seed=5)
    seen = [0, 1, 2, 7, 19, 20, 33, 58, 59]
    mask = torch.full((1, 1, 6, 60), torch.finfo(torch.float32).min)
    mask[..., seen] = 0
    if boolean:
        mask = mask == 0
    gapped = step.attend(kernel, q, k, v, mask, 0.125)
    plain = step.attend(kernel, q, k[:, :, seen].contiguous(), v[:, :, seen].contiguous(), None, 0.125)
    assert torch.equal(gapped, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_steps_mask_is_widened_once_and_read_anew_once_written(kernel, dtype):
    """Every layer of a step gets the same mask tensor: its rows are taken once (a bf16 mask widened) and read by the
    other layers; a mask written in place since (a static cache's step mask is filled anew each step) is read anew,
    as is another mask, or the same one over fewer keys."""
    q, k, v = _inputs(9, 3, 6, 60, 64, dtype, seed=7)
    mask = torch.zeros(1, 1, 6, 64, dtype=dtype)
    rows = step._mask_rows(mask, 60)
    assert step._mask_rows(mask, 60) is rows and step._mask_rows(mask, 50) is not rows
    first = step.attend(kernel, q, k, v, mask, 0.125)
    assert torch.equal(step.attend(kernel, q, k, v, mask, 0.125), first)
    mask[..., 10:40] = torch.finfo(dtype).min  # written in place: the next step's mask in the same buffer
    written = step.attend(kernel, q, k, v, mask, 0.125)
    assert not torch.equal(written, first)
    assert torch.equal(written, step.attend(kernel, q, k, v, mask.clone(), 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_is_not_hidden(kernel, dtype):
    """A NaN in a query or a key makes the rows that read it NaN, as SDPA's do: not a weight of zero, not a row
    quietly attending the rest."""
    q, k, v = _inputs(4, 2, 3, 20, 64, dtype, seed=9)
    q = q.clone()
    q[0, 1, 2, 5] = float("nan")  # query 2 of head 1
    out = step.attend(kernel, q, k, v, None, 0.125)
    assert out[0, 2, 1].isnan().all() and not out[0, :2].isnan().any() and not out[0, 2, [0, 2, 3]].isnan().any()
    k = k.clone()
    k[0, 1, 7, 3] = float("nan")  # a key of key head 1: heads 2 and 3 read it
    out = step.attend(kernel, q.nan_to_num(), k, v, torch.zeros(1, 1, 3, 20), 0.125)
    assert out[0, :, 2:].isnan().all() and not out[0, :, :2].isnan().any()


def test_calls_it_does_not_take_are_left_to_sdpa(kernel):
    q, k, v = _inputs(4, 2, 3, 20, 64, torch.float32)
    assert step.step_attention(q[:, :, :1], k, v, None, 0.125) is not None  # a plain step's one query
    # several: the AVX-512 build takes them; on an AVX2 build SDPA's grouped path does (it verifies them cheaper)
    assert (step.step_attention(q, k, v, None, 0.125) is not None) == (kernel.lanes >= step.AVX512_LANES)
    assert step.attend(kernel, q, k, v, None, 0.125) is not None  # the build itself takes them either way
    for call in (step.step_attention, partial(step.attend, kernel)):
        assert call(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), None,
                    0.125) is None  # a batch
        assert call(q.half(), k.half(), v.half(), None, 0.125) is None  # float16
        assert call(*_inputs(4, 2, 1, 20, 48, torch.float32), None, 0.125) is None  # a head size not built
        assert call(*_inputs(4, 2, 65, 80, 64, torch.float32), None, 0.125) is None  # a prefill's queries
        assert call(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, None, 0.125) is None  # keys' layout
        assert call(q, k, v, torch.zeros(1, 4, 3, 20), 0.125) is None  # a mask per head


def test_a_switched_off_kernel_is_not_built(monkeypatch):
    monkeypatch.setenv("MEDUSA_TRAIN_STEP_ATTENTION", "0")
    step.step_kernel.cache_clear()
    try:
        assert step.step_kernel() == "off (MEDUSA_TRAIN_STEP_ATTENTION=0)"
        assert step.step_attention(*_inputs(4, 2, 1, 20, 64, torch.float32), None, 0.125) is None
    finally:
        monkeypatch.undo()
        step.step_kernel.cache_clear()


@pytest.mark.skipif(cpu_isa() != "AVX512", reason="on an AVX2 CPU the tests above run the AVX2 build itself")
def test_the_avx2_build_holds_the_same_on_an_avx512_cpu(kernel, monkeypatch):
    """The AVX2 build attends a plain step's query as the AVX-512 one does, and leaves several queries to SDPA (on one
    thread its multi-query steps cost more than SDPA's grouped path)."""
    avx2 = native.build("step_attention", step.SOURCE, "AVX2", native.ISA_FLAGS["AVX2"])
    assert not isinstance(avx2, str), avx2
    assert avx2.lanes == 8
    monkeypatch.setattr(step, "step_kernel", lambda: avx2)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = _inputs(9, 3, 12, 90, 64, dtype, seed=7)
        mask = _tree_mask(12, 90, dtype)
        assert step.step_attention(q, k, v, mask, 0.125) is None
        tolerance = dict(rtol=1e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -8)
        for row in (0, 4, 11):
            alone = step.step_attention(q[:, :, row:row + 1], k, v, mask[:, :, row:row + 1], 0.125)
            torch.testing.assert_close(alone.double(), _exact(q[:, :, row:row + 1], k, v, mask[:, :, row:row + 1] == 0),
                                       **tolerance)
        together = step.attend(avx2, q, k, v, mask, 0.125)  # the build itself still takes several rows, each alike
        torch.testing.assert_close(together.double(), _exact(q, k, v, mask == 0), **tolerance)
        assert torch.equal(step.step_attention(q[:, :, 4:5], k, v, mask[:, :, 4:5], 0.125), together[:, 4:5])


def test_the_label_names_the_steps_the_kernel_takes(kernel, registered, monkeypatch):
    """A cached reply's key and a report name what ran: the kernel for every step, for one token (an AVX2 build), or
    SDPA's paths (a head dimension the kernel was not built for)."""
    use_grouped_attention()
    assert attention_for("cpu", torch.float32, 64) == ("sdpa, CPU steps: step attention, rows alone in float32, a key to a lane"
                                                       if cpu_isa() == "AVX512" else
                                                       "sdpa, CPU steps: step attention for 1 token, grouped for more")
    assert 48 not in step.step_kernel().head_dims
    assert attention_for("cpu", torch.bfloat16, 48) == "sdpa, CPU steps: grouped, 1 token in float32"
    assert head_dim_of(make_tiny_backbone("llama", hidden_size=128)) == 32
    if cpu_isa() == "AVX512":
        avx2 = native.build("step_attention", step.SOURCE, "AVX2", native.ISA_FLAGS["AVX2"])
        monkeypatch.setattr(step, "step_kernel", lambda: avx2)
        assert attention_for("cpu", torch.float32, 64) == "sdpa, CPU steps: step attention for 1 token, grouped for more"


@pytest.fixture
def registered():
    """Whatever ``sdpa`` was before the test is what it is after."""
    before = AttentionInterface._global_mapping["sdpa"]
    yield
    AttentionInterface.register("sdpa", before)


@pytest.mark.skipif(cpu_isa() is None or torch.bfloat16 not in row_dtypes(),
                    reason="bf16 linears whose rows sum alike in any step: the row kernel's, on AVX512-BF16 CPUs")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_tree_decoding_is_plain_greedy_token_for_token(kernel, registered, arch):
    """What the kernel is for: in bfloat16 a verify step's node attends as a plain step's token, so with the row
    kernel's linears (each row summed alike in any step) our decoder's greedy text is HF ``generate``'s, every token.
    SDPA's paths round a verify step otherwise than a plain one and part ways within these replies (checked below:
    the test can fail)."""
    backbone = make_tiny_backbone(arch, seed=4, hidden_size=128).to(torch.bfloat16)  # 4 heads of 32
    model = MedusaModel.from_backbone(backbone, num_heads=4).to(torch.bfloat16).eval()
    assert use_row_kernel(model)[0] > 0
    use_grouped_attention()
    assert attention_for("cpu", torch.bfloat16) == "sdpa, CPU steps: step attention, rows alone in float32, a key to a lane"

    def decode_all() -> tuple[int, int]:
        same = longest = 0
        for ids in prompts(6, seed=11):
            reference = hf_greedy(backbone, ids, 40, eos_token_id=[])
            install_oracle_heads(model, reference)  # long accepted paths: many-node verifies
            out = tree_generate(model, ids, TokenTree.from_name("default"), max_new_tokens=40, eos_token_id=[])
            same += out.sequences.tolist() == reference.tolist()
            longest = max(longest, max(out.accept_lengths))
        return same, longest

    same, longest = decode_all()
    assert same == 6 and longest >= 3
    use_grouped_attention(step_kernel=False)  # SDPA's paths instead
    assert attention_for("cpu", torch.bfloat16) == "sdpa, CPU steps: grouped, 1 token in float32"
    assert decode_all()[0] < 6
