"""A bounded soak of the server: many concurrent clients for several minutes, then checks that nothing failed and
nothing is left behind. Prints JSON on stdout (progress on stderr).

Run: flock /tmp/deploykit-heavy.lock python benchmarks/soak.py [--clients 32] [--rounds 3] [--seconds 60]
         [--model DIR_OR_GGUF] [--allocator glibc|tcmalloc] [--malloc-arena-max N]

Each client loops until the round ends: completions or chat, streaming or not, random prompt and output lengths,
sometimes n=2, and a share of streams disconnects after a few chunks. Every few seconds the sampler records the
resident memory (VmRSS) of the front-end and engine processes and the server's own gauges. After each round the
load stops and the server must come back to idle: no request running or waiting and no KV block in use. The
verdict: no 5xx and no transport error at any time, idle after every round, and whether RSS converges (the last
round grows it by less than `--growth-limit`) or keeps growing round after round (a leak).
Without --model a random-weight model is generated (the same shape as the issue's measurement: tiny).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from deploykit import procfs  # noqa: E402  (after the path: run as a script from anywhere)

WORDS = ("the cache of a CPU keeps recently used data close to the cores so that loads do not wait for memory "
         "while threads pinned to physical cores decode tokens one step at a time").split()


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float | None:
    try:
        n = procfs.status_bytes(procfs.read_status(pid), "VmRSS")
    except OSError:
        return None
    return None if n is None else round(n / 2**20, 1)


def gauges(text: str) -> dict:
    out = {}
    for name in ("deploykit_num_requests_running", "deploykit_num_requests_waiting", "deploykit_kv_cache_usage_ratio"):
        m = re.search(rf"^{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
        out[name.removeprefix("deploykit_")] = float(m.group(1)) if m else None
    return out


class Tally:
    def __init__(self):
        self.status: dict[str, int] = {}
        self.errors: list[str] = []
        self.disconnects = 0
        self.tokens = 0

    def count(self, key: str) -> None:
        self.status[key] = self.status.get(key, 0) + 1


async def client(http: httpx.AsyncClient, rng: random.Random, stop_at: float, t: Tally, max_len: int) -> None:
    while time.monotonic() < stop_at:
        # prompts from one word to about half the context (long prefills: the largest transient tensors)
        prompt = " ".join(rng.choice(WORDS) for _ in range(int(rng.random() ** 2 * max_len * 0.3) + 1))
        max_tokens = rng.randint(1, min(160, max_len // 4))
        chat = rng.random() < 0.5
        body: dict = {"max_tokens": max_tokens, "temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randint(0, 99),
                      "n": rng.choice([1] * 8 + [2, 4]), "ignore_eos": rng.random() < 0.5}
        if rng.random() < 0.3:  # every sampling control the server has, so their code paths soak too
            body |= {"top_k": rng.choice([0, 5, 50]), "top_p": rng.choice([1.0, 0.9]), "min_p": rng.choice([0, 0.05]),
                     "repetition_penalty": rng.choice([1.0, 1.2]), "presence_penalty": rng.choice([0, 0.5]),
                     "frequency_penalty": rng.choice([0, 0.5]), "stop": rng.sample(WORDS, rng.randint(0, 3))}
        body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        if rng.random() < 0.2:  # logprobs, with alternatives
            body |= {"logprobs": True, "top_logprobs": rng.randint(0, 5)} if chat else {"logprobs": rng.randint(0, 5)}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        stream = rng.random() < 0.6
        leave_after = rng.randint(1, 6) if stream and rng.random() < 0.25 else None
        try:
            if not stream:
                r = await http.post(path, json=body)
                t.count(str(r.status_code))
                if r.status_code == 200:
                    t.tokens += r.json()["usage"]["completion_tokens"]
                continue
            async with http.stream("POST", path, json={**body, "stream": True}) as r:
                t.count(str(r.status_code))
                chunks = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunks += 1
                        if '"error"' in line:
                            t.errors.append(line[:300])
                        if leave_after is not None and chunks >= leave_after:
                            t.disconnects += 1
                            break  # the client walks away mid-stream: the server must free the request
                t.tokens += chunks
        except httpx.HTTPError as e:
            t.errors.append(f"{type(e).__name__}: {e}"[:300])


async def sampler(url: str, pids: dict[str, int], stop: asyncio.Event, curve: list, t0: float, every: float) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        while not stop.is_set():
            sample = {"t_s": round(time.monotonic() - t0, 1), **{f"rss_{k}_mb": rss_mb(p) for k, p in pids.items()}}
            try:
                sample |= gauges((await http.get("/metrics")).text)
            except httpx.HTTPError:
                pass
            curve.append(sample)
            try:
                await asyncio.wait_for(stop.wait(), every)
            except asyncio.TimeoutError:
                pass


async def idle(url: str, timeout: float = 60) -> dict:
    """Wait until nothing runs, waits or holds KV; returns the gauges then (or the last seen on timeout)."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        while True:
            g = gauges((await http.get("/metrics")).text)
            if (g["num_requests_running"], g["num_requests_waiting"], g["kv_cache_usage_ratio"]) == (0, 0, 0):
                return {**g, "idle": True}
            if time.monotonic() > deadline:
                return {**g, "idle": False}
            await asyncio.sleep(0.2)


async def soak(a, url: str, pids: dict[str, int], max_len: int) -> dict:
    t0 = time.monotonic()
    curve: list = []
    rounds = []
    stop = asyncio.Event()
    watch = asyncio.create_task(sampler(url, pids, stop, curve, t0, a.sample_every))
    limits = httpx.Limits(max_connections=a.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        for n in range(a.rounds):
            tally = Tally()
            began = time.monotonic()
            rngs = [random.Random(a.seed * 1000 + n * 100 + i) for i in range(a.clients)]
            await asyncio.gather(*(client(http, r, began + a.seconds, tally, max_len) for r in rngs))
            after = await idle(url)
            rss = {f"rss_{k}_mb": rss_mb(p) for k, p in pids.items()}
            rounds.append({"round": n + 1, "seconds": round(time.monotonic() - began, 1), "status": tally.status,
                           "server_errors": sum(v for k, v in tally.status.items() if k.startswith("5")),
                           "transport_or_stream_errors": len(tally.errors), "error_samples": tally.errors[:3],
                           "disconnects": tally.disconnects, "tokens": tally.tokens, "after": after, **rss})
            print(f"round {n + 1}: {tally.status} disconnects {tally.disconnects} {rss} idle {after['idle']}",
                  file=sys.stderr)
    stop.set()
    await watch
    return {"rounds": rounds, "curve": curve}


def verdict(rounds: list[dict], growth_limit: float) -> dict:
    ok_errors = all(r["server_errors"] == 0 and r["transport_or_stream_errors"] == 0 for r in rounds)
    ok_idle = all(r["after"]["idle"] for r in rounds)
    out = {"no_5xx_or_errors": ok_errors, "idle_after_every_round": ok_idle}
    for proc in ("frontend", "engine"):
        series = [r[f"rss_{proc}_mb"] for r in rounds]
        growth = [round(b - a, 1) for a, b in zip(series, series[1:])]
        out[f"rss_{proc}_mb_after_rounds"] = series
        out[f"rss_{proc}_growth_mb"] = growth
        # converged: the last round added no more than the noise allowance (a leak adds the same every round);
        # None with one round: growth needs two to judge
        out[f"rss_{proc}_converges"] = growth[-1] <= growth_limit if growth else None
    out["pass"] = ok_errors and ok_idle and out["rss_frontend_converges"] is not False \
        and out["rss_engine_converges"] is not False
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--sample-every", type=float, default=2.0)
    ap.add_argument("--growth-limit", type=float, default=20.0, help="MB of RSS growth the last round may add")
    ap.add_argument("--allocator", choices=("glibc", "tcmalloc"), default="glibc")
    ap.add_argument("--malloc-arena-max", type=int, default=None, help="MALLOC_ARENA_MAX for glibc")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    model = a.model
    if model is None:
        from engine.tinymodel import make_tiny_model
        model = make_tiny_model(tempfile.mkdtemp(prefix="soak-") + "/tiny")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_", "DEPLOYKIT_"))}
    if a.allocator == "tcmalloc":
        env["LD_PRELOAD"] = "libtcmalloc_minimal.so.4"  # what the engine image preloads
    if a.malloc_arena_max:
        env["MALLOC_ARENA_MAX"] = str(a.malloc_arena_max)
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="soak-server-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", model, "--host", "127.0.0.1", "--port",
                             str(port), "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
                             "--max-waiting", str(4 * a.clients), "--no-access-log"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(Path(log.name).read_text())
            time.sleep(0.5)
        engine_pid = httpx.get(f"{url}/debug/binding", timeout=30).json()["engine"]["pid"]
        pids = {"frontend": proc.pid, "engine": engine_pid}
        start_rss = {f"rss_{k}_mb": rss_mb(p) for k, p in pids.items()}
        result = asyncio.run(soak(a, url, pids, a.max_model_len))
        log_text = Path(log.name).read_text(errors="replace")
        result = {"config": {**vars(a), "model": model}, "rss_at_start": start_rss, **result,
                  "server_log_errors": [line for line in log_text.splitlines() if "ERROR" in line][:5],
                  "verdict": verdict(result["rounds"], a.growth_limit)}
        print(json.dumps(result, indent=1))
        return 0 if result["verdict"]["pass"] else 1
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
