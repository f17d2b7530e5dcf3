"""Decode (batch 1 and 16) and a 512-token prefill with compact bf16 weights (12 bits a weight, lossless:
engine/kernels/compact_bf16.h) against the same model held packed in 16 bits, both loaded in one process, every load
alternating between them each round.

The memory bandwidth of a shared VM swings by up to 2x from minute to minute, so separate runs cannot resolve a
10-30 % difference; pairs of runs a few hundred milliseconds apart can. The paired median is the number to quote.

Run: flock /tmp/deploykit-heavy.lock python benchmarks/compact.py [--model-dir DIR] [--rounds R] [--tokens N]
                                                                      (JSON on stdout, progress on stderr)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # not benchmarks/: engine.py there would shadow the engine package

from benchmarks.engine import DEFAULT_MODEL_DIR, ensure_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per measurement, after a 16-token prompt")
    a = ap.parse_args()
    ensure_model(a.model_dir)
    from engine import binding
    bound = binding.prepare(binding.resolve("auto"))  # the serve binding: one pinned OpenMP thread per core
    import torch
    binding.finish(bound)
    from engine import kernels
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.sampling import SamplingParams
    if kernels.status()["path"] == "fallback":  # compact weights exist only in the native kernels
        raise SystemExit(f"the native kernels are not loaded ({kernels.status()['reason']}): nothing to compare")

    cores = {name: EngineCore(EngineConfig(str(a.model_dir), dtype="bfloat16", max_model_len=1024, max_num_seqs=16,
                                           prefix_caching=False, compact_weights=name == "compact"))
             for name in ("packed", "compact")}
    def run(core: EngineCore, n: int, batch: int = 1) -> tuple[float, list[int]]:
        """Seconds a decode step of `batch` sequences (their prefill excluded), and the first one's tokens."""
        ids = [str(time.monotonic_ns() + i) for i in range(batch)]
        for i, rid in enumerate(ids):
            core.add_request(rid, [3 + (7 * j + 13 * i) % 1000 for j in range(16)],
                             SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n + 1))
        out = {rid: [] for rid in ids}
        while not all(out.values()):  # every sequence's prefill and first token
            for o in core.step():
                out[o.request_id] += o.new_token_ids
        t, steps = time.perf_counter(), 0
        while core.has_unfinished_requests():
            for o in core.step():
                out[o.request_id] += o.new_token_ids
            steps += 1
        return (time.perf_counter() - t) / steps, out[ids[0]]

    def prefill(core: EngineCore) -> float:
        """Seconds to the first token of a 512-token prompt."""
        t = time.perf_counter()
        core.add_request(str(time.monotonic_ns()), [3 + (11 * j) % 1000 for j in range(512)],
                         SamplingParams(temperature=0.0, max_tokens=1))
        while core.has_unfinished_requests():
            core.step()
        return time.perf_counter() - t

    for core in cores.values():
        run(core, 8)  # warm-up
    loads = ("b1", "b16", "prefill_512")
    sec: dict[str, dict[str, list[float]]] = {load: {name: [] for name in cores} for load in loads}
    same = True
    for r in range(a.rounds):
        order = list(cores) if r % 2 == 0 else list(cores)[::-1]
        out = {}
        for name in order:
            s, out[name] = run(cores[name], a.tokens)
            sec["b1"][name].append(s)
        same &= out["packed"] == out["compact"]
        for name in order:
            sec["b16"][name].append(run(cores[name], a.tokens // 2, 16)[0])
        for name in order:
            sec["prefill_512"][name].append(prefill(cores[name]))
        print(f"round {r + 1}/{a.rounds} " + " ".join(f"{load} {n} {1e3 * sec[load][n][-1]:.2f} ms"
                                                       for load in loads for n in cores), file=sys.stderr)
    held = {name: c.model.weight_bytes for name, c in cores.items()}
    print(json.dumps({
        "benchmark": "compact_bf16_vs_packed_bf16_batch1",
        "model": str(a.model_dir), "isa": kernels.status()["isa"], "torch": torch.__version__,
        "threads": torch.get_num_threads(), "weights_held_bytes": held,
        "ms_per_step": {load: {n: {"best": round(1e3 * min(v), 3), "median": round(1e3 * median(v), 3)}
                                for n, v in by.items()} for load, by in sec.items()},
        "b1_tok_s_best": {n: round(1 / min(v), 1) for n, v in sec["b1"].items()},
        "compact_over_packed_time": {load: round(median(c / p for c, p in zip(by["compact"], by["packed"])), 3)
                                     for load, by in sec.items()},
        "bytes_compact_over_packed": round(held["compact"] / held["packed"], 3),
        "b1_greedy_tokens_identical": same,
        "method": "both models in one process; each round runs every load on each, in alternating order; "
                  "compact_over_packed_time is the median of per-round ratios (< 1: compact is faster)"},
        indent=1))


if __name__ == "__main__":
    main()
