"""HTTP + SSE overhead of the server: the same streaming load through `python -m engine serve` and through
EngineCore directly (same binding, same process layout), in one run. Prints JSON on stdout.

Run: flock /tmp/deploykit-heavy.lock python benchmarks/server.py [--model DIR] [--streams 16] [--max-tokens 128]

Without --model a random-weight model is generated (hidden/layers flags set its size; the default is big enough
that a decode step costs about what a small real model's does on 2 cores, so the ratio is meaningful). The HTTP
client is `deploykit bench`'s (deploykit/bench/stream.py), which takes 22-27 µs of CPU an event where httpx takes
176-232: it shares the CPUs it measures, and its CPU a token is reported next to the front end's. Rounds alternate
direct/HTTP (the host is shared) and the best round of each is kept; overhead_pct_paired_median compares each HTTP round
with the direct round of the same iteration.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from deploykit import procfs  # noqa: E402  (after the path: run as a script from anywhere)
from deploykit.bench import client  # noqa: E402

DIRECT = """
import json, sys, time
from deploykit import cpulist, placement
from engine import binding
a = json.loads(sys.argv[1])
front = cpulist.parse(a["frontend_cpus"]) if a["frontend_cpus"] else None
b = binding.prepare(binding.resolve(placement.parse_binding(a["binding"]), frontend_cpus=front))
import torch
binding.finish(b)
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.sampling import SamplingParams
core = EngineCore(EngineConfig(a["model"], max_model_len=a["max_model_len"], max_num_seqs=a["streams"]))
params = SamplingParams(max_tokens=a["max_tokens"], temperature=0.0, ignore_eos=True)
for r, _ in enumerate(sys.stdin):  # one round per line, so rounds interleave with the HTTP ones
    t0 = time.perf_counter()
    for i, ids in enumerate(a["prompts"]):
        core.add_request(f"{r}-{i}", ids, params)
    tokens = 0
    while core.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in core.step())
    print(json.dumps({"wall_s": time.perf_counter() - t0, "tokens": tokens}), flush=True)
"""


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_stream(port: int, model: str, prompt: list[int], max_tokens: int) -> client.Result:
    """One streamed greedy completion; raises if it failed."""
    [r] = await client.run_level(client.Workload(f"http://127.0.0.1:{port}", model, max_tokens), [prompt],
                                 concurrency=1, requests=1)
    if r.error:
        raise RuntimeError(f"the stream failed: {r.error}")
    return r


async def http_round(port: int, model: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """One streamed greedy completion per prompt, all at once, through `deploykit bench`'s client (uvloop, one
    Protocol a connection, each SSE event handled where its bytes arrive): it shares the CPUs it measures."""
    w = client.Workload(f"http://127.0.0.1:{port}", model, max_tokens)
    cpu, t0 = client.cpu_seconds(), time.perf_counter()
    results = await client.run_level(w, prompts, concurrency=len(prompts), requests=len(prompts))
    wall, cpu = time.perf_counter() - t0, client.cpu_seconds() - cpu
    bad = [r.error for r in results if r.error]
    if bad:
        raise RuntimeError(f"{len(bad)} streams failed: {bad[0]}")
    ttfts = sorted(r.ttft for r in results)
    gaps = sorted(g for r in results for g in r.itl)
    return {"wall_s": wall, "tokens": sum(r.output_tokens for r in results),
            "events": sum(r.chunks for r in results), "client_cpu_s": cpu,
            "ttft_p50_s": ttfts[len(ttfts) // 2], "itl_p50_s": gaps[len(gaps) // 2],
            "itl_p99_s": gaps[int(len(gaps) * 0.99)], "itl_max_s": gaps[-1]}


def clean_env() -> dict:
    """This environment without OpenMP or deploykit settings: the server and the direct run bind themselves."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_", "DEPLOYKIT_"))}


class Server:
    """`python -m engine serve MODEL ARGS` on a free loopback port: `with Server(...) as port`, healthy inside, sent
    SIGTERM and awaited on the way out. Its log goes to LOGDIR."""

    def __init__(self, model: str, logdir: str, *args: str, env: dict | None = None):
        self.port = free_port()
        self.log = open(f"{logdir}/server-{self.port}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", model, "--host", "127.0.0.1", "--port",
                                      str(self.port), "--no-access-log", *args], cwd=ROOT, env=env or clean_env(),
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self) -> int:
        import httpx
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    self.model = httpx.get(f"http://127.0.0.1:{self.port}/v1/models", timeout=5).json()["data"][0]["id"]
                    return self.port
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise SystemExit(f"server did not start:\n{Path(self.log.name).read_text()}")
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)
        self.log.close()


def variant(text: str) -> tuple[str, list[str], dict]:
    """NAME=ARGS: a server configuration to measure, e.g. "nice=--frontend-nice 10" or "env=VAR=1 --flag"."""
    name, _, rest = text.partition("=")
    env = dict(w.split("=", 1) for w in rest.split() if "=" in w and not w.startswith("-"))
    return name, [w for w in rest.split() if not ("=" in w and not w.startswith("-"))], env


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--binding", default="auto", help="as `serve --binding`; the direct run uses the same")
    ap.add_argument("--frontend-cpus", default=None, help="as `serve --frontend-cpus`")
    ap.add_argument("--variant", action="append", type=variant, default=[], metavar="NAME=ARGS",
                    help="a server configuration (extra serve flags, VAR=VALUE environment); repeatable: every "
                         "variant is measured in the same run, rounds interleaved (default: one, 'serve')")
    a = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="bench-server-")
    model = a.model
    if model is None:
        from engine.tinymodel import make_tiny_model
        model = make_tiny_model(f"{tmp.name}/model", hidden=a.hidden, layers=a.layers, heads=8, kv_heads=4,
                                intermediate=a.hidden * 3)
    max_len = a.prompt_tokens + a.max_tokens
    prompts = [[(7 * i + 13 * j) % 900 + 3 for j in range(a.prompt_tokens)] for i in range(a.streams)]
    direct = subprocess.Popen([sys.executable, "-c", DIRECT, json.dumps(
        {"model": model, "max_model_len": max_len, "streams": a.streams, "max_tokens": a.max_tokens,
         "prompts": prompts, "binding": a.binding, "frontend_cpus": a.frontend_cpus})],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=clean_env())

    def direct_round() -> dict:
        direct.stdin.write("go\n")
        direct.stdin.flush()
        return json.loads(direct.stdout.readline())

    common = ["--max-model-len", str(max_len), "--max-num-seqs", str(a.streams), "--binding", a.binding,
              *(["--frontend-cpus", a.frontend_cpus] if a.frontend_cpus else [])]
    variants = a.variant or [("serve", [], {})]
    servers = {name: Server(model, tmp.name, *common, *args, env=clean_env() | env) for name, args, env in variants}
    rounds: dict[str, list[dict]] = {"direct": [], **{name: [] for name in servers}}
    try:
        ports = {name: s.__enter__() for name, s in servers.items()}
        direct_round()
        for name, port in ports.items():  # warm-up
            client.run(http_round(port, servers[name].model, prompts, a.max_tokens))
        for _ in range(a.rounds):  # interleaved, so every configuration sees the same background load
            rounds["direct"].append(direct_round())
            for name, port in ports.items():
                front = servers[name].proc.pid
                engine = procfs.children(front)[0]
                cpu = procfs.read_stat(front).cpu_seconds, procfs.read_stat(engine).cpu_seconds
                r = client.run(http_round(port, servers[name].model, prompts, a.max_tokens))
                r["frontend_cpu_s"] = procfs.read_stat(front).cpu_seconds - cpu[0]
                r["engine_cpu_s"] = procfs.read_stat(engine).cpu_seconds - cpu[1]
                rounds[name].append(r)
    finally:
        for s in servers.values():
            s.__exit__()
        direct.stdin.close()
        direct.wait(60)

    def tps(r: dict) -> float:
        return r["tokens"] / r["wall_s"]

    def best(rs: list[dict]) -> dict:
        return min(rs, key=lambda r: r["wall_s"])

    d = best(rounds["direct"])
    d_tps = d["tokens"] / d["wall_s"]
    out = {
        "model": {"path": model if a.model else f"random hidden={a.hidden} layers={a.layers}"},
        "streams": a.streams, "max_tokens": a.max_tokens, "prompt_tokens": a.prompt_tokens,
        "cpus": len(os.sched_getaffinity(0)), "binding": a.binding, "frontend_cpus": a.frontend_cpus or "shared",
        "direct": {"tokens_per_s": round(d_tps, 1), "wall_s": round(d["wall_s"], 3),
                   "rounds_wall_s": [round(r["wall_s"], 3) for r in rounds["direct"]]},
        "target_overhead_pct": 5.0,
        "expected_tokens": a.streams * a.max_tokens,
    }
    for name, args, env in variants:
        rs = rounds[name]
        h = best(rs)
        overhead = 100 * (1 - h["tokens"] / h["wall_s"] / d_tps)  # best round vs best round
        out[name] = {
            "serve_args": " ".join([*args, *(f"{k}={v}" for k, v in env.items())]),
            "tokens_per_s": round(h["tokens"] / h["wall_s"], 1), "wall_s": round(h["wall_s"], 3),
            "overhead_pct": round(overhead, 2),
            "overhead_pct_median": round(100 * (median(r["wall_s"] for r in rs)
                                                / median(r["wall_s"] for r in rounds["direct"]) - 1), 2),
            # each round against the same iteration's direct round (the same minute of this VM), as overhead_pct
            "overhead_pct_paired_median": round(median(100 * (1 - tps(r) / tps(dr))
                                                       for dr, r in zip(rounds["direct"], rs)), 2),
            "meets_target": overhead < 5.0, "tokens_checked": h["tokens"], "sse_events": h["events"],
            "ttft_p50_s": round(median(r["ttft_p50_s"] for r in rs), 4),
            # CPU time per generated token: the front end's is what it takes from the inference CPUs when it shares them
            "frontend_cpu_us_per_token": round(1e6 * median(r["frontend_cpu_s"] / r["tokens"] for r in rs), 1),
            "engine_cpu_us_per_token": round(1e6 * median(r["engine_cpu_s"] / r["tokens"] for r in rs), 1),
            # the load generator's: on the same CPUs, so it counts in the overhead too
            "client_cpu_us_per_token": round(1e6 * median(r["client_cpu_s"] / r["tokens"] for r in rs), 1),
            "itl_p50_ms": round(1000 * median(r["itl_p50_s"] for r in rs), 2),
            "itl_p99_ms": round(1000 * median(r["itl_p99_s"] for r in rs), 2),
            "itl_max_ms": round(1000 * max(r["itl_max_s"] for r in rs), 2),
            "rounds_wall_s": [round(r["wall_s"], 3) for r in rs]}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
