"""Weights and the KV cache on 2 MiB pages: memory that asks for transparent huge pages before it is first touched.

At batch 1 a decode step streams every weight once, and one core streams faster from 2 MiB pages. Measured on a
2-vCPU Zen 4 (benchmarks/README.md, "Weights on 2 MiB pages"), variants alternated in one process: the same Q4_0 model
decoded 1.17-1.48x faster at batch 1 with its weights here than on 4 KiB pages, bf16 1.16x faster, and the streaming
probe read 1.1-1.5x faster. The likely reasons, not measured one by one: a TLB miss every 4 KiB, and a hardware
prefetcher that stops at page boundaries.

Most distributions set THP to `madvise`: only memory that asks gets 2 MiB pages. PyTorch's allocator asks only with
THP_MEM_ALLOC_ENABLE=1, and then per allocation of 2 MiB or more, while most matrices of a small quantized model are
smaller. So the engine asks itself: one anonymous mapping per model, aligned to 2 MiB, madvise(MADV_HUGEPAGE) before
the first touch, each weight copied in as the loader finishes it, in the order a decode step reads them (one
sequential stream), and the loader's copy freed at once: loading peaks near the weights' size, not at twice it (the
container's memory limit is sized from the weights). Where THP is `never` the same arena sits on 4 KiB pages and the
report says so.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from deploykit import hostsettings

log = logging.getLogger("engine")

HUGE = 2 << 20
ALIGN = 64  # every tensor starts on a cache line (the kernels' blobs require it: quant_layout.h, compact_bf16.h)
SMAPS = Path("/proc/self/smaps")
_LIBC = ctypes.CDLL(None, use_errno=True)  # the process's own symbols: glibc, and an LD_PRELOADed allocator's
_LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def allocate(nbytes: int, huge: bool = True) -> torch.Tensor:
    """An untouched uint8 [nbytes] tensor on its own anonymous mapping, starting on a 2 MiB boundary and (huge)
    asking for 2 MiB pages. The mapping lives as long as the tensor and its views, and goes back to the system with
    them (munmap), not to the heap."""
    m = mmap.mmap(-1, nbytes + 2 * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(m, dtype=torch.uint8)  # holds the mapping
    start = -t.data_ptr() % HUGE
    # Whole 2 MiB pages inside the tensor only: a last page the tensor fills in part stays on 4 KiB pages. Asked for,
    # it could first get 4 KiB pages (no free 2 MiB block at that moment) and khugepaged would later fill it out to
    # 2 MiB (max_ptes_none is 511 by default), so the resident memory would grow under load.
    if huge:  # a kernel without THP refuses: 4 KiB pages, as without asking
        _advise(t.data_ptr() + start, nbytes // HUGE * HUGE, "MADV_HUGEPAGE")
    return t[start:start + nbytes]


def empty(shape: tuple[int, ...], dtype: torch.dtype, huge: bool = True) -> torch.Tensor:
    """torch.empty on its own 2 MiB-aligned mapping that asked for 2 MiB pages (allocate)."""
    n = 1
    for s in shape:
        n *= s
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return allocate(n * itemsize, huge).view(dtype).view(shape)


def huge_bytes(t: torch.Tensor) -> int:
    """How many bytes of t's memory sit on huge pages now (AnonHugePages of the mappings it spans)."""
    lo = t.data_ptr()
    hi = lo + t.numel() * t.element_size()
    total, inside = 0, False
    try:
        text = SMAPS.read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            a, b = int(head.group(1), 16), int(head.group(2), 16)
            inside = a < hi and b > lo
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return min(total, hi - lo)  # under THP 'always', pages of the mapping around t may count too


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the arena's weights sit, for the start-up log and /debug/binding."""
    bytes: int  # the weights copied into the arena
    huge_bytes: int  # of the arena's memory, on 2 MiB pages
    thp: str  # the host's transparent_hugepage/enabled: always | madvise | never | unknown
    asked: bool  # False: turned off (EngineConfig.huge_pages)

    @property
    def share(self) -> float:
        return min(1.0, self.huge_bytes / self.bytes) if self.bytes else 0.0

    def text(self) -> str:
        size = f"{self.bytes / 2**20:.1f} MiB"
        if not self.asked:
            return f"{size} on 4 KiB pages (huge pages turned off)"
        whole = self.bytes // HUGE * HUGE  # what asked: the whole 2 MiB pages (allocate)
        if whole == 0:
            return f"{size} on 4 KiB pages (less than one 2 MiB page)"
        why = "" if self.huge_bytes >= 0.9 * whole else (
            "; transparent hugepages are 'never' on this host: echo madvise > "
            "/sys/kernel/mm/transparent_hugepage/enabled" if self.thp == "never" else
            f"; the kernel gave fewer (transparent_hugepage/enabled: {self.thp}; memory may be fragmented)")
        return f"{size}, {100 * self.share:.0f} % of it on 2 MiB pages{why}"

    def as_dict(self) -> dict:
        return {"bytes": self.bytes, "huge_bytes": self.huge_bytes, "thp": self.thp, "asked": self.asked}


class Arena:
    """Tensors copied one after another (ALIGN apart) into allocate()d mappings: the loader take()s each weight as
    soon as it has its final form and drops its own copy, so the next weight is read into the freed memory and the
    load's peak stays one layer above the weights (not twice them, as moving a loaded model would). The first mapping
    is sized at the loader's estimate; a weight that does not fit starts another (untouched tails cost no memory)."""

    def __init__(self, estimate: int, huge: bool = True):
        self.estimate = estimate
        self.huge = huge
        self.chunks: list[torch.Tensor] = []  # the mappings, in order; the last one is being filled
        self.filled: list[int] = []           # bytes taken in each (ALIGN-rounded)
        self.used = 0                         # bytes taken in all

    @staticmethod
    def size(tensors) -> int:
        return sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """t's values in the arena, same dtype and shape (contiguous)."""
        n = t.numel() * t.element_size()
        if not self.chunks or self.filled[-1] + n > self.chunks[-1].numel():
            # The estimate first; past it, room for this tensor and more (the rest of a model seldom exceeds it).
            size = self.estimate if not self.chunks else max(n, self.estimate // 8, HUGE)
            self.chunks.append(allocate(max(size, n), self.huge))
            self.filled.append(0)
        at = self.filled[-1]
        v = self.chunks[-1][at:at + n].view(t.dtype).view(t.shape)
        v.copy_(t)
        step = -(-n // ALIGN) * ALIGN
        self.filled[-1] += step
        self.used += step
        return v

    def holds(self, t: torch.Tensor) -> bool:
        """Whether t's memory is in this arena."""
        p = t.data_ptr()
        return any(c.data_ptr() <= p < c.data_ptr() + f for c, f in zip(self.chunks, self.filled))

    def placement(self) -> Placement:
        """Closes the arena, so that only whole 2 MiB pages of weights sit on huge pages, as allocate() keeps it: the
        partly filled last one of each mapping and the rest stop asking (khugepaged would otherwise fill such a page
        out later), and the memory past the weights is given back (MADV_DONTNEED: a huge page the first touch gave
        the last weights is split, and its unused 4 KiB pages freed). Then the heap is trimmed, and the report says
        how much sits on 2 MiB pages."""
        for c, f in zip(self.chunks, self.filled):
            if self.huge:
                _advise(c.data_ptr() + f // HUGE * HUGE, c.numel() - f // HUGE * HUGE, "MADV_NOHUGEPAGE")
            end = -(-f // mmap.PAGESIZE) * mmap.PAGESIZE
            _advise(c.data_ptr() + end, c.numel() - end, "MADV_DONTNEED")
        trim()
        huge = sum(huge_bytes(c[:f]) for c, f in zip(self.chunks, self.filled) if f)
        return Placement(self.used, huge, hostsettings.thp_mode() or "unknown", self.huge)


def _advise(addr: int, length: int, advice: str) -> None:
    """madvise on a range of a mapping this module made (addr on a page boundary); a kernel without it: nothing."""
    if length <= 0 or not hasattr(mmap, advice):
        return
    if _LIBC.madvise(addr, length, getattr(mmap, advice)) != 0:
        log.debug("madvise(%s) failed: errno %d", advice, ctypes.get_errno())


def trim() -> None:
    """Give the memory the loader's copies left free back to the system, so what stays resident is the arena, not the
    arena plus a free heap: glibc's malloc_trim, or tcmalloc's ReleaseFreeMemory where it is preloaded (the engine
    image does; it keeps freed spans resident, and malloc_trim does not reach them)."""
    for name, args in (("malloc_trim", (0,)), ("MallocExtension_ReleaseFreeMemory", ())):
        try:
            getattr(_LIBC, name)(*args)
        except AttributeError:  # not this allocator
            pass
