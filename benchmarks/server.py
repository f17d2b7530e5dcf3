"""HTTP + SSE overhead of the server: the same streaming load through `python -m engine serve` and through
EngineCore directly (same binding, same process layout), in one run. Prints JSON on stdout.

Run: flock /tmp/deploykit-heavy.lock python benchmarks/server.py [--model DIR] [--streams 16] [--max-tokens 128]

Without --model a random-weight model is generated (hidden/layers flags set its size; the default is big enough
that a decode step costs about what a small real model's does on 2 cores, so the ratio is meaningful). The HTTP
client is a minimal asyncio one (counts SSE events) so that client-side parsing steals as little CPU as possible
from the server on a small machine. Rounds alternate direct/HTTP (the host is shared) and the best round of each is kept.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DIRECT = """
import json, sys, time
from engine import binding
a = json.loads(sys.argv[1])
b = binding.prepare(binding.resolve(a["binding"], frontend_cpus=a["frontend_cpus"]))
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


async def one_stream(port: int, prompt: list[int], max_tokens: int) -> tuple[float, int, int]:
    """(time to first token, SSE events before [DONE], completion tokens from the usage chunk) over one raw
    HTTP/1.1 connection."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    buf, events, ttft = b"", 0, None
    while b"data: [DONE]" not in buf:
        data = await reader.read(65536)
        if not data:
            raise RuntimeError(f"connection closed early: {buf[-300:]!r}")
        if ttft is None and b"data: {" in data:
            ttft = time.perf_counter() - t0
        events += data.count(b"data: {")
        buf = buf[-4096:] + data
    writer.close()
    usage = re.findall(rb'"completion_tokens":\s*(\d+)', buf)
    if not usage:
        raise RuntimeError(f"no usage chunk before [DONE]: {buf[-300:]!r}")
    return ttft or 0.0, events - 1, int(usage[-1])  # the usage chunk is an event too


async def http_round(port: int, prompts: list[list[int]], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one_stream(port, p, max_tokens) for p in prompts))
    wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    return {"wall_s": wall, "tokens": sum(r[2] for r in results), "events": sum(r[1] for r in results),
            "ttft_p50_s": ttfts[len(ttfts) // 2]}


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
    a = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="bench-server-")
    model = a.model
    if model is None:
        from engine.tinymodel import make_tiny_model
        model = make_tiny_model(f"{tmp.name}/model", hidden=a.hidden, layers=a.layers, heads=8, kv_heads=4,
                                intermediate=a.hidden * 3)
    max_len = a.prompt_tokens + a.max_tokens
    prompts = [[(7 * i + 13 * j) % 900 + 3 for j in range(a.prompt_tokens)] for i in range(a.streams)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_", "DEPLOYKIT_"))}

    direct = subprocess.Popen([sys.executable, "-c", DIRECT, json.dumps(
        {"model": model, "max_model_len": max_len, "streams": a.streams, "max_tokens": a.max_tokens,
         "prompts": prompts, "binding": a.binding, "frontend_cpus": a.frontend_cpus})],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)

    def direct_round() -> dict:
        direct.stdin.write("go\n")
        direct.stdin.flush()
        return json.loads(direct.stdout.readline())

    port = free_port()
    log = open(f"{tmp.name}/server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "engine", "serve", model, "--host", "127.0.0.1", "--port",
                               str(port), "--max-model-len", str(max_len), "--max-num-seqs", str(a.streams),
                               "--no-access-log", "--binding", a.binding,
                               *(["--frontend-cpus", a.frontend_cpus] if a.frontend_cpus else [])], cwd=ROOT,
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        import httpx
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not start:\n{Path(log.name).read_text()}")
            time.sleep(0.2)
        direct_round(), asyncio.run(http_round(port, prompts, a.max_tokens))  # warm-up
        direct_rounds, http_rounds = [], []
        for _ in range(a.rounds):  # alternate, so both see the same background load
            direct_rounds.append(direct_round())
            http_rounds.append(asyncio.run(http_round(port, prompts, a.max_tokens)))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
        direct.stdin.close()
        direct.wait(60)

    best_direct = min(direct_rounds, key=lambda r: r["wall_s"])
    best_http = min(http_rounds, key=lambda r: r["wall_s"])
    d_tps = best_direct["tokens"] / best_direct["wall_s"]
    h_tps = best_http["tokens"] / best_http["wall_s"]
    print(json.dumps({
        "model": {"path": model if a.model else f"random hidden={a.hidden} layers={a.layers}"},
        "streams": a.streams, "max_tokens": a.max_tokens, "prompt_tokens": a.prompt_tokens,
        "cpus": len(os.sched_getaffinity(0)), "binding": a.binding, "frontend_cpus": a.frontend_cpus or "shared",
        "direct": {"tokens_per_s": round(d_tps, 1), "wall_s": round(best_direct["wall_s"], 3),
                   "rounds_wall_s": [round(r["wall_s"], 3) for r in direct_rounds]},
        "http_sse": {"tokens_per_s": round(h_tps, 1), "wall_s": round(best_http["wall_s"], 3),
                     "ttft_p50_s": round(best_http["ttft_p50_s"], 4), "sse_events": best_http["events"],
                     "rounds_wall_s": [round(r["wall_s"], 3) for r in http_rounds]},
        "overhead_pct": round(100 * (1 - h_tps / d_tps), 2),  # best round vs best round
        "overhead_pct_median": round(100 * (median(r["wall_s"] for r in http_rounds)
                                            / median(r["wall_s"] for r in direct_rounds) - 1), 2),
        "target_overhead_pct": 5.0,
        "meets_target": 100 * (1 - h_tps / d_tps) < 5.0,
        "tokens_checked": {"direct": best_direct["tokens"], "http_usage": best_http["tokens"],
                           "expected": a.streams * a.max_tokens},
    }, indent=2))


if __name__ == "__main__":
    main()
