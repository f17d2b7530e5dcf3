"""A real `python -m engine serve` process on a free loopback port: what the server tests talk to."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict:
    """The caller's environment without variables that would change the server's binding or key."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_", "DEPLOYKIT_"))}
    return {**env, **extra}


class LiveServer:
    def __init__(self, model: str, *args: str, api_key: str | None = None, env: dict | None = None,
                 cmd: list[str] | None = None, new_session: bool = False, host: str = "127.0.0.1"):
        """`cmd` replaces `python -m engine serve MODEL`; --host/--port (and --api-key) are appended to it. Tests
        talk to 127.0.0.1 whatever `host` the server binds."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self._log = tempfile.NamedTemporaryFile(prefix="deploykit-server-", suffix=".log", delete=False)
        cmd = [*(cmd or [sys.executable, "-m", "engine", "serve", model]), "--host", host, "--port",
               str(self.port), *(["--api-key", api_key] if api_key else []), *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env=env if env is not None else clean_env(), start_new_session=new_session)
        self.new_session = new_session

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self, since: int = 0) -> str:
        return Path(self._log.name).read_text(errors="replace")[since:]

    def log_size(self) -> int:
        return len(self.log())

    def wait_ready(self, timeout: float = 240.0) -> LiveServer:
        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        try:
            wait_until(healthy, timeout, interval=0.2, ignore=(httpx.TransportError,))
        except TimeoutError:
            raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()}") from None
        return self

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers, timeout=60, **kw)

    def post(self, path: str, json=None, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=json, headers={**self.headers, **kw.pop("headers", {})},
                          timeout=kw.pop("timeout", 60), **kw)

    def engine_pid(self) -> int:
        return self.get("/debug/binding").json()["engine"]["pid"]

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of one metric in /metrics whose labels include `labels`."""
        total = 0.0
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
            if m and m.group(1) == name:
                have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
                if labels.items() <= have.items():
                    total += float(m.group(3))
        return total

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def close(self) -> None:
        """Kill if still running, and in its own session everything it started (vLLM's engine core outlives a
        killed API server: each run left 1.5 GB behind); the log stays (its path is printed) for post-mortems."""
        self.stop(signal.SIGKILL)
        if self.new_session:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()
        print(f"server log: {self._log.name}")
