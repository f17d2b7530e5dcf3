"""Prefix caching on chat traffic that shares a system prompt: engine-side and over HTTP, with the cache off (the
baseline) and on, in one run. Prints JSON on stdout (progress on stderr).

Run: flock -o /tmp/deploykit-heavy.lock python benchmarks/prefix_cache.py [--model DIR] [--system-tokens 1024]
     [--chats 16] [--turns 3] [--skip-http]

Two loads, each run with `--no-prefix-caching` and then with the cache on (the default):
  ttft   one chat at a time: the system prompt + a short user line (24-40 tokens), 8 new tokens. The first request's
         time to first token against the median of the later ones (target: later <= 20 % of the first).
  chats  `--chats` concurrent chats sharing the system prompt, `--turns` turns each; every turn is the whole
         conversation so far + a new user line, 32 new tokens, sent as soon as the previous turn ended. Generated
         tokens per second, cache on against off (target >= 1.5x). The conversation records each reply as a fixed
         32-token line (the same for both runs and both sides; the server streams text, whose token ids a client
         cannot know exactly); the engine never caches blocks filled while decoding anyway: the next turn prefills
         the reply, and the turn after reuses it.
Engine-side, EngineCore runs in a child process pinned like `python -m engine serve --binding auto`; over HTTP the
server streams completions of token-id prompts (no chat template: the same tokens both ways). Without --model the
random-weight Qwen2-shaped bf16 model of benchmarks/engine.py is used (generated once).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # not benchmarks/: engine.py there would shadow the engine package

from benchmarks.server import Server, clean_env, one_stream  # noqa: E402
from deploykit.bench import client  # noqa: E402

TARGETS = {"ttft_later_over_first_max": 0.20, "chats_speedup_min": 1.5}
TTFT_REQUESTS, TTFT_TOKENS, CHAT_TOKENS = 6, 8, 32


def workload(a, vocab: int) -> dict:
    """Token ids, fixed by the seed: the system prompt, user lines for the ttft load and for every chat turn."""
    rng = random.Random(0)

    def line(n: int) -> list[int]:
        return [rng.randrange(3, vocab - 1) for _ in range(n)]

    return {"system": line(a.system_tokens),
            "ttft_users": [line(rng.randrange(24, 41)) for _ in range(TTFT_REQUESTS)],
            "chat_users": [[line(rng.randrange(24, 41)) for _ in range(a.turns)] for _ in range(a.chats)],
            "chat_replies": [[line(CHAT_TOKENS) for _ in range(a.turns)] for _ in range(a.chats)]}


def conversation(w: dict, c: int, t: int) -> list[int]:
    """Chat c's prompt at turn t: the system prompt, then every earlier user line and reply, then its new line."""
    ids = list(w["system"])
    for u in range(t):
        ids += w["chat_users"][c][u] + w["chat_replies"][c][u]
    return ids + w["chat_users"][c][t]


# ---- engine-side (child process) ----

def engine_child(arg: str) -> None:
    a = json.loads(arg)
    from engine import binding
    b = binding.prepare(binding.resolve("auto"))
    import torch  # noqa: F401 - OpenMP loads with the binding's environment
    binding.finish(b)
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.sampling import SamplingParams
    w = a["workload"]
    out = {}
    for caching in (False, True):
        core = EngineCore(EngineConfig(a["model"], max_model_len=a["max_model_len"], max_num_seqs=a["chats"],
                                       prefix_caching=caching))
        ttft = []
        for i, user in enumerate(w["ttft_users"]):
            t0 = time.perf_counter()
            core.add_request(f"t{i}", w["system"] + user, SamplingParams(max_tokens=TTFT_TOKENS, temperature=0.0,
                                                                         ignore_eos=True))
            first = None
            while core.has_unfinished_requests():
                if core.step() and first is None:
                    first = time.perf_counter() - t0
            ttft.append(first)
        params = SamplingParams(max_tokens=CHAT_TOKENS, temperature=0.0, ignore_eos=True)
        turn = [0] * len(w["chat_users"])

        def send(c: int, core: EngineCore = core) -> None:  # bound now: `del core` below frees it per pass
            core.add_request(f"{c}-{turn[c]}", conversation(w, c, turn[c]), params)

        t0, tokens = time.perf_counter(), 0
        for c in range(len(turn)):
            send(c)
        while core.has_unfinished_requests():
            for o in core.step():
                tokens += len(o.new_token_ids)
                if o.finished:
                    c = int(o.request_id.split("-")[0])
                    turn[c] += 1
                    if turn[c] < len(w["chat_users"][c]):
                        send(c)
        wall = time.perf_counter() - t0
        s = core.stats()
        out["on" if caching else "off"] = {
            "ttft_s": [round(x, 4) for x in ttft], "chats_wall_s": round(wall, 3), "chats_tokens": tokens,
            "prefix_cache_hits": s.prefix_cache_hits_total, "prefix_cache_queries": s.prefix_cache_queries_total}
        del core
    print(json.dumps(out), flush=True)


# ---- HTTP ----

async def http_ttft(port: int, model: str, w: dict) -> list[float]:
    out = []
    for user in w["ttft_users"]:
        r = await one_stream(port, model, w["system"] + user, TTFT_TOKENS)
        out.append(r.ttft)
    return out


async def http_chats(port: int, model: str, w: dict) -> tuple[float, int]:
    async def chat(c: int) -> int:
        return sum([(await one_stream(port, model, conversation(w, c, t), CHAT_TOKENS)).output_tokens
                    for t in range(len(w["chat_users"][c]))])

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(chat(c) for c in range(len(w["chat_users"])))))
    return time.perf_counter() - t0, tokens


def summarize(ttft: list[float], wall: float, tokens: int) -> dict:
    later = median(ttft[1:])
    return {"ttft_first_s": round(ttft[0], 4), "ttft_later_median_s": round(later, 4),
            "ttft_later_over_first": round(later / ttft[0], 3), "chats_tokens_per_s": round(tokens / wall, 1),
            "chats_wall_s": round(wall, 3), "chats_tokens": tokens}


def compare(off: dict, on: dict) -> dict:
    speedup = on["chats_tokens_per_s"] / off["chats_tokens_per_s"]
    return {"off": off, "on": on, "chats_speedup": round(speedup, 2),
            "meets_ttft_target": on["ttft_later_over_first"] <= TARGETS["ttft_later_over_first_max"],
            "meets_chats_target": speedup >= TARGETS["chats_speedup_min"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="model directory or .gguf (default: benchmarks/engine.py's model)")
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--chats", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return engine_child(a.child)
    model = a.model
    if model is None:
        from benchmarks.engine import DEFAULT_MODEL_DIR, ensure_model
        ensure_model(DEFAULT_MODEL_DIR)
        model = str(DEFAULT_MODEL_DIR)
    from deploykit.modelfiles import read_config
    vocab = read_config(model).vocab_size
    w = workload(a, vocab)
    max_len = a.system_tokens + a.turns * (40 + CHAT_TOKENS) + 16
    print("engine-side: cache off, then on", file=sys.stderr)
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(
        {"model": model, "max_model_len": max_len, "chats": a.chats, "workload": w})],
        capture_output=True, text=True, cwd=ROOT, env=clean_env())
    if done.returncode:
        raise SystemExit(f"engine-side run failed:\n{done.stderr[-3000:]}")
    eng = json.loads(done.stdout.strip().splitlines()[-1])
    result = {"model": model, "system_tokens": a.system_tokens, "chats": a.chats, "turns": a.turns,
              "cpus": len(os.sched_getaffinity(0)), "targets": TARGETS,
              "engine": compare(*(summarize(eng[k]["ttft_s"], eng[k]["chats_wall_s"], eng[k]["chats_tokens"])
                                  | {"prefix_cache_hits": eng[k]["prefix_cache_hits"],
                                     "prefix_cache_queries": eng[k]["prefix_cache_queries"]} for k in ("off", "on")))}
    if not a.skip_http:
        http = {}
        with tempfile.TemporaryDirectory(prefix="bench-prefix-") as logdir:
            for caching in (False, True):
                print(f"HTTP: cache {'on' if caching else 'off'}", file=sys.stderr)
                srv = Server(model, logdir, "--max-model-len", str(max_len), "--max-num-seqs", str(a.chats),
                             "--prefix-caching" if caching else "--no-prefix-caching")
                with srv as port:
                    ttft = client.run(http_ttft(port, srv.model, w))
                    wall, tokens = client.run(http_chats(port, srv.model, w))
                http["on" if caching else "off"] = summarize(ttft, wall, tokens)
        result["http"] = compare(http["off"], http["on"])
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
