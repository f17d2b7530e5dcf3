"""Where the time of a batch-1 decode step goes, for each way the GEMV can stream its weights.

One process pinned like `python -m engine serve` loads engine.py's 717 MB bf16 Qwen2-shaped model into EngineCore and
decodes greedily at batch 1 (a 16-token prompt, then --tokens tokens), rounds alternating between the GEMV streamings
(kernels/gemv.h `Streams`: 8 prefetched block streams per core, and one stream). Per generated token it reports:
  - the engine step split into the fused native call (`decode_step_`, with the final norm and the LM head where the
    step takes them), the rest of `model.decode` (embedding, Python), the LM head with the final norm where Python
    runs them (`compute_logits`), the sampler, and everything else (scheduling, inputs, outputs);
  - inside the native forward, per thread (kernels/step_profile.h): each phase's compute (qkv, attention, o_proj,
    norm + gate_up + silu, down, residual + next norm) and the time spent waiting at its barriers, and the barrier
    count: the OpenMP barriers one token costs;
  - the weight bytes the step reads over the native forward's time (GB/s), against the roofline of
    benchmarks/roofline.py measured before and after in the same run.
The JSON also names the streaming the start-up measurement (engine/kernels/streaming.py) picked on this host.
On a CPU without AVX-512 the model runs in fp32 on the AVX2 build's fused step (decode_step_f32.cpp, the same phase
timers), whose GEMVs have no streaming choice: the rounds are of that one step unless a variant below is chosen.

`--gguf FILE` profiles a (quantized) GGUF file instead, its roofline counted from the file's weight bytes.
`--compact` alternates instead between the model held packed in 16 bits and compact in 12 (kernels/compact_bf16.h),
both with the streaming picked at start-up, and reports each one's share of the roofline counted on the file's bytes
and on the bytes it holds. `--gguf FILE --stream-ahead 0,4096,l2:8192,nta:4096,default` alternates between prefetch
distances of the quantized kernels for every format (kernels/quant_stream.h; `l2:`/`nta:` also set where the lines go,
else the CPU's default hint; `default`: each format's own distance and the default hint). `--pages` alternates between
the weights on 2 MiB pages (engine/hugepages.py, the default) and on 4 KiB pages (EngineConfig(huge_pages=False)),
the same model loaded twice. `--shares` alternates between the fused step's threads taking work over from a slower one
(kernels/runs.h `Shares`, the default for quantized and compact matrices) and fixed shares. `--runs` alternates between
runs of greedy decode steps in one native call (EngineCore._run_steps, the default) and one step a call; its per-token
figures count tokens, not calls. `--gguf FILE --fifth-bits` alternates between the 5-bit formats' fifth bits placed
with GFNI (the default where the CPU has it) and with shifts (kernels/quant_gemv.h `or_fifth`).

    flock /tmp/deploykit-heavy.lock python benchmarks/decode_profile.py [--rounds 5] [--tokens 64] [--gguf FILE]
                                                                        [--compact | --stream-ahead B,l2:B | --pages |
                                                                         --shares | --runs | --fifth-bits]
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import sys
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # not benchmarks/: engine.py's name would shadow the engine package

PROMPT = 16
STREAMINGS = {8: "8 prefetched block streams per core", 1: "one block stream per core"}


class Timers:
    """Wall time of chosen calls, summed per name (attributes wrapped in place)."""

    def __init__(self):
        self.seconds: dict[str, float] = collections.defaultdict(float)

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t

        setattr(obj, attr, timed)


def decode_round(core, timers: Timers, ops, vocab: int, tokens: int) -> dict:
    from engine.sampling import SamplingParams
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=tokens + 1)
    core.add_request(str(time.monotonic_ns()), [3 + (7 * i) % (vocab - 3) for i in range(PROMPT)], params)
    core.step()  # the prefill and the first token
    ops.step_profile_(True)
    ops.step_take_overs()  # reset
    timers.seconds.clear()
    steps, t0 = 0, time.perf_counter()  # steps: tokens generated (a call may run several decode steps)
    while core.has_unfinished_requests():
        steps += sum(len(o.new_token_ids) for o in core.step())
    wall = time.perf_counter() - t0
    phases, native_steps = ops.step_profile_(False)
    take_overs = ops.step_take_overs()
    names = list(ops.step_profile_phases())
    per = {k: v / steps * 1e3 for k, v in timers.seconds.items()}  # ms per token
    native = per.get("native_step", 0.0)
    logits = per.get("logits", 0.0)
    split = {"native_forward": native, "forward_rest": per.get("decode", 0.0) - native - logits,
             "lm_head": logits, "sampler": per.get("sampler", 0.0)}
    split["engine_python"] = wall / steps * 1e3 - sum(split.values())
    threads = phases.shape[0]
    inside = {n: float(phases[:, i].sum()) / threads / native_steps / 1e6 for i, n in enumerate(names)}
    return {"tok_s": steps / wall, "ms_per_token": wall / steps * 1e3, "split_ms": split,
            "native_phases_ms": inside,
            "barrier_wait_ms_by_thread": [float(phases[t, names.index("barrier")]) / native_steps / 1e6
                                          for t in range(threads)],
            "barriers_per_token": float(phases[0, len(names)]) / native_steps, "native_steps": native_steps,
            "take_overs_per_token": take_overs / native_steps}


def held_read(model, w: dict) -> int:
    """The bytes a decode step reads from the weights the model holds: all of them but an untied embedding table
    (a row gather, held as in the file)."""
    return model.weight_bytes - (w["bytes"] - w["decode_read_bytes"])


def summarize(rounds: list[dict], read_bytes: int, roofline_gbps: float, held_bytes: int | None = None) -> dict:
    """held_bytes: the bytes a step reads where the engine holds fewer than the file (compact); read_bytes: the
    file's."""
    best = max(rounds, key=lambda r: r["tok_s"])
    mid = sorted(rounds, key=lambda r: r["tok_s"])[len(rounds) // 2]
    nat = mid["split_ms"]["native_forward"]
    held = {} if held_bytes is None else {
        "held_read_bytes": held_bytes,
        "pct_roofline_of_held_bytes_best": round(100 * best["tok_s"] * held_bytes / 1e9 / roofline_gbps, 1),
        "native_forward_gbps_of_held_bytes": round(held_bytes / (nat / 1e3) / 1e9, 1)}
    return {"tok_s": {"best": round(best["tok_s"], 1), "median": round(median(r["tok_s"] for r in rounds), 1),
                      "samples": [round(r["tok_s"], 1) for r in rounds]},
            "pct_roofline_best": round(100 * best["tok_s"] * read_bytes / 1e9 / roofline_gbps, 1), **held,
            "median_round": {"ms_per_token": round(mid["ms_per_token"], 2),
                             "split_ms": {k: round(v, 3) for k, v in mid["split_ms"].items()},
                             "native_phases_ms": {k: round(v, 3) for k, v in mid["native_phases_ms"].items()},
                             "barrier_wait_ms_by_thread": [round(v, 3) for v in mid["barrier_wait_ms_by_thread"]],
                             "barriers_per_token": mid["barriers_per_token"],
                             "take_overs_per_token": round(mid["take_overs_per_token"], 2),
                             "native_forward_gbps": round(read_bytes / (nat / 1e3) / 1e9, 1)}}


def ahead_setting(text: str) -> tuple[int, str | None]:
    """`--stream-ahead` entry -> (bytes, hint or None for the CPU's default): "4096", "l2:8192", "nta:4096"."""
    hint, _, n = text.rpartition(":")
    if hint not in ("", "l2", "nta") or not n.isdigit():
        raise SystemExit(f"--stream-ahead: {text!r} is not BYTES, l2:BYTES, nta:BYTES or default")
    return int(n), hint or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", type=Path, default=Path.home() / ".cache/deploykit/bench/qwen2-350m-bf16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--gguf", type=Path, default=None,
                    help="profile this (quantized) GGUF file instead; the roofline then counts its weight bytes")
    variant = ap.add_mutually_exclusive_group()  # what the rounds alternate between: one choice
    variant.add_argument("--compact", action="store_true",
                         help="alternate between the model held packed (16 bits) and compact (12 bits) instead of "
                              "between the two streamings")
    variant.add_argument("--stream-ahead", default=None, metavar="[HINT:]BYTES,...",
                         help="with --gguf: alternate between these prefetch distances of the quantized kernels "
                              "(kernels/quant_stream.h; 0 = off, default = each format's own; HINT l2 or nta sets "
                              "where the lines go) instead of between the two streamings")
    variant.add_argument("--pages", action="store_true",
                         help="alternate between the weights on 2 MiB pages and on 4 KiB pages instead of between the "
                              "two streamings")
    variant.add_argument("--shares", action="store_true",
                         help="alternate between the fused step's threads taking work over from a slower one (the "
                              "default) and fixed shares, instead of between the two streamings")
    variant.add_argument("--runs", action="store_true",
                         help="alternate between runs of greedy decode steps in one call (EngineConfig.decode_steps, "
                              "the default) and one step a call, instead of between the two streamings")
    variant.add_argument("--fifth-bits", action="store_true",
                         help="with --gguf: alternate between the 5-bit formats' fifth bits placed with GFNI (the "
                              "default where the CPU has it) and with shifts (kernels/quant_gemv.h or_fifth)")
    a = ap.parse_args()
    if a.fifth_bits and not a.gguf:
        raise SystemExit("--fifth-bits measures the quantized GEMV: give a quantized file with --gguf")
    if a.stream_ahead and not a.gguf:
        raise SystemExit("--stream-ahead measures the quantized GEMV: give a quantized file with --gguf")

    from deploykit import cpulist
    from deploykit.isa import cpu_model
    from engine import binding
    b = binding.prepare(binding.resolve("auto"))
    import torch  # OpenMP starts with the binding's environment
    binding.finish(b)
    from benchmarks.engine import ensure_model, gguf_weight_stats, weight_stats
    from benchmarks.roofline import read_bandwidth
    ensure_model(a.model_dir)

    from engine import kernels
    from engine.config import EngineConfig
    from engine.core import EngineCore
    st = kernels.status()
    full = st["path"] != "fallback"  # the AVX-512 library: bf16 activations; else the AVX2 build's fp32 step
    if not (full or st["fp32_ops"]):
        raise SystemExit(f"the native kernels are not loaded ({st['reason']}): nothing to profile")
    if a.compact and not full:
        raise SystemExit("--compact measures the bf16 GEMV of the AVX-512 builds; this CPU runs the fp32 step")
    if a.shares and not full:
        raise SystemExit("--shares measures the bf16 fused step of the AVX-512 builds; this CPU runs the fp32 step")
    ops = torch.ops.deploykit
    src = str(a.gguf or a.model_dir)
    dtype = "bfloat16" if full else "float32"
    def load(compact: bool, huge_pages: bool = True) -> EngineCore:
        return EngineCore(EngineConfig(src, dtype=dtype, max_model_len=1024, max_num_seqs=4,
                                       compact_weights=compact and full, huge_pages=huge_pages))

    core = load(True)
    if core.model.step_weights is None:
        raise SystemExit(f"{src} does not take the fused decode step here: nothing inside it to profile")
    picked = kernels.tune_streams()  # None without the AVX-512 library: its GEMVs have no streaming to pick
    streams = picked.streams if picked else None
    timers = Timers()
    timers.wrap(kernels, "decode_step_", "native_step")  # the model calls kernels.decode_step_ by attribute
    # The variants a round alternates between: (core, GEMV streaming, quantized prefetch distance in bytes for every
    # format, or None: each format's default) by name; and the variants whose fused step keeps fixed shares.
    ahead, fixed_shares, one_step = None, set(), set()
    if a.compact:
        variants = {"packed 16-bit": (load(False), streams, ahead),
                    "compact 12-bit": (core, streams, ahead)}
    elif a.pages:
        variants = {"2 MiB pages": (core, streams, ahead),
                    "4 KiB pages": (load(True, huge_pages=False), streams, ahead)}
    elif a.shares:
        variants = {"taken over": (core, streams, ahead), "fixed shares": (core, streams, ahead)}
        fixed_shares = {"fixed shares"}
    elif a.runs:
        variants = {f"runs of up to {core.config.decode_steps} steps": (core, streams, ahead),
                    "one step a call": (core, streams, ahead)}
        one_step = {"one step a call"}
    elif a.fifth_bits:
        if not ops.set_quant_gfni(True):
            raise SystemExit("--fifth-bits: this CPU (or kernel build) has no GFNI path to compare")
        variants = {"GFNI": (core, streams, ahead), "shifts": (core, streams, ahead)}
    elif a.stream_ahead:
        variants = {("each format's default" if n == "default" else f"{n} bytes ahead"):
                    (core, streams, None if n == "default" else ahead_setting(n))
                    for n in a.stream_ahead.split(",")}
    elif full:
        variants = {STREAMINGS[s]: (core, s, ahead) for s in STREAMINGS}
    else:
        variants = {"fp32 fused step": (core, None, ahead)}
    for c in {id(c): c for c, _, _ in variants.values()}.values():
        timers.wrap(c.runner.model, "decode", "decode")
        timers.wrap(c.runner.model, "compute_logits", "logits")
        timers.wrap(c, "sampler", "sampler")
    w = gguf_weight_stats(src) if a.gguf else weight_stats(a.model_dir)
    vocab = core.model_config.vocab_size
    bw_before = read_bandwidth(3, working_set=w["decode_read_bytes"])
    for c, _, _ in variants.values():
        decode_round(c, timers, ops, vocab, 8)  # warm-up
    rounds: dict[str, list[dict]] = {name: [] for name in variants}
    order = list(variants)
    for r in range(a.rounds):  # each round starts one variant later, so no variant always follows the same one
        for name in order[r % len(order):] + order[:r % len(order)]:
            c, s, n = variants[name]
            if s is not None:
                ops.set_gemv_streams(s)
            ops.reset_quant_stream_ahead()
            ops.set_step_take_over(name not in fixed_shares)
            if a.fifth_bits:
                ops.set_quant_gfni(name == "GFNI")
            c.decode_steps = 1 if name in one_step else c.config.decode_steps
            if n is not None:
                ops.set_quant_stream_ahead(n[0])
                if n[1]:
                    ops.set_quant_stream_hint(n[1])
            rounds[name].append(decode_round(c, timers, ops, vocab, a.tokens))
    if picked is not None:
        ops.set_gemv_streams(picked.streams)
    ops.reset_quant_stream_ahead()
    ops.set_step_take_over(True)
    if a.fifth_bits:
        ops.set_quant_gfni(True)
    bw_after = read_bandwidth(3, working_set=w["decode_read_bytes"])
    roof = max(bw_before["best_gbps"], bw_after["best_gbps"])
    flags = kernels.status()["isa"]
    print(json.dumps({
        "benchmark": f"{'bf16' if full else 'fp32'}_batch1_decode_profile",
        "host": {"cpu": platform.processor() or platform.machine(), "model_name": cpu_model(), "isa": flags,
                 "cpus": cpulist.format(b.cpus), "threads": b.threads, "torch": torch.__version__,
                 "kernels": st["path"] if full else f"native-{st['variant']} fp32 step"},
        "model": {"source": src, "decode_read_bytes": w["decode_read_bytes"]},
        "settings": {"rounds": a.rounds, "tokens": a.tokens, "prompt_tokens": PROMPT, "batch": 1},
        "picked_at_startup": {"streams": picked.streams, "how": picked.describe()} if picked else None,
        "roofline": {"before": bw_before, "after": bw_after, "best_gbps": roof,
                     "tok_s": round(roof * 1e9 / w["decode_read_bytes"], 1)},
        "weight_pages": {name: c.model.pages.text() for name, (c, _, _) in variants.items()},
        "by_variant" if a.compact or a.stream_ahead or a.fifth_bits or a.pages or a.shares or a.runs or not full
        else "by_streaming": {
            name: summarize(r, w["decode_read_bytes"], roof,
                            held_read(variants[name][0].model, w) if a.compact else None)
            for name, r in rounds.items()},
        # rounds paired by index: each variant's time a token over the first variant's in the same round
        f"paired_median_time_vs_{order[0]}": {
            name: round(median(f["tok_s"] / x["tok_s"] for f, x in zip(rounds[order[0]], r)), 3)
            for name, r in rounds.items()},
        "method": "ms per generated token; the step split is wall time of the wrapped calls, the native phases are "
                  "the mean over threads of kernels/step_profile.h's timers (compute per phase, barrier = waiting); "
                  "take-overs: the shares a thread took over from a slower one (kernels/runs.h Shares)",
    }, indent=1))


if __name__ == "__main__":
    main()
