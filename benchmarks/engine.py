"""Decode and prefill speed of the bundled engine against transformers and llama.cpp on a generated ~350M-parameter
Qwen2-shaped bf16 model, with the memory bandwidth (decode roofline) and bf16 matmul peak measured in the same run.

Run: flock /tmp/deploykit-heavy.lock python benchmarks/engine.py [--quick] [--threads N] [--rounds R]
         [--skip-transformers] [--skip-llamacpp] [--model-dir DIR] [--weights bf16|Q8_0|Q4_0|Q4_K_M|Q5_K_M]
                                                                          (JSON on stdout, progress on stderr)

--weights Q8_0 (Q4_0, Q4_K_M, Q5_K_M) runs ours and llama.cpp on the same GGUF file, made from the bf16 export by
llama.cpp's own quantizer; ours keeps its blocks quantized (engine/quant.py) and the roofline counts the file's bytes.

Each framework runs in its own worker process with the binding `python -m engine serve` uses (one pinned OpenMP
thread per CPU), so llama.cpp's OpenMP runtime never shares a process with torch's. The host is shared: rounds visit
every measurement in alternating order, one at a time, a measurement during which other processes used our CPUs is
repeated, and each number is reported as best and median over the rounds. Decode rates exclude prefill (they start
at the step that delivered every sequence's first token); prefill is the time to first token of a 512-token prompt,
the best of PREFILL_REPEAT back-to-back runs in each round (the matmul peak it is held to is each shape's best of 5
timed calls after a warm-up one: a best of several on both sides; the first run's time is reported as well).
llama.cpp runs with its defaults, flash attention included (auto: on here; runs before 2026-11-25 had it off), and
N sequences as N parallel sequences of one context (benchmarks/gguf_export.py).
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from functools import partial
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # not benchmarks/: this file's own name would shadow the engine package

SHAPE = {"arch": "qwen2", "hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864}
DEFAULT_MODEL_DIR = Path.home() / ".cache/deploykit/bench/qwen2-350m-bf16"
PREFILL, BATCH, PROMPT, MAX_LEN = 512, 16, 16, 1024  # PROMPT: --context's default; MAX_LEN: the least max_model_len
SMALL_BATCH = 4  # ours and llama.cpp: the largest decode step the fused native step (kernels.STEP_MAX_ROWS) takes
FOREIGN_MAX, RETRIES = 0.1, 3
# A prefill job runs its prompt this many times in a row and keeps the fastest: one 0.2 s prefill against a best-of-5
# matmul peak held a single draw of this VM's minute-to-minute noise against the best of many (session 48).
PREFILL_REPEAT = 3
TARGETS = {"b1_pct_roofline": 80.0, "b1_vs_llamacpp": 1.25, "b16_vs_transformers_b16": 3.0, "prefill_pct_peak": 50.0,
           "b16_vs_b1": 2.0, "prefill_vs_bf16": 1.0}


class Ours:
    def __init__(self, a, bf16: bool = False):
        import torch

        from engine import kernels
        from engine.config import EngineConfig
        from engine.core import EngineCore
        self.torch, self.kernels = torch, kernels
        # A quantized run loads llama.cpp's very file; its bf16 worker (bf16=True), the checkpoint it came from.
        src = a.model_dir if a.weights == "bf16" or bf16 else a.gguf
        # No prefix cache: every round repeats its prompts, and a hit would time a 512-token prefill as one block.
        # bf16 where an AVX-512 build runs; without one (the AVX2 build) the engine's own choice, fp32 activations,
        # as `serve` runs there.
        dtype = "bfloat16" if kernels.status()["path"] != "fallback" else "auto"
        self.core = EngineCore(EngineConfig(src, dtype=dtype, max_model_len=max_len(a), max_num_seqs=BATCH,
                                            prefix_caching=False, compact_weights=not a.no_compact))
        m = self.core.model
        mats = [w for L in getattr(m, "layers", ()) for w in (L.qkv, L.o, L.gate_up, L.down)]
        mats.append(getattr(m, "lm_head", None))
        self.ids, self.mats = itertools.count(), None
        self.info = {"kernels": kernels.status(), "torch": torch.__version__,
                     "weights_held_bytes": getattr(self.core.model, "weight_bytes", None), "rss_after_load": rss(),
                     # what a decode step of ours reads: compact bf16 matrices hold 12 bits a weight
                     "decode_read_bytes_held": sum(w.numel() * w.element_size() for w in mats if w is not None),
                     "kv_cache_bytes": self.core.runner.kv.nbytes if self.core.runner.kv is not None else None}

    def generate(self, prompts: list[list[int]], tokens: int) -> dict:
        from engine.sampling import SamplingParams
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=tokens)
        out: dict[str, list[int]] = {}
        t0 = time.perf_counter()
        for p in prompts:
            rid = str(next(self.ids))
            out[rid] = []
            self.core.add_request(rid, p, params)
        first = None
        while self.core.has_unfinished_requests():
            for o in self.core.step():
                out[o.request_id] += o.new_token_ids
            if first is None and all(out.values()):
                first = time.perf_counter()
        return {"ttft_s": first - t0, "decode_s": time.perf_counter() - first, "tokens": list(out.values())}

    def bandwidth(self, working_set: int) -> dict:
        """benchmarks/roofline.py's probe: the best of native streaming reads of 1 GiB and of the decode's working set
        and an MKL fp32 GEMV."""
        from benchmarks.roofline import read_bandwidth
        return read_bandwidth(3, self.kernels.status()["library"] is not None, working_set)  # every build has it

    def matmul_peak(self) -> dict:
        """Seconds per [512, K] x [K, N] matmul for the model's fused layer shapes, per implementation."""
        torch, kernels, s = self.torch, self.kernels, self.core.model_config
        if self.mats is None:
            shapes = {"qkv": ((s.num_heads + 2 * s.num_kv_heads) * s.head_dim, s.hidden_size),
                      "o_proj": (s.hidden_size, s.num_heads * s.head_dim),
                      "gate_up": (2 * s.intermediate_size, s.hidden_size), "down": (s.hidden_size, s.intermediate_size)}
            # A CPU without AVX-512 has no bf16 matmul worth timing (PyTorch emulates it, oneDNN refuses it): its
            # ceiling is fp32, MKL's GEMM on fp32 weights or ours on the bf16 ones widened in registers.
            bf16_matmuls = kernels.status().get("isa") not in ("avx2", "baseline")  # deploykit.isa.tier
            self.mats = {}
            for name, (n, k) in shapes.items():
                x, w = torch.randn(PREFILL, k).bfloat16(), (torch.randn(n, k) / k ** 0.5).bfloat16()
                fns = {"MKL fp32 F.linear": partial(torch.nn.functional.linear, x.float(), w.float())}
                if bf16_matmuls:
                    wp, wd = kernels.prepare_weight(w), torch.ops.mkldnn._reorder_linear_weight(w, None)
                    fns |= {"torch F.linear": partial(torch.nn.functional.linear, x, w),
                            f"engine kernels.linear ({kernels.status()['path']})": partial(kernels.linear, x, wp),
                            "oneDNN prepacked": partial(torch.ops.mkldnn._linear_pointwise, x, wd, None, "none", [],
                                                        "")}
                if kernels.bf16w_ok():
                    fns["engine kernels.linear (fp32 x, bf16 weights widened)"] = partial(
                        kernels.linear, x.float(), kernels.prepare_bf16w(w))
                self.mats[name] = (2 * PREFILL * n * k, fns)
        return {"shapes": {name: {"flop": flop, "seconds": {i: best_time(fn, 5) for i, fn in fns.items()}}
                           for name, (flop, fns) in self.mats.items()}}


class Transformers:
    def __init__(self, a):
        import torch
        import transformers
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.bfloat16).eval()
        # No EOS at all: generation always runs max_new_tokens, and greedy stays a pure argmax (min_new_tokens
        # would mask EOS instead, which changes the tokens compared with the other frameworks).
        self.model.generation_config = transformers.GenerationConfig(pad_token_id=0, eos_token_id=None)
        self.info = {"transformers": transformers.__version__, "attn": self.model.config._attn_implementation}

    def generate(self, prompts: list[list[int]], tokens: int) -> dict:
        from transformers import LogitsProcessor, LogitsProcessorList
        stamps: list[float] = []

        class Stamp(LogitsProcessor):  # called once per step, right after that step's forward
            def __call__(self, input_ids, scores):
                stamps.append(time.perf_counter())
                return scores

        ids = self.torch.tensor(prompts)  # [B, T]: equal-length prompts, so no padding
        t0 = time.perf_counter()
        with self.torch.inference_mode():
            out = self.model.generate(ids, attention_mask=self.torch.ones_like(ids), max_new_tokens=tokens,
                                      do_sample=False, logits_processor=LogitsProcessorList([Stamp()]))
        new = out[:, ids.shape[1]:].tolist()
        assert all(len(s) == tokens for s in new), "transformers stopped early"
        return {"ttft_s": stamps[0] - t0, "decode_s": stamps[-1] - stamps[0], "tokens": new}


def llamacpp_worker(a):
    from benchmarks.gguf_export import LlamaCppRunner
    return LlamaCppRunner(a.gguf, a.threads, max_len(a), PREFILL)


def max_len(a) -> int:
    """Tokens a sequence may reach: its prompt (--context) and the decoded tokens."""
    return max(MAX_LEN, a.context + a.tokens + 8)


# ours_bf16: a quantized run's prefill on the bf16 checkpoint it was quantized from, beside ours on the file (issue
# 19: a quantized 512-token prefill no slower than bf16's), in the same rounds. It runs the prefill job only.
WORKERS = {"ours": Ours, "transformers": Transformers, "llamacpp": llamacpp_worker,
           "ours_bf16": partial(Ours, bf16=True)}
PREFILL_ONLY = ("ours_bf16",)


def rss() -> dict:
    """This process's resident memory by kind (bytes): anonymous (weights, KV cache, runtime) and file-backed
    (mapped libraries; a checkpoint left mapped would show here)."""
    from deploykit import procfs
    status = procfs.read_status()
    return {k: procfs.status_bytes(status, k) for k in ("VmRSS", "RssAnon", "RssFile")}


def best_time(fn, reps: int) -> float:
    from benchmarks.roofline import best_seconds
    fn()  # warm-up: page-in, oneDNN primitive cache, AMX tile state
    return best_seconds(fn, reps)


def run_command(bench, cmd: dict) -> dict:
    """One command of a worker's stream: bench's op on the command's arguments. A prefill job's `repeat` runs it that
    many times in a row and keeps the fastest run's result, with every run's time to first token in order."""
    op, repeat = getattr(bench, cmd.pop("op")), cmd.pop("repeat", 1)
    result = op(**cmd)
    if repeat > 1:
        runs = [result] + [op(**cmd) for _ in range(repeat - 1)]
        result = {**min(runs, key=lambda r: r["ttft_s"]), "ttft_s_runs": [r["ttft_s"] for r in runs]}
    return result


def serve_worker(a) -> None:
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # print() and C libraries that print go to stderr, never into the reply stream
    from deploykit import placement
    from engine import binding
    b = binding.prepare(binding.resolve(placement.parse_binding(a.cpus)))
    if a.worker != "llamacpp":  # llama.cpp has no torch; its own libgomp reads the affinity env set above
        binding.finish(b)
    bench = WORKERS[a.worker](a)
    reply.write(json.dumps(bench.info) + "\n")
    for line in sys.stdin:
        cmd, cpu = json.loads(line), sum(os.times()[:2])
        try:
            result = run_command(bench, cmd)
        except Exception as e:  # noqa: BLE001 -- reported to the parent, which records it and goes on
            result = {"error": f"{type(e).__name__}: {e}"}
        reply.write(json.dumps({**result, "cpu_s": sum(os.times()[:2]) - cpu}) + "\n")  # all threads


class Worker:
    """Parent side of one worker process: a JSON command per line in, a JSON result per line out."""

    def __init__(self, kind: str, a, cpus: str, threads: int):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
        self.kind, self.proc = kind, subprocess.Popen(
            [sys.executable, __file__, "--worker", kind, "--model-dir", str(a.model_dir), "--cpus", cpus,
             "--threads", str(threads), "--gguf", str(a.gguf), "--weights", a.weights, "--context", str(a.context),
             "--tokens", str(a.tokens)]
            + (["--no-compact"] if a.no_compact else []),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)

    def call(self, op: str | None = None, **kwargs) -> dict:
        if op is not None:
            self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.kind} worker exited with code {self.proc.wait()} (its stderr is above)")
        return json.loads(line)


def ensure_model(model_dir: Path) -> bool:
    """Generate the benchmark model once (True when generated now): written aside, then renamed into place."""
    if (model_dir / "config.json").is_file():
        return False
    from engine.tinymodel import make_tiny_model
    tmp = model_dir.with_name(model_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    make_tiny_model(str(tmp), **SHAPE, dtype="bfloat16", max_position_embeddings=2048)
    os.replace(tmp, model_dir)
    return True


def weight_stats(model_dir: Path) -> dict:
    """Parameter and byte counts from the safetensors headers (no tensor data is read)."""
    index = model_dir / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {"model.safetensors"}
    meta: dict[str, dict] = {}
    for f in files:
        with open(model_dir / f, "rb") as fh:  # u64 header length, then the JSON header
            meta.update(json.loads(fh.read(int.from_bytes(fh.read(8), "little"))))
    meta.pop("__metadata__", None)
    nbytes = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in meta.items()}
    tied, total = "lm_head.weight" not in meta, sum(nbytes.values())
    embed = sum(n for k, n in nbytes.items() if k.endswith("embed_tokens.weight"))
    # One decode step reads every weight once, except the embedding table (a row gather) unless it is the lm_head.
    return {"params": sum(math.prod(v["shape"]) for v in meta.values()), "bytes": total,
            "decode_read_bytes": total - (0 if tied else embed), "tied_embeddings": tied,
            "layer_matmul_params": sum(math.prod(v["shape"]) for k, v in meta.items()
                                       if ".layers." in k and len(v["shape"]) == 2)}


def gguf_weight_stats(path: str) -> dict:
    """weight_stats for a (quantized) GGUF file: the bytes its tensors take in the file, which is what both engines
    hold and stream (llama.cpp by design; ours keeps the blocks, repacked at the same size but for a few bytes)."""
    from deploykit import gguf
    h = gguf.read(path)
    nbytes = {t.name: t.nbytes for t in h.tensors}
    tied, total = "output.weight" not in nbytes, sum(nbytes.values())
    return {"params": h.num_parameters, "bytes": total, "file": path, "types": dict(sorted(Counter(t.type_name for t in h.tensors).items())),
            "decode_read_bytes": total - (0 if tied else nbytes["token_embd.weight"]), "tied_embeddings": tied,
            "layer_matmul_params": sum(t.numel for t in h.tensors if t.name.startswith("blk.") and len(t.shape) == 2)}


def stats(xs: list[float], nd: int = 2, lower_is_better: bool = False, samples: bool = True) -> dict:
    out = {"best": round(min(xs) if lower_is_better else max(xs), nd), "median": round(median(xs), nd)}
    return {**out, "samples": [round(x, nd) for x in xs]} if samples else out


def jobs_for(kinds: list[str], vocab: int, tokens: int, read_bytes: int,
             context: int = PROMPT) -> list[tuple[str, str, str, dict]]:
    """(result name, worker, op, arguments) of one round. Prompt ids skip 0-2, the special tokens. read_bytes: what a
    decode step reads from the file, the bandwidth probe's working set; context: each decode prompt's tokens."""
    ids = range(3, vocab)
    p1, pre = [random.Random(1).choices(ids, k=context)], [random.Random(2).choices(ids, k=PREFILL)]
    p16 = [random.Random(100 + i).choices(ids, k=context) for i in range(BATCH)]
    everything, kinds = kinds, [k for k in kinds if k not in PREFILL_ONLY]
    return ([("bandwidth", "ours", "bandwidth", {"working_set": read_bytes})]
            + [(f"decode_b1/{k}", k, "generate", {"prompts": p1, "tokens": tokens}) for k in kinds]
            + [(f"decode_b{SMALL_BATCH}/{k}", k, "generate", {"prompts": p16[:SMALL_BATCH], "tokens": tokens})
               for k in kinds if k != "transformers"]
            + [(f"decode_b{BATCH}/{k}", k, "generate", {"prompts": p16, "tokens": tokens}) for k in kinds]
            + [(f"prefill/{k}", k, "generate", {"prompts": pre, "tokens": 1, "repeat": PREFILL_REPEAT})
               for k in everything]
            + [("matmul_peak", "ours", "matmul_peak", {})])


def measure(worker: Worker, cpus: tuple[int, ...], op: str, kw: dict) -> dict:
    """One measurement, retried while other processes used > FOREIGN_MAX of our CPUs (the host is shared)."""
    from deploykit import procfs
    for attempt in range(RETRIES + 1):
        busy, t0 = procfs.busy_seconds(cpus), time.perf_counter()
        res = worker.call(op, **kw)
        res["foreign_load"] = round((procfs.busy_seconds(cpus) - busy - res.pop("cpu_s", 0.0))
                                    / (len(cpus) * (time.perf_counter() - t0)), 3)
        if "error" in res or res["foreign_load"] <= FOREIGN_MAX or attempt == RETRIES:
            return {**res, "retries": attempt}
        print(f"  other processes took {res['foreign_load']:.0%} of the CPUs; measuring again", file=sys.stderr)
        time.sleep(3)


def run_rounds(workers: dict[str, Worker], jobs: list, rounds: int, cpus: tuple[int, ...],
               notes: list[str]) -> dict[str, list[dict]]:
    samples: dict[str, list[dict]] = {}
    live = []
    for job in jobs:  # warm-up pass with short decodes; a job failing here is dropped with a note
        name, kind, op, kw = job
        res = workers[kind].call(op, **({**kw, "tokens": min(kw["tokens"], 4)} if "tokens" in kw else kw))
        if "error" in res:
            notes.append(f"{name} failed and was skipped: {res['error']}")
        else:
            live.append(job)
    for r in range(rounds):
        for name, kind, op, kw in (live if r % 2 == 0 else live[::-1]):
            res = measure(workers[kind], cpus, op, kw)
            if "error" in res or res["foreign_load"] > FOREIGN_MAX:
                notes.append(f"{name} round {r + 1}: {res.get('error') or 'disturbed by other processes'}")
            if "error" not in res:
                samples.setdefault(name, []).append(res)
            shown = {k: round(v, 3) for k, v in res.items() if k in ("ttft_s", "decode_s", "foreign_load")}
            print(f"round {r + 1}/{rounds} {name} {shown}", file=sys.stderr)
    return samples


def summarize(samples: dict[str, list[dict]], w: dict, tokens: int) -> dict:
    out: dict = {"decode_tok_s": {}, "prefill_512": {}}
    if bw := samples.get("bandwidth"):
        by_round = [max(s["stream_read_gbps"], s["fp32_gemv_gbps"]) for s in bw]
        best = max(by_round)
        out["bandwidth_gbps"] = {"best": round(best, 1), "stream_read": stats([s["stream_read_gbps"] for s in bw], 1),
                                 "fp32_gemv": stats([s["fp32_gemv_gbps"] for s in bw], 1),
                                 "by_round": [round(g, 1) for g in by_round],
                                 "stream_probe": bw[0]["stream_read_probe"]}
        for part in ("stream_read_1gib", "working_set"):  # what the stream read's best came from
            if all(f"{part}_gbps" in s for s in bw):
                out["bandwidth_gbps"][part] = stats([s[f"{part}_gbps"] for s in bw], 1)
        out["roofline_tok_s"] = round(best * 1e9 / w["decode_read_bytes"], 2)
        out["roofline_tok_s_by_round"] = [round(g * 1e9 / w["decode_read_bytes"], 2) for g in by_round]
    if mm := [s["shapes"] for s in samples.get("matmul_peak", ())]:
        flop = {shape: r["flop"] for shape, r in mm[0].items()}
        sec = {shape: {i: min(s[shape]["seconds"][i] for s in mm) for i in r["seconds"]} for shape, r in mm[0].items()}
        tf = {shape: {i: round(flop[shape] / t / 1e12, 3) for i, t in r.items()} for shape, r in sec.items()}
        # The peak a prefill's matmuls can reach: one layer's FLOP mix, each shape on its fastest implementation;
        # over all rounds, and each round's own (for the prefill share paired by round).
        def peak_of(seconds: dict[str, dict[str, float]]) -> float:
            return sum(flop.values()) / sum(min(seconds[shape].values()) for shape in flop) / 1e12
        fastest = {s: min(r, key=r.get) for s, r in sec.items()}
        peak = peak_of(sec)
        by_round = [peak_of({shape: r[shape]["seconds"] for shape in flop}) for r in mm]
        out["matmul_bf16_m512"] = {"peak_tflops": round(peak, 3), "peak_from": fastest, "tflops_by_shape": tf,
                                   "peak_tflops_by_round": [round(t, 3) for t in by_round]}
    for name, ss in samples.items():
        kind, b = name.partition("/")[2], len(ss[0].get("tokens", ()))
        if name.startswith("decode"):
            out["decode_tok_s"][name[7:]] = {
                **stats([b * (tokens - 1) / s["decode_s"] for s in ss]),
                "ttft_s": stats([s["ttft_s"] for s in ss], 4, True, samples=False)}
        elif name.startswith("prefill"):
            tflops = [2 * w["layer_matmul_params"] * PREFILL / s["ttft_s"] / 1e12 for s in ss]
            out["prefill_512"][kind] = {"ttft_s": stats([s["ttft_s"] for s in ss], 4, True),
                                        "ttft_first_run_s": stats([s.get("ttft_s_runs", [s["ttft_s"]])[0]
                                                                   for s in ss], 4, True, samples=False),
                                        "tflops": stats(tflops, 3, samples=False),
                                        "tflops_by_round": [round(t, 3) for t in tflops]}
    return out


def ratios(s: dict) -> tuple[dict, dict]:
    d, pre = s["decode_tok_s"], s["prefill_512"]
    roof, peak = ({"best": v, "median": v} if v else None
                  for v in (s.get("roofline_tok_s"), s.get("matmul_bf16_m512", {}).get("peak_tflops")))
    pairs = {"b1_pct_roofline": (d.get("b1/ours"), roof, 100),
             "b1_vs_llamacpp": (d.get("b1/ours"), d.get("b1/llamacpp"), 1),
             f"b{BATCH}_vs_transformers_b{BATCH}": (d.get(f"b{BATCH}/ours"), d.get(f"b{BATCH}/transformers"), 1),
             "prefill_pct_peak": (pre.get("ours", {}).get("tflops"), peak, 100),
             "b1_vs_transformers_b1": (d.get("b1/ours"), d.get("b1/transformers"), 1),
             f"b{SMALL_BATCH}_vs_b1": (d.get(f"b{SMALL_BATCH}/ours"), d.get("b1/ours"), 1),
             f"b{BATCH}_vs_b1": (d.get(f"b{BATCH}/ours"), d.get("b1/ours"), 1),
             f"b{SMALL_BATCH}_vs_llamacpp_b{SMALL_BATCH}": (d.get(f"b{SMALL_BATCH}/ours"),
                                                          d.get(f"b{SMALL_BATCH}/llamacpp"), 1),
             f"b{BATCH}_vs_llamacpp_b{BATCH}": (d.get(f"b{BATCH}/ours"), d.get(f"b{BATCH}/llamacpp"), 1),
             f"llamacpp_b{BATCH}_vs_b1": (d.get(f"b{BATCH}/llamacpp"), d.get("b1/llamacpp"), 1),
             "llamacpp_b1_pct_roofline": (d.get("b1/llamacpp"), roof, 100),
             "prefill_vs_llamacpp": (pre.get("ours", {}).get("tflops"), pre.get("llamacpp", {}).get("tflops"), 1),
             "prefill_vs_bf16": (pre.get("ours", {}).get("tflops"), pre.get("ours_bf16", {}).get("tflops"), 1)}
    out = {k: None if a is None or b is None else {m: round(f * a[m] / b[m], 2) for m in ("best", "median")}
           for k, (a, b, f) in pairs.items()}
    # Rounds alternate between the frameworks, so a round's ratio compares them under the same memory bandwidth,
    # which on a shared VM swings by up to 2x between minutes; the median of those is the steadiest ratio.
    for key, b in (("b1_vs_llamacpp", 1), (f"b{BATCH}_vs_llamacpp_b{BATCH}", BATCH)):
        if (ours := d.get(f"b{b}/ours")) and (peer := d.get(f"b{b}/llamacpp")):
            out[key]["paired_median"] = round(median(o / p for o, p in zip(ours["samples"], peer["samples"])), 2)
    # The same for the roofline: each round's decode against that round's own probe, so a run in which the host
    # changes bandwidth regime does not hold one regime's tok/s to the other's roofline.
    for key, who in (("b1_pct_roofline", "ours"), ("llamacpp_b1_pct_roofline", "llamacpp")):
        if out[key] and (pct := paired_pct_roofline(s, d.get(f"b1/{who}"))) is not None:
            out[key]["paired_median"] = pct
    # And the prefill against the matmul peak: both are tile work, which a busy neighbour on this VM's cores slows by
    # up to 4x for seconds at a time, so a best prefill and a best peak may come from different minutes.
    if out["prefill_pct_peak"] and (pct := paired_pct_peak(s)) is not None:
        out["prefill_pct_peak"]["paired_median"] = pct
    # A quantized prefill against the bf16 one: the two run back to back in every round.
    if out["prefill_vs_bf16"] and (r := paired_ratio(pre["ours"], pre["ours_bf16"])) is not None:
        out["prefill_vs_bf16"]["paired_median"] = r
    targets = {k: {"target": v, "value": (out[k] or {}).get("best"),
                   "pass": None if out[k] is None else out[k]["best"] >= v} for k, v in TARGETS.items()}
    return out, targets


def paired_median(xs: list[float] | None, ys: list[float] | None, scale: float, nd: int) -> float | None:
    """Median over rounds of scale * x / y, x and y from the same round; None when a round is missing on either side
    (a failed or skipped job), since rounds would then pair wrongly."""
    if not xs or not ys or len(xs) != len(ys):
        return None
    return round(median(scale * x / y for x, y in zip(xs, ys)), nd)


def paired_pct_roofline(s: dict, decode: dict | None) -> float | None:
    """A decode's tok/s as a % of the roofline from the same round's bandwidth probe, median over rounds."""
    return paired_median(decode and decode["samples"], s.get("roofline_tok_s_by_round"), 100, 2)


def paired_ratio(a: dict, b: dict) -> float | None:
    """a's TFLOP/s over b's in the same round, median over rounds."""
    return paired_median(a.get("tflops_by_round"), b.get("tflops_by_round"), 1, 3)


def paired_pct_peak(s: dict) -> float | None:
    """Our 512-token prefill's TFLOP/s as a % of the matmul peak measured in the same round (its neighbouring job),
    median over rounds."""
    return paired_median(s.get("prefill_512", {}).get("ours", {}).get("tflops_by_round"),
                         s.get("matmul_bf16_m512", {}).get("peak_tflops_by_round"), 100, 2)


def regime_note(s: dict, spread: float = 1.2) -> str | None:
    """A note when the probe's rounds differ by more than `spread`x: best-of roofline percentages then compare a
    fast-DRAM round's probe with any round's decode (this host's bandwidth moves between ~30 and ~60 GB/s)."""
    by_round = s.get("bandwidth_gbps", {}).get("by_round") or []
    if len(by_round) < 2 or max(by_round) <= spread * min(by_round):
        return None
    return (f"the bandwidth probe read {min(by_round)}-{max(by_round)} GB/s across rounds (the host changed memory "
            "regime during the run): trust the paired_median roofline percentages, which hold each round's decode "
            "to its own probe, over best/median")


def agreeing_prefix(xs: list[list[int]], ys: list[list[int]]) -> list[int]:
    """Per sequence, how many leading tokens two greedy continuations share."""
    return [next((i for i, (u, v) in enumerate(zip(x, y, strict=True)) if u != v), len(x))
            for x, y in zip(xs, ys, strict=True)]


def greedy_agreement(samples: dict, tokens: int, batch_vs_single: dict) -> dict:
    """Common-prefix lengths of two frameworks' greedy continuations of the same prompts (first timed round), and of
    each framework's batch against its own single-sequence runs."""
    out = {}
    for b, (k1, k2) in itertools.product(("b1", f"b{SMALL_BATCH}", f"b{BATCH}"), itertools.combinations(WORKERS, 2)):
        if (s1 := samples.get(f"decode_{b}/{k1}")) and (s2 := samples.get(f"decode_{b}/{k2}")):
            out[f"{b}/{k1}_vs_{k2}"] = agreeing_prefix(s1[0]["tokens"], s2[0]["tokens"])
    return {"of_tokens": tokens, "agreeing_prefix": out, f"b{BATCH}_vs_single_sequence": batch_vs_single}


def batch_vs_single(workers: dict[str, Worker], samples: dict, jobs: list, tokens: int) -> dict:
    """Each framework's batch-16 greedy tokens (first timed round) against the same prompts run one at a time by the
    same framework, as agreeing-prefix lengths per sequence. Batched numerics (other matmul kernels, another
    reduction order) may flip a near-tie argmax late; a batch that mixes sequences up differs from the start."""
    out: dict = {}
    for name, kind, _, kw in jobs:
        if name.startswith(f"decode_b{BATCH}/") and (ss := samples.get(name)):
            single = [workers[kind].call("generate", prompts=[p], tokens=tokens) for p in kw["prompts"]]
            errors = [r["error"] for r in single if "error" in r]
            out[kind] = errors[0] if errors else agreeing_prefix(ss[0]["tokens"], [r["tokens"][0] for r in single])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per decode measurement")
    ap.add_argument("--context", type=int, default=PROMPT,
                    help="prompt tokens before each decode measurement: a long one times the decode steps' attention "
                         "over that many keys (every sequence has its own prompt)")
    ap.add_argument("--threads", type=int, default=None, help="default: one per core, as `serve --binding auto`")
    ap.add_argument("--quick", action="store_true", help="smoke run: one round of 8-token decodes")
    for flag in ("--skip-transformers", "--skip-llamacpp"):
        ap.add_argument(flag, action="store_true")
    ap.add_argument("--no-compact", action="store_true",
                    help="ours holds bf16 matrices in 16 bits, not compact (12 bits, lossless; the default)")
    ap.add_argument("--allow-fallback", action="store_true",
                    help="measure ours on the PyTorch path when the native kernels are not loaded (default: stop)")
    ap.add_argument("--weights", default="bf16", choices=["bf16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M"],
                    help="bf16: the safetensors; else ours and llama.cpp on the same llama.cpp-quantized GGUF")
    for hidden in ("--worker", "--cpus", "--gguf"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return serve_worker(a)
    if a.quick:
        a.rounds, a.tokens = 1, 8
    cfg = json.loads((a.model_dir / "config.json").read_text()) if (a.model_dir / "config.json").is_file() else {}
    if a.context < 1 or max_len(a) > cfg.get("max_position_embeddings", max_len(a)):
        raise SystemExit(f"--context {a.context}: a sequence of {a.context} + {a.tokens} tokens (+ 8) must fit the "
                         f"model's {cfg['max_position_embeddings']} positions; use a shorter --context or --tokens"
                         if a.context >= 1 else f"--context {a.context}: use at least 1")
    from deploykit import cpulist
    from engine import binding
    b = binding.resolve("auto" if a.threads is None else tuple(sorted(os.sched_getaffinity(0))[:a.threads]))
    notes, load_before = [], os.getloadavg()
    generated = ensure_model(a.model_dir)
    if a.weights != "bf16":  # transformers has no kernels for GGUF blocks: it would dequantize, which is not a peer
        a.skip_transformers = True
    kinds, gguf_check = ["ours"] + ([] if a.skip_transformers else ["transformers"]), None
    if importlib.util.find_spec("llama_cpp") is None and a.weights != "bf16":
        raise SystemExit(f"--weights {a.weights} needs llama_cpp to quantize the file (benchmarks/README.md)")
    if not a.skip_llamacpp and importlib.util.find_spec("llama_cpp") is None:
        notes.append("llama.cpp not measured: llama_cpp is not importable (benchmarks/README.md says how to install)")
    elif not a.skip_llamacpp:
        from benchmarks.gguf_export import ensure_gguf
        a.gguf, gguf_check = ensure_gguf(str(a.model_dir))
        kinds.append("llamacpp")
    if a.weights != "bf16":
        from benchmarks.gguf_export import ensure_gguf, ensure_quantized
        a.gguf = ensure_quantized(a.gguf or ensure_gguf(str(a.model_dir))[0], a.weights)
        kinds.insert(1, "ours_bf16")  # its prefill job runs right after ours's in every round
    w = weight_stats(a.model_dir) if a.weights == "bf16" else gguf_weight_stats(a.gguf)
    cfg = json.loads((a.model_dir / "config.json").read_text())
    workers = {k: Worker(k, a, cpulist.format(b.cpus), b.threads) for k in kinds}
    try:
        infos = {k: wk.call() for k, wk in workers.items()}  # the ready line: each worker has loaded its model
        kern = infos["ours"]["kernels"]
        # Minutes of rounds that would measure the wrong path. The AVX2 build's right path: fp32 activations, a
        # quantized file's blocks on its int8 GEMV, a bf16 checkpoint's matrices widened in registers.
        avx2_build = kern["path"] == "fallback" and (kern["quantized"] if a.weights != "bf16"
                                                     else kern.get("bf16_weights_in_fp32", False))
        if kern["path"] == "fallback" and not avx2_build and not a.allow_fallback:
            raise SystemExit(f"ours runs on the PyTorch fallback ({kern['reason']}): build the kernels with "
                             "`python -m engine.kernels build`, or pass --allow-fallback to measure that path")
        jobs = jobs_for(kinds, cfg["vocab_size"], a.tokens, w["decode_read_bytes"], a.context)
        samples = run_rounds(workers, jobs, a.rounds, b.cpus, notes)
        print("batch against single sequences ...", file=sys.stderr)
        single = batch_vs_single(workers, samples, jobs, a.tokens)
    finally:
        for wk in workers.values():
            wk.proc.stdin.close()
            wk.proc.wait(60)
    s = summarize(samples, w, a.tokens)
    derived, targets = ratios(s)
    held = infos["ours"].get("decode_read_bytes_held")
    if held and s.get("roofline_tok_s") and (b1 := s["decode_tok_s"].get("b1/ours")):
        # Against the bytes ours reads (compact bf16 reads 3/4 of the file's): how close the kernels run to memory.
        roof_held = s["roofline_tok_s"] * w["decode_read_bytes"] / held
        derived["b1_pct_roofline_of_bytes_read"] = {m: round(100 * b1[m] / roof_held, 2) for m in ("best", "median")}
        if (paired := (derived.get("b1_pct_roofline") or {}).get("paired_median")) is not None:
            derived["b1_pct_roofline_of_bytes_read"]["paired_median"] = round(paired * held / w["decode_read_bytes"], 2)
    if note := regime_note(s):
        notes.append(note)
    if avx2_build:
        held_as = "quantized weights on its int8 GEMV" if a.weights != "bf16" else \
            "bf16 matrices widened to fp32 in registers (bf16w_linear)"
        notes.append(f"ours on the {kern['variant']} build, fp32 activations: {held_as}; fp32 norms, rotary, SiLU "
                     "and decode attention on its f32_ops")
    elif kern["path"] == "fallback":
        notes.append(f"engine kernels are NOT native ({kern['reason']}); build: python -m engine.kernels build")
    print(json.dumps({
        "benchmark": "engine_vs_transformers_vs_llamacpp",
        "model": {"dir": str(a.model_dir), "generated_now": generated, **w, **{k: cfg.get(k) for k in (
            "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size", "dtype")}},
        "machine": {"cpus": cpulist.format(b.cpus), "threads": b.threads, "isa": kern["isa"],
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "workers": infos},
        "settings": {"weights": a.weights, "compact": not a.no_compact, "rounds": a.rounds, "decode_tokens": a.tokens,
                     "decode_prompt_tokens": a.context,
                     "batch": BATCH, "small_batch": SMALL_BATCH, "prefill_tokens": PREFILL,
                     "prefill_repeat": PREFILL_REPEAT, "quick": a.quick},
        **s, "ratios": derived, "targets": targets,
        "retried_for_foreign_load": {k: sum(x["retries"] for x in v) for k, v in samples.items()},
        "validation": {"gguf": gguf_check, "greedy_agreement": greedy_agreement(samples, a.tokens, single)},
        "method": METHOD, "notes": notes}, indent=1))


METHOD = ("roofline = best bandwidth / bytes a decode step reads (all weights but the embedding table); bandwidth = "
          "the best of native reads of 1 GiB and of a buffer of those bytes (1-8 streams a thread, with and without "
          "an L2 prefetch 4 KiB ahead) and an MKL fp32 GEMV; prefill "
          "TFLOP/s = 2 * decoder-layer matmul params * 512 / TTFT, the best of prefill_repeat prompts in a row in "
          "each round (ttft_first_run_s: the first of them; prefill_vs_bf16: a quantized file's against "
          "the bf16 checkpoint's, both ours, in the same rounds); matmul peak = [512,K]x[K,N] on one layer's "
          "shapes (FLOP-weighted), each on its fastest implementation (bf16 ones, or MKL fp32 where faster); "
          "paired_median: the median over rounds of a figure against the same round's probe or peak")


if __name__ == "__main__":
    main()
