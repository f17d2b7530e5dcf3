"""One streamed request's wire: HTTP/1.1 over an asyncio Protocol, the answer parsed by httptools (llhttp), its SSE
lines handled in the callback that received their bytes.

Why not httpx here (it still makes bench's other calls): the load generator runs on the CPUs of the host it
measures, often the server's own. Streaming 16 x 512 SSE events on loopback, httpx's `aiter_lines` took 176-232 µs
of client CPU an event, aiohttp's 39-44 on uvloop, this 22-27: no coroutine switch per event, because a token's chunk
is parsed, checked and timed inside `data_received`. A CPU the client takes stalls a server whose OpenMP threads
spin: on 2 CPUs, 16 streams through our server and vLLM ran up to 1.6x faster with this client than with httpx
(benchmarks/README.md). Each arrival is stamped when its bytes arrive, not when a coroutine gets to run.

A worker keeps its connection between requests while the server keeps it alive; a kept connection that turns out
closed before any byte of the answer is retried once on a new one (the server may close an idle connection at any
time, as HTTP/1.1 allows).
"""
from __future__ import annotations

import asyncio
import json
import ssl
import time
from urllib.parse import urlsplit

import httptools

ERROR_TEXT = 200  # characters of an error body kept in a sample
CONNECT_TIMEOUT = 30.0


KEEP_WAIT = 1.0  # seconds after [DONE] for the end of the HTTP message, to keep the connection
DONE = ""  # what Sink.line returns for [DONE]


def error_text(doc, fallback: str = "") -> str:
    """What an OpenAI-shaped error (a JSON body, or a chunk inside a stream) says: error.message, else the error."""
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict):
        err = err.get("message") or json.dumps(err)
    return str(err or fallback)[:ERROR_TEXT]


class Failed(Exception):
    """A request that did not end in [DONE]: the text a Result carries as its error."""


class Sink:
    """What a stream's chunks feed (client.Tally); `status` is set when the answer's headers arrive."""

    status: int | None = None

    def line(self, data: bytes, at: float) -> str | None:
        """One `data:` line's payload, whose bytes arrived at `at` (time.perf_counter()): None to go on, DONE for
        [DONE], else why the request failed."""
        raise NotImplementedError


class Conn(asyncio.Protocol):
    """One HTTP/1.1 connection carrying one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.open = False
        self.answer: Answer | None = None

    def connection_made(self, transport) -> None:
        self.transport, self.open = transport, True

    def data_received(self, data: bytes) -> None:
        if self.answer is not None:
            self.answer.feed(data)

    def connection_lost(self, exc) -> None:
        self.open = False
        if self.answer is not None:
            self.answer.lost(exc)

    def close(self) -> None:
        self.open = False
        if self.transport is not None:
            self.transport.close()


class Answer:
    """The response to one request: status and error body, or the SSE body line by line into the sink."""

    def __init__(self, sink: Sink, fut: asyncio.Future, ended: asyncio.Future) -> None:
        self.sink, self.fut, self.ended = sink, fut, ended  # fut: [DONE] or a failure; ended: the message's end
        self.parser = httptools.HttpResponseParser(self)
        self.status: int | None = None
        self.tail = b""  # an SSE line not ended yet
        self.body: list[bytes] = []  # an error answer's body
        self.seen = False  # any byte of the answer arrived
        self.done = False  # [DONE] seen
        self.done_at = 0.0  # when [DONE] arrived
        self.complete = False  # the HTTP message ended
        self.keep = False  # ... and the server keeps the connection open
        self.last = time.perf_counter()  # when the last byte arrived

    # ---- from the connection ----
    def feed(self, data: bytes) -> None:
        self.seen, self.last = True, time.perf_counter()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.finish(Failed("the server switched protocols"))
        except httptools.HttpParserError as e:
            self.finish(Failed(f"bad HTTP from the server: {e}"[:ERROR_TEXT]))

    def lost(self, exc) -> None:
        if not self.ended.done():
            self.ended.set_result(None)
        if self.done or self.fut.done():
            self.finish(None)
        elif self.complete:
            self.finish(Failed("the stream ended before [DONE]"))
        else:
            why = f"{type(exc).__name__}: {exc}" if exc else "the server closed the connection"
            self.finish(Failed(f"{why} before the end of the answer"[:ERROR_TEXT]))

    def finish(self, error: Exception | None) -> None:
        if not self.fut.done():
            if error is None:
                self.fut.set_result(None)
            else:
                self.fut.set_exception(error)

    # ---- httptools callbacks ----
    def on_headers_complete(self) -> None:
        self.status = self.sink.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.status is None or self.status >= 400:
            self.body.append(body)
            return
        if self.done:
            return
        lines = (self.tail + body).split(b"\n")
        self.tail = lines.pop()
        for line in lines:
            if not line.startswith(b"data:"):
                continue  # blank separators, ": keep-alive" comments, event: lines
            why = self.sink.line(line[5:].strip(), self.last)
            if why is not None:
                self.done, self.done_at = why == DONE, self.last
                self.finish(None if self.done else Failed(why))
                return

    def on_message_complete(self) -> None:
        self.complete, self.keep = True, self.parser.should_keep_alive()  # asked later, llhttp has moved on
        if not self.ended.done():
            self.ended.set_result(None)
        if self.status is not None and self.status >= 400:
            text = b"".join(self.body).decode(errors="replace")
            try:
                text = error_text(json.loads(text), text)
            except ValueError:
                pass
            self.finish(Failed(f"HTTP {self.status}: {text.strip()[:ERROR_TEXT]}"))
        elif not self.done:
            self.finish(Failed("the stream ended before [DONE]"))


class Endpoint:
    """Where a worker's requests go, and the connection it keeps."""

    def __init__(self, url: str, path: str, headers: dict) -> None:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.host, self.tls = u.hostname, u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.path = (u.path.rstrip("/") + path).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.head = (f"Host: {u.netloc}\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n"
                     f"{extra}").encode()
        self.conn: Conn | None = None

    async def connect(self) -> Conn:
        loop = asyncio.get_running_loop()
        ctx = ssl.create_default_context() if self.tls else None
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(Conn, self.host, self.port, ssl=ctx, server_hostname=self.host if ctx else None),
                CONNECT_TIMEOUT)
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            raise Failed(f"TimeoutError: no connection to {self.host}:{self.port} in {CONNECT_TIMEOUT:g} s") from None
        return conn

    async def post(self, body: bytes, sink: Sink, timeout: float) -> float:
        """Sends one request and waits until [DONE]; returns when [DONE] arrived (time.perf_counter()). Raises
        Failed (or OSError, or TimeoutError: `timeout` seconds without a byte)."""
        loop = asyncio.get_running_loop()
        for attempt in (0, 1):
            reused = self.conn is not None and self.conn.open
            conn = self.conn if reused else await self.connect()
            self.conn = None
            answer = conn.answer = Answer(sink, loop.create_future(), loop.create_future())
            conn.transport.write(b"POST %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s"
                                 % (self.path, self.head, len(body), body))
            try:
                await _until(answer.fut, answer, timeout)
                if not answer.complete:  # the chunked body's end usually follows [DONE] at once
                    await asyncio.wait((answer.ended,), timeout=KEEP_WAIT)
            except BaseException as e:
                conn.answer = None  # its end is no longer anyone's business
                conn.close()
                if isinstance(e, Failed) and reused and not answer.seen and attempt == 0:
                    continue  # the kept connection had been closed by the server: once more on a new one
                raise
            conn.answer = None
            if answer.keep and conn.open:
                self.conn = conn
            else:
                conn.close()
            return answer.done_at
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


async def _until(fut: asyncio.Future, answer: Answer, timeout: float) -> None:
    """Waits for fut; raises TimeoutError once `timeout` seconds pass with no byte from the server (one wait per
    quiet stretch, not a timer per byte)."""
    while True:
        left = answer.last + timeout - time.perf_counter()
        if left <= 0:
            raise TimeoutError
        done, _ = await asyncio.wait((fut,), timeout=left)
        if done:
            return fut.result()
