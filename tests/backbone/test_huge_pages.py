"""Packed weights in 2 MB pages (``medusa_train/backbone/huge_pages.py``).

What it must hold: a tensor from ``empty`` is contiguous, of its shape and dtype, 64-byte aligned, and holds what is
written to it while any tensor from its mapping lives (its mapping is not freed under it); where Linux offers huge
pages, the mapping is in them (``AnonHugePages`` grows by its size); switched off, or of zero bytes, it is
``torch.empty``'s; a packed weight in them is bitwise the weight ``pack_weight`` made before (the kernel reads the
same values), and the row kernel's product from it is the same as from torch's memory.
"""

from __future__ import annotations

import gc
import shutil

import pytest
import torch

from medusa_train.backbone import huge_pages
from medusa_train.backbone.native import cpu_isa

needs_huge_pages = pytest.mark.skipif(not huge_pages.possible(),
                                      reason=f"transparent huge pages here: {huge_pages.transparent_huge_pages()}")


def test_tensors_are_aligned_contiguous_and_keep_their_values():
    made = [huge_pages.empty((n, 7), dtype) for n, dtype in
            [(3, torch.float32), (5, torch.bfloat16), (1, torch.int64), (1000, torch.float32)]]
    for i, t in enumerate(made):
        assert t.is_contiguous() and t.device.type == "cpu"
        assert t.data_ptr() % huge_pages.ALIGN == 0
        t.copy_(torch.arange(t.numel()).reshape(t.shape).to(t.dtype) + i)
    assert [t.shape for t in made] == [(3, 7), (5, 7), (1, 7), (1000, 7)]
    kept = made[1]
    del made
    gc.collect()
    for _ in range(50):  # later tensors never land on a live one's bytes
        huge_pages.empty((4096,), torch.float32).fill_(-1.0)
    assert torch.equal(kept, (torch.arange(35).reshape(5, 7) + 1).to(torch.bfloat16))


@needs_huge_pages
def test_a_large_tensor_lives_in_huge_pages():
    before = huge_pages.mapped_bytes()
    big = huge_pages.empty((huge_pages.BLOCK // 4 + 1,), torch.float32)  # larger than a block: a mapping of its own
    big.fill_(1.0)  # touched: Linux places its pages now
    assert huge_pages.mapped_bytes() - before >= huge_pages.BLOCK // 2
    assert float(big.sum()) == big.numel()


def test_switched_off_or_empty_it_is_torchs(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV_SWITCH, "0")
    assert not huge_pages.possible()
    t = huge_pages.empty((2, 3), torch.float32)
    # torch's own memory is resizable; a piece of a mapping (torch.frombuffer) is not
    assert t.shape == (2, 3) and t.dtype == torch.float32 and t.untyped_storage().resizable()
    monkeypatch.delenv(huge_pages.ENV_SWITCH)
    empty = huge_pages.empty((0, 5), torch.bfloat16)
    assert empty.shape == (0, 5) and empty.untyped_storage().resizable()
    if huge_pages.possible():  # switched on, the same call takes a mapping
        assert not huge_pages.empty((2, 3), torch.float32).untyped_storage().resizable()


@pytest.mark.skipif(cpu_isa() is None or shutil.which("c++") is None, reason="the row kernel needs AVX2/AVX-512 and c++")
def test_packed_weights_in_huge_pages_are_the_same_weights(monkeypatch):
    from medusa_train.backbone.rows import _rows_linear, pack_weight, row_dtypes

    g = torch.Generator().manual_seed(0)
    for dtype in sorted(row_dtypes(), key=str):
        w = torch.randn(100, 64, generator=g).to(dtype)
        x = torch.randn(5, 64, generator=g).to(dtype)
        monkeypatch.setenv(huge_pages.ENV_SWITCH, "0")
        plain = pack_weight(w)
        monkeypatch.delenv(huge_pages.ENV_SWITCH)
        huge = pack_weight(w)
        assert torch.equal(huge, plain) and huge.is_contiguous()
        assert torch.equal(_rows_linear(x, huge, 100), _rows_linear(x, plain, 100))
