"""The local runtime's load balancer when no nginx binary is installed: a small TCP proxy over the replicas.

- least connections among the replicas whose GET /health answered 200 at the last check (every 5 s): one that is
  loading, draining or dead gets no new connections; if none looks healthy, every replica is tried in turn;
- bytes are passed on as they arrive, so server-sent events stream token by token (nginx needs `proxy_buffering
  off` for that; a byte pipe has no buffer to turn off);
- a replica that fails before its first byte reached the client (connection lost, or 502/503/429: loading, draining,
  full) gets the client's bytes replayed on the next replica, as nginx's proxy_next_upstream does;
- a replica that vanishes mid-answer (a killed container, a lost node) is noticed within ~8 s by TCP keep-alive
  probes and a bound on unacknowledged data, the numbers nginx's container gets as sysctls; a replica that merely
  computes long answers them from its kernel and is never cut off;
- a connection no replica accepts gets a 503 in OpenAI's error shape;
- SIGTERM or SIGQUIT: stop accepting, let open connections finish (up to 45 s), exit.

It balances connections, not requests: a keep-alive connection stays on one replica, as with nginx's stream module.
Written on asyncio streams because the standard library has no proxy and deploykit's core adds no server
dependency; it runs only in local mode (containers use nginx).

    python -m deploykit.runtime.proxy --listen 127.0.0.1:8000 --backend 127.0.0.1:8001 --backend 127.0.0.1:8002
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import sys

from ..render.container import KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_PROBES

CHECK_INTERVAL = 5.0  # every check is a line in each replica's access log
CONNECT_TIMEOUT = 5.0
CHUNK = 64 * 1024
DRAIN_SECONDS = 45.0
REPLAY_LIMIT = 4 << 20  # the engine's request limit: a larger request is not kept for a replay
RETRY_STATUS = (b"502", b"503", b"429")  # the replica did no work: safe to send the request elsewhere
# Unacknowledged data (and, with keep-alive on, unanswered probes) ends the connection after this long.
UNACKED_MS = (KEEPALIVE_IDLE + KEEPALIVE_INTERVAL * KEEPALIVE_PROBES) * 1000


def _split(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    return host.strip("[]"), int(port)


def _say(msg: str) -> None:
    print(f"deploykit-proxy: {msg}", file=sys.stderr, flush=True)


class Backend:
    def __init__(self, hostport: str):
        self.host, self.port = _split(hostport)
        self.name = hostport
        self.active = 0
        self.healthy: bool | None = None  # None: not checked yet


class Proxy:
    def __init__(self, backends: list[str]):
        self.backends = [Backend(b) for b in backends]
        self.connections = 0

    def order(self) -> list[Backend]:
        """Healthy replicas by fewest open connections (ties: list order), then the rest as a last resort."""
        healthy = sorted((b for b in self.backends if b.healthy), key=lambda b: b.active)
        return healthy + [b for b in self.backends if not b.healthy]

    async def handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            replay: bytearray | None = bytearray()  # what the client sent before any answer; None: too much to keep
            order = self.order()
            for i, b in enumerate(order):
                try:
                    up_r, up_w = await asyncio.wait_for(asyncio.open_connection(b.host, b.port), CONNECT_TIMEOUT)
                except (OSError, asyncio.TimeoutError):
                    self._mark(b, False)
                    continue
                _keepalive(up_w.get_extra_info("socket"))
                b.active += 1
                try:
                    ex = _Exchange(client_r, client_w, up_r, up_w, replay, last=i == len(order) - 1)
                    again = await ex.run()
                finally:
                    b.active -= 1
                if again:
                    _say(f"replica {b.name} failed before answering; trying the next one")
                    replay = ex.replay
                    continue
                return
            body = json.dumps({"error": {"message": "no replica is accepting connections", "type": "unavailable",
                                         "param": None, "code": "no_healthy_replica"}}).encode()
            client_w.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 5\r\n"
                           b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            await client_w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self.connections -= 1
            client_w.close()

    async def check_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._check(b) for b in self.backends))
            await asyncio.sleep(CHECK_INTERVAL)

    async def _check(self, b: Backend) -> None:
        try:
            r, w = await asyncio.wait_for(asyncio.open_connection(b.host, b.port), CONNECT_TIMEOUT)
            try:
                w.write(f"GET /health HTTP/1.1\r\nHost: {b.name}\r\nConnection: close\r\n\r\n".encode())
                await w.drain()
                status = await asyncio.wait_for(r.readline(), CONNECT_TIMEOUT)
            finally:
                w.close()
            ok = status.split(b" ")[1:2] == [b"200"]
        except (OSError, asyncio.TimeoutError, IndexError):
            ok = False
        self._mark(b, ok)

    def _mark(self, b: Backend, ok: bool) -> None:
        if b.healthy is not ok:
            _say(f"replica {b.name} is {'healthy' if ok else 'not healthy'}")
        b.healthy = ok


def _keepalive(sock: socket.socket | None) -> None:
    """Probe an idle upstream connection after KEEPALIVE_IDLE s, every KEEPALIVE_INTERVAL s; give up on it after
    KEEPALIVE_PROBES unanswered probes or UNACKED_MS of unacknowledged data."""
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                        ("TCP_KEEPCNT", KEEPALIVE_PROBES), ("TCP_USER_TIMEOUT", UNACKED_MS)):
        if hasattr(socket, name):  # Linux; elsewhere the system's defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class _Exchange:
    """One client connection piped to one replica, both ways, until either side closes; then both are closed (a
    client that goes away frees its replica's slot at once, as nginx's proxy_ignore_client_abort off does).

    Until the replica's first byte reaches the client, the client's bytes are kept (up to REPLAY_LIMIT): when the
    replica fails before that, `run` says so and `replay` holds what to send to the next one."""

    def __init__(self, client_r, client_w, up_r, up_w, replay: bytearray | None, last: bool):
        self.client_r, self.client_w, self.up_r, self.up_w = client_r, client_w, up_r, up_w
        self.replay, self.last = replay, last
        self.answered = False

    def _may_retry(self) -> bool:
        return not self.answered and self.replay is not None and not self.last

    async def _to_replica(self) -> None:
        try:
            if self.replay:
                self.up_w.write(bytes(self.replay))
                await self.up_w.drain()
            while data := await self.client_r.read(CHUNK):
                if not self.answered and self.replay is not None:  # kept before it is sent: nothing is lost
                    self.replay = self.replay + data if len(self.replay) + len(data) <= REPLAY_LIMIT else None
                self.up_w.write(data)
                await self.up_w.drain()
        except (ConnectionError, OSError):
            pass

    async def _to_client(self) -> bool:
        """True when the replica failed before answering and the request may go to another one."""
        head = b""
        try:
            while True:
                data = await self.up_r.read(CHUNK)
                if not self.answered:
                    if not data:
                        return self._may_retry()
                    head += data
                    if b"\n" not in head and len(head) < 64:
                        continue  # the status line is not complete yet
                    status = head.split(b" ", 2)[1:2]  # b"HTTP/1.1 503 Service Unavailable" -> [b"503"]
                    if status and status[0] in RETRY_STATUS and self._may_retry():
                        return True
                    self.answered, data = True, head
                if not data:
                    return False
                self.client_w.write(data)
                await self.client_w.drain()
        except (ConnectionError, OSError):  # reset, or keep-alive probes unanswered: the replica is gone
            return self._may_retry()

    async def run(self) -> bool:
        tasks = [asyncio.ensure_future(self._to_replica()), asyncio.ensure_future(self._to_client())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            return tasks[1] in done and tasks[1].result()
        finally:
            for t in tasks:
                t.cancel()
            self.up_w.close()


async def serve(listen: str, backends: list[str]) -> int:
    proxy = Proxy(backends)
    host, port = _split(listen)
    checks = asyncio.ensure_future(proxy.check_forever())
    server = await asyncio.start_server(proxy.handle, host or None, port, reuse_address=True)
    _say(f"listening on {listen}, least connections over {', '.join(backends)}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGQUIT, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()
    deadline = loop.time() + DRAIN_SECONDS
    while proxy.connections and loop.time() < deadline:
        await asyncio.sleep(0.1)
    checks.cancel()
    _say(f"stopped ({proxy.connections} connection(s) still open)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploykit.runtime.proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", required=True, metavar="HOST:PORT")
    p.add_argument("--backend", action="append", required=True, metavar="HOST:PORT")
    a = p.parse_args(argv)
    try:
        return asyncio.run(serve(a.listen, a.backend))
    except OSError as e:
        _say(f"cannot listen on {a.listen}: {e.strerror or e}")
        return 3


if __name__ == "__main__":
    sys.exit(main())
