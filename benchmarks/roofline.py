"""The memory roofline the decode benchmarks hold their figures to: the best rate this host reads the decode's bytes at.

A native read of 1 GiB on 2 MiB pages (kernels/stream_read.cpp) with 1, 2, 4 and 8 sequential streams per
thread, each with no software prefetch and with PREFETCHT1 4 KiB ahead, and an MKL fp32 GEMV over 512 MiB; the
roofline is the best of them. Given the bytes a decode step reads (`working_set`), the same reads also run over a
buffer of that size, which a token's loop re-reads as the decode does its weights: where the last-level cache holds a
good part of them (a VM reporting 480 MiB of L3 read 192-256 MiB at 39-48 GB/s against 33-38 for 1 GiB, session 21),
1 GiB would understate what the decode can reach and put kernels above 100 %. Which stream count is fastest depends on
the CPU and the page size (on the 2-vCPU Zen 4 VM, 2 MiB pages: 8 streams 53-58 GB/s, one 27 GB/s), so a probe
with one fixed count understates some hosts: with 4 streams it read 25-33 GB/s on a Zen 4 VM whose GEMV streamed
50 GB/s, which would have put kernels above 100 %.
torch's own reductions are compute-bound at ~10 GB/s on 2 cores and are used only without the native library.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

from engine import hugepages

STREAMS = (1, 2, 4, 8)
AHEAD = (0, 4096)  # bytes each stream is requested ahead into L2 (0: none)


def best_seconds(fn, rounds: int) -> float:
    """The fastest of `rounds` timed calls of fn (no warm-up: callers decide)."""
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@functools.cache
def _buffers() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1 GiB to read and a 512 MiB fp32 GEMV, made once per process: benchmarks probe every round, and filling
    them costs more than the probes. On 2 MiB pages, as the engine holds its weights (engine/hugepages.py): on 4 KiB
    pages one stream per core reads 1.4-1.5x slower on Zen 4, and the roofline is the best the host allows."""
    return (hugepages.empty((256 << 20,), torch.float32).fill_(1.0),
            hugepages.empty((32768, 4096), torch.float32).normal_(), torch.randn(1, 4096))


@functools.cache
def _working_set(nbytes: int) -> torch.Tensor:
    """A buffer of nbytes (rounded up to 2 MiB) on 2 MiB pages, made once per size."""
    return hugepages.empty((-(-nbytes // (2 << 20)) * (2 << 20),), torch.uint8).fill_(1)


def _native_reads(data: torch.Tensor, rounds: int) -> dict[str, float]:
    """GB/s of stream_read over data per "<streams> streams[, L2 prefetch <ahead> B]"."""
    out = {}
    for s in STREAMS:
        for ahead in AHEAD:
            name = f"{s} streams" + (f", L2 prefetch {ahead} B" if ahead else "")
            seconds = best_seconds(lambda s=s, a=ahead: torch.ops.deploykit.stream_read(data, s, a), rounds)
            out[name] = round(data.nbytes / seconds / 1e9, 2)
    return out


def read_bandwidth(rounds: int = 3, native: bool = True, working_set: int | None = None) -> dict:
    """GB/s per probe and the best of them (`best_gbps`). native: whether the kernel library is loaded; working_set:
    the bytes a decode step reads, probed as well (module docstring)."""
    data, w, x = _buffers()
    out: dict = {"fp32_gemv_gbps": round(w.nbytes / best_seconds(lambda: F.linear(x, w), rounds) / 1e9, 2)}
    if native:
        out["stream_read_gbps_by_streams"] = _native_reads(data, rounds)
        out["stream_read_gbps"] = out["stream_read_1gib_gbps"] = max(out["stream_read_gbps_by_streams"].values())
        out["stream_read_probe"] = "native (kernels/stream_read.cpp), best stream count and prefetch per thread"
        if working_set:
            ws = _working_set(working_set)
            out["working_set_bytes"] = ws.nbytes
            out["working_set_gbps_by_streams"] = _native_reads(ws, rounds)
            out["working_set_gbps"] = max(out["working_set_gbps_by_streams"].values())
            out["stream_read_gbps"] = max(out["stream_read_gbps"], out["working_set_gbps"])
    else:
        out["stream_read_gbps"] = round(data.nbytes / best_seconds(lambda: torch.sum(data), rounds) / 1e9, 2)
        out["stream_read_probe"] = "torch.sum (compute-bound, understates)"
    out["best_gbps"] = max(out["stream_read_gbps"], out["fp32_gemv_gbps"])
    return out
