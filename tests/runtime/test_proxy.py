"""The local runtime's built-in load balancer, run as the real process in front of real HTTP servers on loopback:
it streams server-sent events as they are produced, picks the replica with the fewest open connections, skips
replicas whose /health is not 200, sends a request a replica failed before answering to the next one, answers 503
when no replica takes a connection, and drains on SIGTERM. (A replica that vanishes mid-answer: tests/docker.)"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.waiting import wait_until

EVENT_GAP = 0.4


class Backend:
    def __init__(self, name: str, healthy: bool = True, answer: int | None = None, drop: bool = False):
        """answer: the status of every request but /health (a replica loading or full); drop: close the connection
        after reading the request, without a byte of answer (a replica that died)."""
        self.name, self.healthy, self.release, self.holding = name, healthy, threading.Event(), threading.Event()
        self.seen: list[bytes] = []
        backend = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path == "/health":
                    return self._send(200 if backend.healthy else 503, b"{}")
                if self.path == "/hold":
                    backend.holding.set()
                    backend.release.wait(10)
                if self.path == "/stream":
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    for i in range(4):
                        self.wfile.write(f"data: {i}\n\n".encode())
                        self.wfile.flush()
                        time.sleep(EVENT_GAP)  # the behaviour under test: events spaced out in time
                    self.wfile.write(b"data: [DONE]\n\n")
                    return
                self._send(200, backend.name.encode())

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                backend.seen.append(body)
                if drop:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if answer is not None:
                    return self._send(answer, b'{"error": "loading"}')
                self._send(200, backend.name.encode() + b":" + body)

            def _send(self, code, body):
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proxy:
    def __init__(self, backends: list[str]):
        self.port = _free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "deploykit.runtime.proxy", "--listen",
                                      f"127.0.0.1:{self.port}", *(a for b in backends for a in ("--backend", b))],
                                     stderr=subprocess.PIPE, text=True)
        self.said: list[str] = []  # its stderr, read line by line as it comes
        threading.Thread(target=self._read_stderr, daemon=True).start()
        # Ready once it listens and its first health check (run at start) has judged every backend.
        wait_until(lambda: any(" listening on " in line for line in self.said)
                   and sum(" is " in line for line in self.said if line.startswith("deploykit-proxy: replica "))
                   >= len(backends), timeout=20, what="the proxy to listen and health-check every backend")

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.said.append(line)

    def get(self, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
        try:
            c.request("GET" if body is None else "POST", path, body=body)
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(60)


@pytest.fixture
def backends():
    made: list[Backend] = []

    def make(*names_health, **kw):
        for name, healthy in names_health:
            made.append(Backend(name, healthy, **kw.get(name, {})))
        return made
    yield make
    for b in made:
        b.close()


def test_events_stream_through_as_they_are_produced(backends):
    (a,) = backends(("a", True))
    p = Proxy([a.address])
    try:
        c = http.client.HTTPConnection("127.0.0.1", p.port, timeout=20)
        c.request("GET", "/stream")
        r = c.getresponse()
        arrivals, events = [], []
        start = time.monotonic()
        for line in r:
            if line.startswith(b"data: "):
                events.append(line[6:].strip().decode())
                arrivals.append(time.monotonic() - start)
        assert events == ["0", "1", "2", "3", "[DONE]"]
        # each event arrives when it is written, not when the response ends
        assert arrivals[0] < arrivals[-1] - 3 * EVENT_GAP
    finally:
        assert p.close() == 0


def test_least_connections(backends):
    a, b = backends(("a", True), ("b", True))
    p = Proxy([a.address, b.address])
    try:
        held = threading.Thread(target=p.get, args=("/hold",))
        held.start()
        assert a.holding.wait(10)  # a has one open connection now
        assert [p.get("/who")[1] for _ in range(3)] == [b"b"] * 3
        a.release.set()
        held.join(10)
    finally:
        p.close()


def test_a_replica_that_is_not_healthy_gets_no_connections(backends):
    a, b = backends(("a", False), ("b", True))
    p = Proxy([a.address, b.address])
    try:
        assert {p.get("/who")[1] for _ in range(6)} == {b"b"}
    finally:
        p.close()


@pytest.mark.parametrize("failure", [{"answer": 503}, {"answer": 429}, {"drop": True}])
def test_a_request_a_replica_failed_before_answering_goes_to_the_next_one_whole(backends, failure):
    """A replica loading (503), full (429) or dying (connection closed, no byte) did no work: the client's bytes
    are replayed on the other replica and the client never sees the failure."""
    a, b = backends(("a", True), ("b", True), a=failure)
    p = Proxy([a.address, b.address])
    try:
        body = json.dumps({"prompt": "x" * 100_000}).encode()
        for _ in range(3):
            assert p.get("/v1/completions", body) == (200, b"b:" + body)
        assert a.seen and all(seen == body for seen in a.seen)  # tried first (fewest connections, listed first)
    finally:
        p.close()


def test_the_last_replica_answer_is_passed_on_as_it_is(backends):
    a, b = backends(("a", True), ("b", True), a={"answer": 503}, b={"answer": 503})
    p = Proxy([a.address, b.address])
    try:
        assert p.get("/v1/completions", b"{}") == (503, b'{"error": "loading"}')
        assert len(a.seen) == len(b.seen) == 1
    finally:
        p.close()


def test_no_replica_answers_503_in_openai_shape():
    p = Proxy([f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"])
    try:
        status, body = p.get("/v1/models")
        assert status == 503 and json.loads(body)["error"]["code"] == "no_healthy_replica"
    finally:
        p.close()


def test_sigterm_lets_an_open_stream_finish_and_refuses_new_connections(backends):
    (a,) = backends(("a", True))
    p = Proxy([a.address])
    c = http.client.HTTPConnection("127.0.0.1", p.port, timeout=20)
    c.request("GET", "/stream")
    r = c.getresponse()
    assert r.readline().startswith(b"data: 0")
    p.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: not _accepts(p.port), timeout=10, what="the draining proxy to close its listener")
    rest = r.read()
    assert rest.rstrip().endswith(b"data: [DONE]")
    assert p.proc.wait(30) == 0
