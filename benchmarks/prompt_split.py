"""A prompt's matmuls with their column-block pairs handed out in runs as threads come free, against fixed shares.

A 2-vCPU cloud VM's vCPUs need not run at the same speed: a neighbour on one of them (its hyperthread sibling on the
host) can halve that vCPU's tile and vector throughput for seconds to minutes. With fixed shares, the AMX matmuls of a
prefill then wait for the slow thread's half; in runs (kernels/runs.h `tile_pairs`, the default) the fast thread
takes more of the pairs. This script measures both in one process, alternated round by round:
  - per vCPU, one thread of the compact bf16 gate_up at 512 rows pinned to it (TFLOP/s): how unequal the two are;
  - the engine's prefill of a --tokens prompt (time to the first token, one sequence, no prefix cache) on the
    benchmark model (compact bf16) or a --gguf file, each round once in runs and once with fixed shares;
  - per round, the share of the pairs thread 0 computed in runs (0.5: the two threads kept pace).

    flock /tmp/deploykit-heavy.lock python benchmarks/prompt_split.py [--rounds 8] [--tokens 512] [--gguf FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {"runs": True, "fixed shares": False}


def vcpu_tflops(cpus: list[int], reps: int = 3) -> dict[str, float]:
    """One thread of the compact bf16 gate_up [9728, 896] at 512 rows, pinned to each CPU in turn: TFLOP/s."""
    import torch

    from benchmarks.engine import best_time
    from engine import kernels
    gen = torch.Generator().manual_seed(0)
    w = kernels.prepare_weight((torch.randn(9728, 896, generator=gen) * 0.02).bfloat16(), compact=True)
    x = torch.randn(512, 896, generator=gen).bfloat16()
    threads, mask = torch.get_num_threads(), os.sched_getaffinity(0)
    out = {}
    try:
        torch.set_num_threads(1)
        for cpu in cpus:
            os.sched_setaffinity(0, {cpu})
            best = best_time(lambda: kernels.gate_up_silu(x, w), reps)  # after a warm-up call on this CPU
            out[str(cpu)] = round(2 * 512 * 9728 * 896 / best / 1e12, 3)
    finally:
        os.sched_setaffinity(0, mask)
        torch.set_num_threads(threads)
    return out


def prefill(core, prompt: list[int]) -> float:
    """Seconds to the first token of one sequence with this prompt."""
    from engine.sampling import SamplingParams
    core.add_request(str(time.monotonic_ns()), prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1))
    t = time.perf_counter()
    while core.has_unfinished_requests():
        core.step()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", type=Path, default=Path.home() / ".cache/deploykit/bench/qwen2-350m-bf16")
    ap.add_argument("--gguf", type=Path, default=None, help="a (quantized) GGUF file instead of the bf16 model")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    a = ap.parse_args()

    from deploykit import cpulist
    from deploykit.isa import cpu_model
    from engine import binding
    b = binding.prepare(binding.resolve("auto"))
    import torch  # OpenMP starts with the binding's environment
    binding.finish(b)
    from benchmarks.engine import ensure_model, paired_median
    from engine import kernels
    from engine.config import EngineConfig
    from engine.core import EngineCore
    st = kernels.status()
    if not st["amx"]:
        raise SystemExit(f"the prompt matmuls run on AMX tiles; this host's kernels do not ({st['path']})")
    if a.gguf is None:
        ensure_model(a.model_dir)
    ops = torch.ops.deploykit
    src = str(a.gguf or a.model_dir)
    core = EngineCore(EngineConfig(src, dtype="bfloat16", max_model_len=a.tokens + 16, max_num_seqs=1,
                                   prefix_caching=False, compact_weights=True))
    vocab = core.model_config.vocab_size
    prompt = [3 + (7 * i) % (vocab - 3) for i in range(a.tokens)]
    cpus = sorted(b.cpus or os.sched_getaffinity(0))
    before = vcpu_tflops(cpus)
    for on in VARIANTS.values():  # warm-up
        ops.set_tile_runs(on)
        prefill(core, prompt)
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    first_share: list[float] = []
    order = list(VARIANTS)
    try:
        for r in range(a.rounds):  # each round starts one variant later
            for name in order[r % 2:] + order[:r % 2]:
                ops.set_tile_runs(VARIANTS[name])
                ops.tile_runs_taken()  # reset
                seconds[name].append(prefill(core, prompt))
                taken, first = ops.tile_runs_taken()
                if VARIANTS[name] and taken:
                    first_share.append(round(first / taken, 3))
    finally:
        ops.set_tile_runs(True)
    after = vcpu_tflops(cpus)
    print(json.dumps({
        "benchmark": "prompt_split",
        "host": {"cpu": platform.processor() or platform.machine(), "model_name": cpu_model(), "isa": st["isa"],
                 "cpus": cpulist.format(b.cpus), "threads": b.threads, "torch": torch.__version__,
                 "kernels": st["path"]},
        "model": {"source": src, "prompt_tokens": a.tokens, "rounds": a.rounds},
        "vcpu_gate_up_tflops": {"before": before, "after": after},
        "prefill_s": {name: {"best": round(min(v), 4), "median": round(median(v), 4),
                             "samples": [round(x, 4) for x in v]} for name, v in seconds.items()},
        "paired_median_time_fixed_over_runs": paired_median(seconds["fixed shares"], seconds["runs"], 1, 3),
        "pairs_share_of_thread_0_by_round": first_share,
        "method": "time to the first token of one sequence (no prefix cache), the prompt's matmuls with their pairs in "
                  "runs (kernels/runs.h tile_pairs) or in fixed shares, alternated round by round in one process; "
                  "paired_median: the median over rounds of fixed / runs; vcpu_gate_up_tflops: one thread of the "
                  "compact bf16 gate_up [9728, 896] at 512 rows pinned to each CPU, before and after",
    }, indent=1))


if __name__ == "__main__":
    main()
