"""The local runtime's load balancer when no nginx binary is installed: a small TCP proxy over the replicas.

- least connections among the replicas whose GET /health answered 200 at the last check (every 5 s): one that is
  loading, draining or dead gets no new connections; if none looks healthy, every replica is tried in turn;
- bytes are passed on as they arrive, so server-sent events stream token by token (nginx needs `proxy_buffering
  off` for that; a byte pipe has no buffer to turn off);
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
import sys

CHECK_INTERVAL = 5.0  # every check is a line in each replica's access log
CONNECT_TIMEOUT = 5.0
CHUNK = 64 * 1024
DRAIN_SECONDS = 45.0


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
            for b in self.order():
                try:
                    up_r, up_w = await asyncio.wait_for(asyncio.open_connection(b.host, b.port), CONNECT_TIMEOUT)
                except (OSError, asyncio.TimeoutError):
                    self._mark(b, False)
                    continue
                b.active += 1
                try:
                    await _pipe(client_r, client_w, up_r, up_w)
                finally:
                    b.active -= 1
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


async def _pipe(a_r, a_w, b_r, b_w) -> None:
    """Copy both ways until either side closes, then close both: a client that goes away frees its replica's
    slot at once (nginx's default, proxy_ignore_client_abort off)."""
    async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(CHUNK):
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass

    tasks = [asyncio.ensure_future(copy(a_r, b_w)), asyncio.ensure_future(copy(b_r, a_w))]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        b_w.close()


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
