"""How the bf16 GEMV streams its weights on this CPU (kernels/gemv.h `Streams`), chosen once per process by timing.

At batch 1 a decode step is one pass over every weight, so its speed is the rate at which a core's GEMV pulls
weight lines from DRAM, and the best way to pull them is a property of the memory system, not of the model:
8 column-block streams at a time with software prefetch on the Xeons measured so far, one stream after another
without it on Zen 4 (50 against 35 GB/s; benchmarks/decode_profile.py). Both sum every output in the same order,
so the choice never changes a result; it is measured, not keyed on a CPU name, because the same name covers
hosts (and hypervisors) whose memory behaves differently.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from engine import hugepages

log = logging.getLogger("engine.kernels")

ENV = "DEPLOYKIT_GEMV_STREAMS"  # 8 or 1 skips the measurement
MANY, ONE = 8, 1
# One Qwen2-0.5B-shaped layer's matrices [N, K] (qkv, o_proj, gate_up, down), repeated until the set is larger
# than any L3 (so every pass reads DRAM) and has the real mix of short and long streams.
LAYER = ((1152, 896), (896, 896), (9728, 896), (896, 4864))
LAYERS = 4  # 119 MB
ROUNDS = 5
# MANY stays unless ONE is faster by more than this: it is the choice tested on the Intel hosts, and a tie on a
# noisy VM must not flip between runs.
MARGIN = 0.03


@dataclass(frozen=True, slots=True)
class Choice:
    streams: int
    seconds: dict[int, float]  # best pass over the set per candidate; empty when set by ENV
    source: str  # "measured" | ENV

    def describe(self) -> str:
        what = "one block stream per core" if self.streams == ONE else f"{MANY} block streams per core, prefetched"
        if not self.seconds:
            return f"{what} ({self.source})"
        mb = sum(n * k for n, k in LAYER) * LAYERS * 2 / 1e6
        times = ", ".join(f"{s} stream{'s' * (s > 1)} {t * 1e3:.2f} ms" for s, t in sorted(self.seconds.items()))
        return f"{what} (measured over {mb:.0f} MB: {times})"


def _pass(x: torch.Tensor, weights: list[torch.Tensor], linear) -> float:
    t = time.perf_counter()
    for w in weights:
        linear(x[:, :w.shape[1] * 2], w, None)
    return time.perf_counter() - t


def calibrate(ops) -> Choice:
    """Time both streamings at M = 1 on 2 threads' worth of the model's shapes and keep the faster. ops is
    torch.ops.deploykit (the loaded library). ~0.1 s: 119 MB allocated once, 2 x ROUNDS passes."""
    forced = os.environ.get(ENV, "").strip()
    if forced:
        if forced not in (str(MANY), str(ONE)):
            raise ValueError(f"{ENV}={forced!r}: expected {MANY} or {ONE} (or unset, to measure)")
        ops.set_gemv_streams(int(forced))
        return Choice(int(forced), {}, ENV)
    # Packed [N/16, K/2, 16, 2] bf16 on 2 MiB pages like the model's (engine/hugepages.py); the values do not matter
    # to the timing (a small normal number, no denormals).
    weights = [hugepages.empty((n // 16, k // 2, 16, 2), torch.bfloat16).fill_(0.01) for _ in range(LAYERS)
               for n, k in LAYER]
    x = torch.full((1, max(k for _, k in LAYER)), 0.5, dtype=torch.bfloat16)
    linear = ops.linear_packed_avx512.default
    best = {MANY: float("inf"), ONE: float("inf")}
    try:
        for _ in range(ROUNDS):
            for s in best:
                ops.set_gemv_streams(s)
                best[s] = min(best[s], _pass(x, weights, linear))
    finally:
        ops.set_gemv_streams(MANY)
    streams = ONE if best[ONE] < best[MANY] * (1 - MARGIN) else MANY
    ops.set_gemv_streams(streams)
    return Choice(streams, best, "measured")
