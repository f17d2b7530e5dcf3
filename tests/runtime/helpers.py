"""Helpers for the `deploykit up/down/status/logs` tests (local runtime here, Docker in tests/docker/test_up.py):
free loopback ports, spec files of two single-CPU replicas, and the deploykit command as users run it."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import threading
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def free_port(span: int = 1) -> int:
    """A port p with p .. p+span-1 all free on 127.0.0.1, below the kernel's ephemeral range: the tests' own client
    connections take ephemeral local ports, and one of them could otherwise hold a deployment's port."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, low - span)
        if all(port_free(port + i) for i in range(span)):
            return port
    raise RuntimeError("no free port range")


def port_free(port: int) -> bool:
    """Nothing listens on it. SO_REUSEADDR as servers set it: connections lingering in TIME_WAIT do not count."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def nothing_listens(port: int) -> bool:
    """A connection to 127.0.0.1:port is refused: what `down` promises about a deployment's ports. (Binding would also
    fail while a client socket of this test happens to use the port as its local end.)"""
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) != 0


def spec_file(path: Path, name: str, model: Path, port: int, cpus: list[str] | None = None, **sections) -> Path:
    """Two single-CPU replicas (CPUs 0 and 1, one OpenMP thread each, nothing reserved) on loopback: on a 2-CPU host
    (this one, CI's) planned with `replicas_per_node: 2`, elsewhere as explicit CPU lists; `cpus` gives explicit
    lists."""
    placement = ({"strategy": "per-numa-node", "replicas_per_node": 2} if cpus is None and len(os.sched_getaffinity(0))
                 == 2 else {"strategy": "explicit", "cpus": cpus or ["0", "1"]})
    spec = {"apiVersion": "deploykit/v1", "kind": "Deployment", "name": name,
            "model": {"source": str(model), "max_model_len": 256},
            "placement": {**placement, "reserved_cpus": 0, "threads": 1},
            "serving": {"port": port, "publish_address": "127.0.0.1", "kv_cache": "16MiB", "max_num_seqs": 4,
                        "served_model_name": name}}
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    path.write_text(yaml.safe_dump(spec))
    return path


def deploykit(*args, env: dict | None = None, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploykit.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **(env or {})}, timeout=timeout, **kw)


def corrupt_copy(model: Path, dest: Path) -> Path:
    """A copy of `model` (readable by anyone, as containers need) whose safetensors header, all that planning
    reads, is intact and whose tensors are cut off: only the engine, loading it, finds out."""
    dest.mkdir(mode=0o755)
    for f in model.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
        (dest / f.name).chmod(0o644)
    weights = dest / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:8 + int.from_bytes(data[:8], "little") + 16])
    return dest


class Load:
    """Chat completions one after another through `port` until stopped: what clients see during an update."""

    def __init__(self, port: int, model: str, api_key: str, retries: int, keepalive: bool = True):
        """keepalive=False: a new connection per request, so a server closing an idle keep-alive connection just as
        the next request goes out (a race of every HTTP/1.1 client, not of the update) cannot count as a failure."""
        import httpx
        import openai
        limits = httpx.Limits(max_keepalive_connections=None if keepalive else 0)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, max_retries=retries,
                                    timeout=60, http_client=httpx.Client(limits=limits, timeout=60))
        self.model, self.ok, self.errors = model, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.client.chat.completions.create(model=self.model, max_tokens=4,
                                                    messages=[{"role": "user", "content": "Hi"}])
                self.ok += 1
            except Exception as e:  # recorded, not raised: the test asserts on all of them
                self.errors.append(repr(e))

    def __enter__(self) -> "Load":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(120)
