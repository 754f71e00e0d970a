"""Packed weights in 2 MB pages: a decoding step streams every weight once, and in 4 KB pages it stalls on them.

A CPU decoding step reads each weight once (~270 MB a step for the packaged model in bfloat16). In 4 KB pages that is
~66,000 page translations a step, each a page walk once it has left the TLB (in a virtual machine a two-level one), and
the hardware prefetchers stop at every 4 KB boundary. The AMX CPU (2 cores, a virtual machine) summed a 300 MB float32
buffer at 16.5 GB/s in 4 KB pages and at 28.0 GB/s in 2 MB pages, and its backbone's linears took 0.69x (bf16) and
0.56x (float32) of their 4 KB-page time (``docs/log/2026-12-01-packed-weights-in-huge-pages.md``); one head's 576 x 576
linear, read after a 400 MB write had pushed its translations out, took 477 us where its 0.66 MB take 26 us at the read
rate.

Linux gives an anonymous private mapping 2 MB pages where transparent huge pages are ``always`` or ``madvise`` (the
mapping then asks with ``MADV_HUGEPAGE``). ``empty`` hands out tensors from such mappings: blocks of ``BLOCK`` bytes
(a larger tensor gets a block of its own), 2 MB-aligned, each tensor 64-byte aligned in it. A block lives as long as a
tensor made from it (torch's storage holds the mapping), so nothing is freed early and a block whose tensors are all
gone is unmapped. The row kernel packs its weights here (``rows.pack_weight``): every decoder of the process reads
them, HF ``generate`` included, so a speedup still divides by the best plain decoding on the machine. Elsewhere (no
``MADV_HUGEPAGE``, another OS, a failed mapping, ``MEDUSA_TRAIN_HUGE_PAGES=0``) ``empty`` is ``torch.empty``; the
values are the same either way, only where they live differs.
"""

from __future__ import annotations

import functools
import mmap
import threading
from pathlib import Path

import torch

from medusa_train.backbone import native

HUGE_PAGE = 2 << 20  #: bytes in an x86-64 huge page
BLOCK = 32 << 20  #: bytes a mapping holds (a tensor larger than this gets a mapping of its own)
ALIGN = 64  #: each tensor's start, in bytes (a cache line)
ENV_SWITCH = "MEDUSA_TRAIN_HUGE_PAGES"  #: ``0`` / ``off``: packed weights in torch's own memory (a benchmark's "before")
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def transparent_huge_pages() -> str:
    """The kernel's transparent huge page setting (``always``, ``madvise``, ``never``), or ``unknown``."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return "unknown"
    chosen = [word[1:-1] for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else "unknown"


def possible() -> bool:
    """Whether ``empty`` maps 2 MB pages here: Linux offers them (``always`` or ``madvise``), Python can ask
    (``mmap.MADV_HUGEPAGE``), and ``MEDUSA_TRAIN_HUGE_PAGES`` does not switch them off."""
    return (hasattr(mmap, "MADV_HUGEPAGE") and transparent_huge_pages() in ("always", "madvise")
            and not native.switched_off(ENV_SWITCH))


class _Arena:
    """Hands out 64-byte aligned pieces of 2 MB-aligned anonymous private mappings that asked for huge pages."""

    def __init__(self):
        self.lock = threading.Lock()
        self.block: torch.Tensor | None = None  # the current block's bytes (uint8), from its 2 MB-aligned start
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` bytes (uint8) from a huge-page mapping."""
        with self.lock:
            if nbytes > BLOCK:
                return _mapping(nbytes)[:nbytes]
            start = -(-self.used // ALIGN) * ALIGN
            if self.block is None or start + nbytes > self.block.numel():
                self.block, start = _mapping(BLOCK), 0
            self.used = start + nbytes
            return self.block[start: start + nbytes]


def _mapping(nbytes: int) -> torch.Tensor:
    """A fresh mapping of at least ``nbytes`` (rounded up to 2 MB) asking for huge pages, as uint8 from its first 2 MB
    boundary; the tensor's storage keeps the mapping alive."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % HUGE_PAGE
    return raw[skip: skip + size]


_ARENA = _Arena()


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype``, in 2 MB pages where ``possible`` (else
    ``torch.empty``'s)."""
    count = 1
    for size in shape:
        count *= size
    nbytes = count * torch.empty(0, dtype=dtype).element_size()
    if not possible() or nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    try:
        piece = _ARENA.take(nbytes)
    except (OSError, ValueError):  # no memory left to map, or a kernel that refuses the advice: torch's memory
        return torch.empty(shape, dtype=dtype)
    return piece.view(dtype).view(shape)


def mapped_bytes() -> int:
    """Bytes of this process's memory that Linux holds in huge pages now (``AnonHugePages`` of its mappings; 0 where
    it cannot be read): whether the advice was taken."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0
