"""The row kernel (``medusa_train/backbone/rows.py``): a decoding step's float32 (and bfloat16) CPU linears.

What it must hold: the product of ``F.linear`` to float32 accuracy on any shape (tails of K, N and rows
included); each row's output bitwise the same whatever rows sit beside it (every verify a row is part of agrees); every other
call (a float32 1-token step on Intel, autograd, bfloat16 with a bias, a prefill's many rows) exactly ``F.linear``'s; greedy
decoding unchanged; a model's weights and state dict untouched. Where the CPU has AVX512-BF16, bfloat16
rows too: the float32 sum of their exact products rounded once, and bitwise the same beside any other rows; where it
has AMX as well, bfloat16 rows on its tiles: the same accuracy and bitwise the same beside any other rows.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers.backbones import make_tiny_backbone
from helpers.decoding import hf_greedy, install_oracle_heads, prompts

from medusa_train import MedusaModel
from medusa_train.backbone.native import cpu_flags, cpu_isa
from medusa_train.backbone.row_layers import (
    linear_path,
    row_kernel_during,
    use_row_kernel,
    without_row_kernel,
)
from medusa_train.backbone.rows import (
    MAX_ROWS,
    MAX_ROWS_BF16,
    MIN_ROWS,
    MIN_ROWS_BF16,
    MIN_ROWS_HUGE_PAGES,
    RowLinear,
    amx_possible,  # noqa: F401 (the AMX test's skipif condition)
    linears_for,
    pack_weight,
    row_dtypes,
    row_kernel,
    row_range,
    rows_linear,
)
from medusa_train.decoding import TokenTree, tree_generate

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(cpu_isa() is None or shutil.which("c++") is None,
                       reason="the row kernel is built for AVX2/AVX-512 CPUs with a C++ compiler"),
]


@pytest.fixture(scope="module")
def kernel():
    built = row_kernel()
    assert not isinstance(built, str), built  # a compiler is here: the kernel must build
    return built


SHAPES = [(1536, 576), (49, 64), (7, 13), (33, 100), (5, 3), (1, 17)]  # (N out, K in): K and N tails too


@pytest.mark.parametrize("n, k", SHAPES)
def test_the_product_to_float32_accuracy(kernel, n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(64, k, generator=g)  # the kernel takes any rows
    exact = (x.double() @ w.double().T)
    for rows in (1, 2, 3, 5, 7, 16, 64):
        got = rows_linear(x[:rows], w)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), exact[:rows], rtol=1e-5, atol=1e-5 * k ** 0.5)


@pytest.mark.parametrize("n, k", SHAPES)
def test_a_rows_output_is_bitwise_the_same_beside_any_other_rows(kernel, n, k):
    g = torch.Generator().manual_seed(k)
    w, x = torch.randn(n, k, generator=g), torch.randn(64, k, generator=g)
    together = rows_linear(x, w)
    for start, rows in [(0, 1), (5, 1), (0, 2), (3, 4), (9, 7), (16, 16), (1, 63)]:
        alone = rows_linear(x[start:start + rows], w)
        assert torch.equal(alone, together[start:start + rows]), (start, rows)
    torch.set_num_threads(2)  # and whatever the number of threads
    try:
        assert torch.equal(rows_linear(x, w), together)
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("n, k", [(100, 300), (24, 1536)])
def test_rows_past_one_sweep_and_k_past_several_blocks(kernel, n, k):
    """The kernel reads a panel in blocks of 128 steps along K, parking each row's sums between blocks, 64 rows a
    sweep: 130 rows take three sweeps, K = 300 and 1,536 three and twelve blocks (a tail in the first). Each row as
    alone, and the product to float32 accuracy."""
    g = torch.Generator().manual_seed(n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(130, k, generator=g)
    together = rows_linear(x, w)
    torch.testing.assert_close(together.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5 * k ** 0.5)
    for start, rows in [(0, 1), (64, 1), (129, 1), (60, 8), (0, 64), (1, 128)]:
        assert torch.equal(rows_linear(x[start:start + rows], w), together[start:start + rows]), (start, rows)


def test_no_inputs_give_the_bias(kernel):
    """K = 0: no block to sum, so each output is its bias (zeros without one), as ``F.linear`` gives."""
    w, x, bias = torch.empty(40, 0), torch.empty(3, 0), torch.arange(40.0)
    assert torch.equal(rows_linear(x, w), torch.zeros(3, 40))
    assert torch.equal(rows_linear(x, w, bias=bias), bias.expand(3, 40))


def test_other_calls_are_exactly_torchs(kernel):
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(24, 40, bias=True)
    reference = torch.nn.Linear(24, 40, bias=True)
    reference.load_state_dict(layer.state_dict())
    layer.__class__ = RowLinear
    fewest, most = row_range()
    assert (fewest, most) in [(MIN_ROWS[cpu_isa()], MAX_ROWS), (MIN_ROWS_HUGE_PAGES, MAX_ROWS)]
    assert row_range(torch.bfloat16) in [(MIN_ROWS_BF16, MAX_ROWS_BF16), (1, MAX_ROWS)]
    many = torch.randn(most + 1, 24, generator=g)  # a prefill's rows
    with torch.no_grad():
        assert torch.equal(layer(many), reference(many))
        one = torch.randn(1, 1, 24, generator=g)  # a plain step: torch's GEMV on an Intel CPU in 4 KB pages, else the kernel's
        assert min(MIN_ROWS.values()) >= 2
        expected = reference(one) if fewest > 1 else rows_linear(one[0], layer.weight)[None] + layer.bias
        assert torch.equal(layer(one), expected)
        half = torch.randn(3, 24, generator=g).bfloat16()
        assert torch.equal(layer.bfloat16()(half), reference.bfloat16()(half))
        layer.float(), reference.float()
        few = torch.randn(2, most // 2, 24, generator=g)  # a verify's rows, batched dims kept; bias added
        torch.testing.assert_close(layer(few), reference(few), rtol=1e-5, atol=1e-5)
        assert layer(few).shape == (2, most // 2, 40)
    x = torch.randn(3, 24, generator=g, requires_grad=True)  # autograd: torch's path, gradients included
    layer(x).sum().backward()
    grad = x.grad.clone()
    x.grad = None
    reference(x).sum().backward()
    assert torch.equal(grad, x.grad) and torch.equal(layer.weight.grad, reference.weight.grad)


def test_switching_keeps_the_models_weights_and_state_dict(kernel):
    model = make_tiny_backbone("llama", seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    count, note = use_row_kernel(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert count == len(linears) > 0 and all(type(m) is RowLinear for m in linears)
    assert f"{count} float32 linear layers" in note and linear_path(model).startswith("row kernel")
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert without_row_kernel(model) == count and linear_path(model) == "torch GEMM"
    # in bfloat16: every (bias-free) layer where the kernel takes bfloat16 here (AVX512-BF16), else none
    assert use_row_kernel(model.bfloat16())[0] == (count if torch.bfloat16 in row_dtypes() else 0)


def test_the_kernel_for_a_block_switches_back_only_what_it_switched(kernel):
    model = make_tiny_backbone("llama", seed=3)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    use_row_kernel(model.model.layers[0])  # switched before: stays switched
    kept = [m for m in linears if type(m) is RowLinear]
    assert 0 < len(kept) < len(linears)
    with row_kernel_during(model) as (count, _):
        assert count == len(linears) - len(kept) and all(type(m) is RowLinear for m in linears)
    assert [m for m in linears if type(m) is RowLinear] == kept
    with pytest.raises(RuntimeError), row_kernel_during(model):  # and after an error too
        raise RuntimeError
    assert [m for m in linears if type(m) is RowLinear] == kept


def test_a_switched_layer_packs_its_weights_again_whenever_they_change(kernel):
    """The packed copy follows the weight: written in place (an optimizer step, ``load_state_dict``) or replaced by
    another tensor, the next step packs again; a switched-back layer holds no copy."""
    from medusa_train.backbone.rows import PACKED

    g = torch.Generator().manual_seed(1)
    layer, x = torch.nn.Linear(24, 40), torch.randn(1, 24, generator=g)
    layer.__class__ = RowLinear
    fewest, _ = row_range()
    x = x.expand(max(fewest, 1), 24).contiguous()

    def expected():
        return rows_linear(x, layer.weight) + layer.bias

    with torch.no_grad():
        assert torch.equal(layer(x), expected())
        first = layer.__dict__[PACKED][2]
        assert torch.equal(layer(x), expected()) and layer.__dict__[PACKED][2] is first  # kept while unchanged
        layer.weight.mul_(2)  # in place
        assert torch.equal(layer(x), expected()) and layer.__dict__[PACKED][2] is not first
        layer.weight = torch.nn.Parameter(torch.randn(40, 24, generator=g))  # another tensor
        assert torch.equal(layer(x), expected())
        layer.load_state_dict({"weight": torch.randn(40, 24, generator=g), "bias": layer.bias.clone()})
        assert torch.equal(layer(x), expected())
        layer.weight.data = torch.randn(40, 24, generator=g)  # other data under the same parameter
        assert torch.equal(layer(x), expected())
    model = torch.nn.Sequential(layer)
    assert without_row_kernel(model) == 1 and PACKED not in layer.__dict__ and type(layer) is torch.nn.Linear
    assert PACKED not in model.state_dict() and all(PACKED not in k for k in model.state_dict())
    stale = 0
    for _ in range(200):  # a dtype round trip: new data under the same parameter at the same version, which the
        layer = torch.nn.Linear(24, 40)  # allocator may put at the freed old data's address (CI failed on that)
        layer.__class__ = RowLinear
        with torch.no_grad():
            layer(x)
            layer.bfloat16().float()
            stale += not torch.equal(layer(x), expected())
    assert stale == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox"])
def test_greedy_decoding_with_the_kernel_is_plain_greedy(kernel, arch):
    """Every decoder row runs the same switched backbone: ours stays token-identical to HF ``generate``, and
    HF ``generate`` gives what it gave before the switch."""
    backbone = make_tiny_backbone(arch, seed=4)
    references = [hf_greedy(backbone, ids, 24, eos_token_id=1) for ids in prompts(3, seed=9)]
    assert use_row_kernel(backbone)[0] > 0
    model = MedusaModel.from_backbone(backbone, num_heads=4)
    for ids, reference in zip(prompts(3, seed=9), references):
        assert hf_greedy(backbone, ids, 24, eos_token_id=1).tolist() == reference.tolist()
        install_oracle_heads(model, reference)  # long accepted paths: 2-16 node verifies through the kernel
        out = tree_generate(model, ids, TokenTree.from_name("default"), max_new_tokens=24, eos_token_id=1)
        assert out.sequences.tolist() == reference.tolist()
        assert max(out.accept_lengths) >= 3


def test_a_switched_off_kernel_switches_nothing(monkeypatch):
    monkeypatch.setenv("MEDUSA_TRAIN_ROW_KERNEL", "0")
    row_kernel.cache_clear()
    try:
        count, note = use_row_kernel(make_tiny_backbone("llama"))
        assert count == 0 and "MEDUSA_TRAIN_ROW_KERNEL=0" in note
    finally:
        row_kernel.cache_clear()


bf16_only = pytest.mark.skipif("torch.bfloat16 not in row_dtypes()",
                               reason="the kernel takes bfloat16 on AVX512-BF16 CPUs")


@bf16_only
@pytest.mark.parametrize("n, k", SHAPES)
def test_bfloat16_rows_are_the_float32_sums_rounded_once(kernel, n, k):
    g = torch.Generator().manual_seed(n + k)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(64, k, generator=g).bfloat16()
    exact = x.double() @ w.double().T  # bf16 products are exact in float32; only the sum's order and one rounding
    together = rows_linear(x, w)
    assert together.dtype == torch.bfloat16 and together.shape == (64, n)
    torch.testing.assert_close(together.double(), exact, rtol=2 ** -8, atol=1e-5 * k ** 0.5)
    for start, rows in [(0, 1), (5, 1), (0, 2), (3, 4), (9, 7), (16, 16), (1, 63)]:
        assert torch.equal(rows_linear(x[start:start + rows], w), together[start:start + rows]), (start, rows)


@pytest.mark.skipif("not amx_possible()", reason="bfloat16 on AMX's tiles: CPUs with AMX-BF16 (Intel's, from Sapphire "
                    "Rapids)")
@pytest.mark.parametrize("n, k", SHAPES + [(100, 64), (3072, 576), (576, 1536)])
def test_bfloat16_rows_on_amx_tiles_sum_alike_at_any_number_of_rows(kernel, n, k):
    """Each row's outputs bitwise the same at 1-64 rows, bias or none, the float32 sums rounded once as the AVX512-BF16
    path's are, but not summed alike (~1 output in 8,000 rounds otherwise), so replies made on one are named apart
    from the other's (``linears_for``); a K that is not a multiple of 32 takes the AVX512-BF16 path itself."""
    assert row_range(torch.bfloat16) == (1, MAX_ROWS)
    assert linears_for("cpu", torch.bfloat16) == "row kernel, AMX tiles" != linears_for("cpu", torch.float32)
    layers = torch.nn.Sequential(torch.nn.Linear(k, n).bfloat16())
    assert use_row_kernel(layers)[0] == 1 and linear_path(layers).startswith("row kernel (AVX512, AMX tiles, 1 layers, packed in ")
    g = torch.Generator().manual_seed(n * 7 + k)
    w, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    x = torch.randn(MAX_ROWS, k, generator=g).bfloat16()
    packed, built = pack_weight(w), row_kernel()
    xp = x if k % 2 == 0 else torch.nn.functional.pad(x, (0, 1))

    def run(path, first, rows, bias):
        y = torch.empty(rows, n, dtype=torch.bfloat16)
        part = xp[first:first + rows].contiguous()
        path(part.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(), rows,
             xp.shape[1], n)
        return y

    for bias in (None, b):
        tiles = run(built.rows_linear_amx, 0, MAX_ROWS, bias)
        for first, rows in [(0, 1), (7, 1), (0, 2), (3, 15), (0, 16), (5, 17), (30, 33)]:
            assert torch.equal(run(built.rows_linear_amx, first, rows, bias), tiles[first:first + rows]), (first, rows)
        exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
        torch.testing.assert_close(tiles.double(), exact, rtol=2 ** -8, atol=1e-5 * k ** 0.5)
        avx512 = run(built.rows_linear_bf16, 0, MAX_ROWS, bias)
        differ = float((tiles != avx512).float().mean())
        assert differ == 0 if k % 32 else differ < 1e-3, differ


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bias_is_added_to_the_float32_sums_before_their_one_rounding(kernel, dtype):
    """float32: bitwise the bias added to the kernel's sums afterwards; bfloat16 (where the kernel takes it): the
    float32 sum plus the bias rounded once, as torch's bf16 linear rounds, and bitwise the same beside other rows."""
    if dtype not in row_dtypes():
        pytest.skip("the kernel takes bfloat16 on AVX512-BF16 CPUs")
    g = torch.Generator().manual_seed(2)
    for n, k in [(40, 24), (7, 13), (1536, 576)]:
        w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
        x = torch.randn(20, k, generator=g).to(dtype)
        got = rows_linear(x, w, bias=b)
        if dtype == torch.float32:
            assert torch.equal(got, rows_linear(x, w) + b)
        else:
            exact = x.double() @ w.double().T + b.double()
            torch.testing.assert_close(got.double(), exact, rtol=2 ** -8, atol=1e-5 * k ** 0.5)
        for start, rows in [(0, 1), (3, 4), (5, 15)]:
            assert torch.equal(rows_linear(x[start:start + rows], w, bias=b), got[start:start + rows])
        strided = torch.stack([b, torch.full_like(b, float("nan"))], dim=1)[:, 0]  # every other element: a copy is read
        assert not strided.is_contiguous() and torch.equal(rows_linear(x, w, bias=strided), got)
    layer = torch.nn.Linear(24, 40, bias=True).to(dtype)
    assert use_row_kernel(torch.nn.Sequential(layer))[0] == 1 and type(layer) is RowLinear
    x = torch.randn(3, 24, generator=g).to(dtype)
    with torch.no_grad():
        assert torch.equal(layer(x), rows_linear(x, layer.weight, bias=layer.bias))
    with pytest.raises(ValueError, match="a bias of shape"):
        rows_linear(x, layer.weight, bias=layer.bias[:5])


def test_a_draft_vocabularys_projection_takes_the_kernel_as_its_lm_head_does(kernel):
    """The heads' projection onto their draft vocabulary (rows of the LM head): the kernel's product where the LM head
    is switched, packed once and kept, torch's where it is not."""
    from medusa_train.backbone.rows import PACKED
    from medusa_train.model.draft_vocab import DraftVocab

    g = torch.Generator().manual_seed(5)
    lm_head = torch.nn.Linear(24, 100, bias=False).requires_grad_(False)  # frozen, as every recipe's
    vocab = DraftVocab(torch.tensor([3, 17, 42, 99, 0, 58]), 100)
    features = torch.randn(row_range()[0] + 1, 24, generator=g)
    with torch.no_grad():
        plain = vocab.project(features, lm_head)
        assert PACKED not in vocab.__dict__
        torch.testing.assert_close(plain, features @ lm_head.weight[vocab.token_map].T)
        lm_head.__class__ = RowLinear
        switched = vocab.project(features, lm_head)
        assert torch.equal(switched, rows_linear(features, lm_head.weight[vocab.token_map]))
        packed = vocab.__dict__[PACKED][2]
        vocab.project(features, lm_head)
        assert vocab.__dict__[PACKED][2] is packed
        lm_head.requires_grad_(True)  # a trainable one: gathered each call, so torch's
        torch.testing.assert_close(vocab.project(features, lm_head), plain)
        assert vocab.__dict__[PACKED][2] is packed


@pytest.mark.skipif("avx512_bf16" not in cpu_flags() or cpu_isa() != "AVX512",
                    reason="only where the build adds AVX512-BF16's flag")
def test_a_compiler_without_the_bf16_flag_still_builds_the_float32_kernel(kernel, monkeypatch):
    from medusa_train.backbone import native, rows

    monkeypatch.setattr(native, "BF16_FLAGS", ["-mno-such-flag-here"])  # what a compiler without it answers
    rows.row_kernel.cache_clear(), rows.row_dtypes.cache_clear()
    try:
        built = rows.row_kernel()
        assert not isinstance(built, str), built
        assert rows.row_dtypes() == frozenset({torch.float32}) and not hasattr(built, "rows_linear_bf16")
    finally:
        monkeypatch.undo()
        rows.row_kernel.cache_clear(), rows.row_dtypes.cache_clear()
    assert torch.bfloat16 in rows.row_dtypes() or not rows.bf16_possible()


@pytest.mark.skipif(not {"amx_tile", "amx_bf16", "avx512_bf16"} <= cpu_flags() or cpu_isa() != "AVX512",
                    reason="only where the build adds AMX's flags")
def test_a_compiler_without_amxs_flags_still_builds_the_bf16_kernel(kernel, monkeypatch):
    from medusa_train.backbone import native, rows

    monkeypatch.setattr(native, "AMX_FLAGS", ["-mno-such-flag-here"])
    caches = (rows.row_kernel, rows.row_dtypes, rows.amx_possible, rows.row_range)
    [c.cache_clear() for c in caches]
    try:
        built = rows.row_kernel()
        assert not isinstance(built, str), built
        assert not hasattr(built, "rows_linear_amx") and not rows.amx_possible()
        assert rows.row_dtypes() == frozenset({torch.float32, torch.bfloat16})
        assert rows.row_range(torch.bfloat16) == (MIN_ROWS_BF16, MAX_ROWS_BF16)  # Intel's without AMX
    finally:
        monkeypatch.undo()
        [c.cache_clear() for c in caches]
    assert rows.amx_possible() and rows.row_range(torch.bfloat16) == (1, MAX_ROWS)  # each cached from the build
    assert torch.bfloat16 in rows.row_dtypes()


@pytest.mark.skipif("not amx_possible()", reason="where bf16 runs on AMX's tiles")
def test_the_tiles_switched_off_leave_bf16_on_the_avx512_bf16_path(kernel, monkeypatch):
    from medusa_train.backbone import rows

    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(1536, 576, generator=g).bfloat16(), torch.randn(64, 576, generator=g).bfloat16()
    packed = pack_weight(w)
    tiles, y = (torch.empty(64, 1536, dtype=torch.bfloat16) for _ in range(2))
    kernel.rows_linear_amx(x.data_ptr(), packed.data_ptr(), 0, tiles.data_ptr(), 64, 576, 1536)
    kernel.rows_linear_bf16(x.data_ptr(), packed.data_ptr(), 0, y.data_ptr(), 64, 576, 1536)
    if torch.equal(tiles, y):  # ~12 of these 98,304 outputs differ on the AMX CPU: which path ran shows in them
        pytest.skip("the two paths sum these inputs alike on this CPU: the switch cannot be told from the outputs")
    monkeypatch.setenv(rows.AMX_SWITCH, "0")
    caches = (rows.amx_possible, rows.row_range)
    [c.cache_clear() for c in caches]
    try:
        assert not rows.amx_possible() and rows.row_range(torch.bfloat16) == (MIN_ROWS_BF16, MAX_ROWS_BF16)
        assert linears_for("cpu", torch.bfloat16) == f"row kernel, panels (AVX512), rows {MIN_ROWS_BF16}-{MAX_ROWS_BF16}"
        assert torch.equal(rows_linear(x, w, packed), y)  # the AVX512-BF16 path's own sums
    finally:
        monkeypatch.undo()
        [c.cache_clear() for c in caches]
    assert rows.amx_possible() and torch.equal(rows_linear(x, w, packed), tiles)  # the tiles again


@pytest.mark.skipif(cpu_isa() != "AVX512", reason="on an AVX2 CPU the tests above run the AVX2 build itself")
def test_the_avx2_build_holds_the_same_on_an_avx512_cpu(kernel, monkeypatch):
    """The AVX2 build has code of its own (24-output panels, 4 rows a group, 12 KB blocks): the product and each row's bitwise invariance, built and run here, where the tests above run AVX-512's."""
    from medusa_train.backbone import rows
    from medusa_train.backbone.native import ISA_FLAGS

    avx2 = rows._build("AVX2", ISA_FLAGS["AVX2"])
    assert not isinstance(avx2, str), avx2
    assert avx2.panel == 24
    monkeypatch.setattr(rows, "row_kernel", lambda: avx2)
    for n, k in [(1536, 576), (49, 64), (33, 100)]:  # several panels a thread, and tails of N and K
        g = torch.Generator().manual_seed(n + k)
        w, x = torch.randn(n, k, generator=g), torch.randn(130, k, generator=g)  # two sweeps and a row
        exact = x.double() @ w.double().T
        together = rows_linear(x, w)
        torch.testing.assert_close(together.double(), exact, rtol=1e-5, atol=1e-5 * k ** 0.5)
        for start, rows_ in [(0, 1), (5, 1), (0, 2), (3, 4), (9, 7), (0, 8), (16, 16), (1, 63), (60, 70)]:
            assert torch.equal(rows_linear(x[start:start + rows_], w), together[start:start + rows_]), (n, k, start)
        torch.set_num_threads(2)
        try:
            assert torch.equal(rows_linear(x, w), together)
        finally:
            torch.set_num_threads(1)
