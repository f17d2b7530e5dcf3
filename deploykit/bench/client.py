"""The load: streamed completions (or chat completions), one closed-loop worker per concurrent stream, each on its
own HTTP/1.1 connection (stream.py says why not httpx, which makes bench's other calls).

Every request is timed from the moment it is sent: time to the first content chunk (TTFT), the gaps between
content chunks (inter-token latencies), end to end. Output tokens come from the usage chunk
(`stream_options.include_usage`); for a server that sends none, a stream that ended with finish_reason "length"
made max_tokens tokens, and any other is counted by its content chunks; each result says which.
A request that fails in any way (HTTP 4xx/5xx, a refused or dropped connection, an error inside the stream, a
stream that ends before `[DONE]`) is a Result with `error` set: counted and sampled, never raised.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from . import stream

ERROR_TEXT = stream.ERROR_TEXT  # characters of an error body kept in a sample


@dataclass(frozen=True, slots=True)
class Workload:
    """What every request of a run sends. `url` is the server's base (no /v1)."""

    url: str
    model: str
    max_tokens: int
    chat: bool = False
    api_key: str | None = None
    ignore_eos: bool = True  # vLLM's and our extension: always exactly max_tokens
    extra_body: dict = field(default_factory=dict)  # merged into every request (a server's own knobs)
    timeout: float = 600.0  # seconds without a byte from the server before a request fails

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def request(self, prompt: str) -> tuple[str, dict]:
        body: dict = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0.0, "stream": True,
                      "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return ("/v1/chat/completions" if self.chat else "/v1/completions"), {**body, **self.extra_body}


@dataclass(frozen=True, slots=True)
class Result:
    index: int  # the request's number in its level
    start: float  # seconds after the level began
    e2e: float  # seconds from sending to the end of the stream (or the failure)
    ttft: float | None = None
    itl: tuple[float, ...] = ()  # gaps between consecutive content chunks
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from the usage chunk
    # where output_tokens comes from: "usage" (the usage chunk); without one, "length" (the stream ended with
    # finish_reason length: it generated max_tokens) or "chunks" (content chunks counted: a chunk can hold several
    # tokens when a server holds back partial UTF-8, so this may undercount)
    counted: str = "usage"
    chunks: int = 0  # content chunks received
    finish_reason: str | None = None
    error: str | None = None
    status: int | None = None  # HTTP status, when there was one


def _content(chunk: dict, chat: bool) -> bool:
    """Whether a chunk carries generated text (a chat's first chunk often holds only the role)."""
    for choice in chunk.get("choices") or ():
        if chat:
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
                return True
        elif choice.get("text"):
            return True
    return False


class Tally(stream.Sink):
    """One stream's chunks as they arrive: content chunks stamped, the last finish_reason, the usage chunk."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.stamps: list[float] = []
        self.usage: dict | None = None
        self.finish: str | None = None

    def line(self, data: bytes, at: float) -> str | None:
        if data == b"[DONE]":
            return stream.DONE
        try:
            chunk = json.loads(data)
        except ValueError:
            return f"not JSON in the stream: {data[:ERROR_TEXT].decode(errors='replace')}"
        if not isinstance(chunk, dict):
            return f"not a chunk object in the stream: {data[:ERROR_TEXT].decode(errors='replace')}"
        if "error" in chunk:
            return f"error in the stream: {stream.error_text(chunk)}"
        if _content(chunk, self.chat):
            self.stamps.append(at)
        for choice in chunk.get("choices") or ():
            self.finish = choice.get("finish_reason") or self.finish
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        return None


async def one(endpoint: stream.Endpoint, w: Workload, prompt: str | list[int], index: int,
              level_start: float) -> Result:
    """Send one streamed request on the worker's endpoint and time it. Never raises for anything the server or the
    network does."""
    body = json.dumps(w.request(prompt)[1]).encode()
    tally = Tally(w.chat)
    stamps = tally.stamps
    sent = time.perf_counter()
    start = sent - level_start
    try:
        end = await endpoint.post(body, tally, w.timeout)
    except (stream.Failed, OSError, TimeoutError) as e:
        if isinstance(e, stream.Failed):
            error = str(e)
        elif isinstance(e, TimeoutError):
            error = f"TimeoutError: no answer for {w.timeout:g} s"
        else:  # refused, reset, unreachable
            error = f"{type(e).__name__}: {e.strerror or e}"[:ERROR_TEXT]
        return Result(index, start, time.perf_counter() - sent, stamps[0] - sent if stamps else None,
                      chunks=len(stamps), error=error, status=tally.status)
    usage, finish = tally.usage, tally.finish
    tokens = usage.get("completion_tokens") if usage else None
    counted = "usage" if isinstance(tokens, int) else "length" if finish == "length" else "chunks"
    return Result(index, start, end - sent, stamps[0] - sent if stamps else None,
                  tuple(b - a for a, b in zip(stamps, stamps[1:])),
                  output_tokens={"usage": tokens, "length": w.max_tokens}.get(counted, len(stamps)),
                  prompt_tokens=usage.get("prompt_tokens") if usage else None, counted=counted, chunks=len(stamps),
                  finish_reason=finish, status=tally.status)


def cpu_seconds() -> float:
    """This process's CPU time so far (user + system, every thread; os.times() counts in 10 ms ticks)."""
    return time.process_time()


def run(main):
    """asyncio.run, on uvloop where it is installed: the same Protocol streams cost about 2.3x the client CPU an event
    on asyncio's own loop (54-61 against 22-27 µs, 16 x 512 events on loopback)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def new_client(timeout: float, concurrency: int):
    """bench's other calls (models, tokenize, metrics): httpx; loopback and LAN endpoints: no proxy from the
    environment (trust_env=False)."""
    import httpx
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), trust_env=False,
                             limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency))


async def run_level(w: Workload, prompts: Sequence[str], *, concurrency: int, requests: int | None = None,
                    duration: float | None = None, sink: list | None = None,
                    on_result: Callable[[Result], None] = lambda r: None) -> list[Result]:
    """`concurrency` workers each send a request, wait for its end, and send the next, until `requests` were sent
    or `duration` seconds passed (requests in flight then finish and count). Prompt i is prompts[i % len]: callers
    pass distinct prompts so that no request hits another's cached prefix. Results are appended to `sink` as they
    finish, so what was measured survives a Ctrl-C that cancels the rest."""
    sink = [] if sink is None else sink
    numbers = itertools.count()
    start = time.perf_counter()
    path = w.request("")[0]

    async def worker() -> None:
        endpoint = stream.Endpoint(w.url, path, w.headers())  # one connection a worker, kept while the server does
        try:
            while True:
                i = next(numbers)
                if requests is not None and i >= requests:
                    return
                if duration is not None and time.perf_counter() - start >= duration:
                    return
                r = await one(endpoint, w, prompts[i % len(prompts)], i, start)
                sink.append(r)
                on_result(r)
        finally:
            endpoint.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sink
