"""Helpers for the `deploykit up/down/status/logs` tests (local runtime here, Docker in tests/docker/test_up.py):
free loopback ports, spec files of two single-CPU replicas, and the deploykit command as users run it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def free_port(span: int = 1) -> int:
    """A port p with p .. p+span-1 all free on 127.0.0.1."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + span < 65536 and all(port_free(port + i) for i in range(span)):
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


def spec_file(path: Path, name: str, model: Path, port: int, cpus: list[str] | None = None, **sections) -> Path:
    """Two single-CPU replicas (CPUs 0 and 1, one OpenMP thread each, nothing reserved) on loopback."""
    spec = {"apiVersion": "deploykit/v1", "kind": "Deployment", "name": name,
            "model": {"source": str(model), "max_model_len": 256},
            "placement": {"strategy": "explicit", "cpus": cpus or ["0", "1"], "reserved_cpus": 0, "threads": 1},
            "serving": {"port": port, "publish_address": "127.0.0.1", "kv_cache": "16MiB", "max_num_seqs": 4,
                        "served_model_name": name}}
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    path.write_text(yaml.safe_dump(spec))
    return path


def deploykit(*args, env: dict | None = None, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploykit.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **(env or {})}, timeout=timeout, **kw)
