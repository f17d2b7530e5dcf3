"""The memory roofline the decode benchmarks hold their figures to: the best rate this host reads DRAM at.

A native read of 1 GiB on 2 MiB pages (kernels/stream_read.cpp) with 1, 2, 4 and 8 sequential streams per
thread, and an MKL fp32 GEMV over 512 MiB; the roofline is the best of them. Which stream count is fastest depends on
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


def read_bandwidth(rounds: int = 3, native: bool = True) -> dict:
    """GB/s per probe and the best of them (`best_gbps`). native: whether the kernel library is loaded."""
    data, w, x = _buffers()
    out: dict = {"fp32_gemv_gbps": round(w.nbytes / best_seconds(lambda: F.linear(x, w), rounds) / 1e9, 2)}
    if native:
        out["stream_read_gbps_by_streams"] = {
            s: round(data.nbytes / best_seconds(lambda s=s: torch.ops.deploykit.stream_read(data, s), rounds) / 1e9, 2)
            for s in STREAMS}
        out["stream_read_gbps"] = max(out["stream_read_gbps_by_streams"].values())
        out["stream_read_probe"] = "native (kernels/stream_read.cpp), best stream count per thread"
    else:
        out["stream_read_gbps"] = round(data.nbytes / best_seconds(lambda: torch.sum(data), rounds) / 1e9, 2)
        out["stream_read_probe"] = "torch.sum (compute-bound, understates)"
    out["best_gbps"] = max(out["stream_read_gbps"], out["fp32_gemv_gbps"])
    return out
