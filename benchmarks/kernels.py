"""Matmul throughput of the pure-PyTorch fallback vs the native kernels on the Qwen2-0.5B-shaped decode/prefill
shapes, against the memory roofline measured in the same run. Prints JSON on stdout (a table on stderr).

Run: flock /tmp/deploykit-heavy.lock python benchmarks/kernels.py [--rounds 7] [--ms 1,4,16,512]

Weights rotate over enough copies to exceed the L3 cache (as 24 layers do in a real decode step), so small-M
numbers are DRAM numbers. Candidates are timed round-robin and the best round is kept: the host is shared,
and interleaving keeps every candidate in the same noise window.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import kernels

# name -> (N, K): fused QKV, o_proj, fused gate/up, down of a hidden-896 / intermediate-4864 Qwen2 layer,
# and an lm_head tied to the 151936-row embedding (kept plain, so it takes the row-dot kernel).
SHAPES = {"qkv": (1152, 896), "o_proj": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)}
TIED_LM_HEAD = ("lm_head_tied", (151936, 896))
COLD_BYTES = 384 << 20  # > 3x the 105 MiB L3 here


def best_round(candidates: dict, rounds: int) -> dict[str, float]:
    """candidates: name -> zero-arg callable doing `calls` matmuls and returning that count."""
    best = {name: float("inf") for name in candidates}
    for name, fn in candidates.items():
        fn()  # warm-up: page in, oneDNN primitive cache, AMX state
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            calls = fn()
            best[name] = min(best[name], (time.perf_counter() - start) / calls)
    return best


def rotate(fn, weights: list, x: torch.Tensor):
    def run() -> int:
        for w in weights:
            fn(x, w)
        return len(weights)

    return run


def roofline(rounds: int) -> dict:
    """benchmarks/roofline.py's probe: the best of native streaming reads of 1 GiB (1-8 streams per thread) and an
    MKL fp32 GEMV over 512 MiB."""
    from benchmarks.roofline import read_bandwidth
    return read_bandwidth(rounds, kernels.status()["library"] is not None)  # every build has the probe


def native_kernel_name(m: int, packed: bool) -> str:
    amx = kernels.status()["amx"]
    if packed:
        return "amx" if amx and m >= kernels.AMX_MIN_M else "packed_avx512"
    if m <= kernels.ROWS_MAX_M:
        return "rows"
    if amx and m <= kernels.PLAIN_AMX_MAX_M:
        return "plain_amx"
    return "rows" if m <= 4 else "fallback"


def measure_shape(name: str, n: int, k: int, ms: list[int], rounds: int, tied: bool) -> list[dict]:
    wbytes = n * k * 2
    copies = max(1, -(-COLD_BYTES // wbytes))
    plain = [(torch.randn(n, k) / k**0.5).bfloat16() for _ in range(copies)]
    native = plain if tied else [kernels.prepare_weight(w) for w in plain]
    packed = kernels.is_packed(native[0])
    onednn = [] if tied else [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in plain[:2]]
    ops = torch.ops.deploykit if kernels.status()["path"] != "fallback" else None
    rows = []
    for m in ms:
        x = torch.randn(m, k).bfloat16()
        # Prefill is compute-bound: a few copies suffice and keep the run short.
        take = copies if m <= 64 else min(copies, 4)
        cands = {"fallback": rotate(F.linear, plain[:take], x),
                 "native": rotate(kernels.linear, native[:take], x)}
        if onednn and m > 1:
            cands["onednn_prepacked"] = rotate(
                lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), onednn, x)
        if ops is not None and packed:
            cands["packed_avx512"] = rotate(lambda x, w: ops.linear_packed_avx512(x, w, None), native[:take], x)
            if kernels.status()["amx"]:
                cands["amx"] = rotate(lambda x, w: ops.linear_packed_amx(x, w, None), native[:take], x)
        if ops is not None and m <= 16:
            cands["rows"] = rotate(lambda x, w: ops.linear_rows(x, w, None), plain[:take], x)
        if ops is not None and kernels.status()["amx"] and m <= 64:
            cands["plain_amx"] = rotate(lambda x, w: ops.linear_plain_amx(x, w, None), plain[:take], x)
        times = best_round(cands, rounds if m <= 64 else max(3, rounds // 2))
        paths = {c: {"ms": round(t * 1e3, 4), "gbps": round(wbytes / t / 1e9, 2),
                     "tflops": round(2 * m * n * k / t / 1e12, 4)} for c, t in times.items()}
        rows.append({"shape": name, "n": n, "k": k, "m": m, "weight_mib": round(wbytes / 2**20, 2),
                     "cold_copies": take, "native_kernel": native_kernel_name(m, packed) if ops else "fallback",
                     "speedup_native_vs_fallback": round(times["fallback"] / times["native"], 2), "paths": paths})
    del plain, native, onednn
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ms", default="1,4,16,512")
    parser.add_argument("--no-lm-head", action="store_true", help="skip the 272 MiB tied lm_head shape")
    args = parser.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    torch.manual_seed(0)
    with torch.inference_mode():
        bw = roofline(args.rounds)
        results = []
        for name, (n, k) in SHAPES.items():
            results += measure_shape(name, n, k, ms, args.rounds, tied=False)
        if not args.no_lm_head:
            name, (n, k) = TIED_LM_HEAD
            results += measure_shape(name, n, k, [m for m in ms if m <= 16], args.rounds, tied=True)
        bw_after = roofline(args.rounds)
    roof = max(bw["best_gbps"], bw_after["best_gbps"])
    for r in results:
        for p in r["paths"].values():
            p["pct_roofline"] = round(100 * p["gbps"] / roof, 1)
    report = {"host": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                       "torch": torch.__version__},
              "kernels": kernels.status(), "roofline": {"before": bw, "after": bw_after, "best_gbps": roof},
              "method": "best of interleaved rounds; weights rotated over > L3 of copies for M <= 64",
              "results": results}
    print(json.dumps(report, indent=1))
    for r in results:
        cells = "  ".join(f"{c}={p['gbps']:.1f}GB/s|{p['tflops']:.3f}TF" for c, p in r["paths"].items())
        print(f"{r['shape']:>12} M={r['m']:<4} [{r['native_kernel']}] x{r['speedup_native_vs_fallback']:<5} {cells}",
              file=sys.stderr)
    print(f"roofline {roof:.1f} GB/s", file=sys.stderr)


if __name__ == "__main__":
    main()
