"""The front-end process's side of serving: tokenizer, engine state, admission, and per-request text streams
(detokenization, stop strings) fed by the engine process's token outputs."""
from __future__ import annotations

import asyncio
import collections
import enum
import functools
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from engine import tokenizer as tokenizers
from engine.errors import RequestError
from engine.messages import (AbortRequest, AddRequest, Call, EngineStats, Fatal, Op, Ready, Rejected, StepResult)
from engine.outputs import RequestOutput, RequestState, fold
from engine.params import SamplingParams, check_prompt, check_token_ids
from engine.server.errors import APIError, bad_request, from_request_error, unavailable
from engine.server.metrics import Metrics
from engine.server.templates import ChatTemplate
from engine.server.worker import EngineProcess

log = logging.getLogger("engine.server")
LONG_TEXT = 16_384  # characters; longer texts are tokenized off the event loop
T = TypeVar("T")
CHARS_PER_TOKEN = 4  # a decode's size in characters, estimated from its token count
RPC_TIMEOUT = 10.0


class State(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"


class Choice:
    __slots__ = ("engine_id", "gen", "index", "last_at", "state")

    def __init__(self, engine_id: str, index: int, gen: Generation, state: RequestState):
        self.engine_id, self.index, self.gen, self.state = engine_id, index, gen, state
        self.last_at: float | None = None


class Generation:
    """One API request: its engine requests (prompts x n) merged into one stream of (choice index, output)."""

    def __init__(self, fe: Frontend, request_id: str, prompt_lens: list[int], arrival: float | None = None):
        self.fe, self.request_id, self.prompt_lens = fe, request_id, prompt_lens
        self.arrival = time.monotonic() if arrival is None else arrival  # before tokenization, for TTFT
        self.first_at: float | None = None
        self.created = int(time.time())
        self.choices: list[Choice] = []
        # Outputs waiting for the stream, and the future it sleeps on while there are none. Not an asyncio.Queue read
        # through asyncio.wait_for: on Python 3.11 that wraps every get in a new Task, a cost paid per token of every
        # stream on CPUs the front end shares with the engine.
        self._items: collections.deque[tuple[int, RequestOutput] | APIError] = collections.deque()
        self._waiter: asyncio.Future | None = None

    def put(self, item: tuple[int, RequestOutput] | APIError) -> None:
        """A choice's output, or the error that ends the stream (event-loop thread)."""
        self._items.append(item)
        if self._waiter is not None:
            _wake(self._waiter)

    async def stream(self, keepalive: float | None = None) -> AsyncIterator[tuple[int, RequestOutput] | None]:
        """Yields every output until all choices finished; raises APIError if the engine refused or died. With
        `keepalive`, yields None after that many seconds without output (a queued request, a long prefill), so an
        SSE stream can show the client and any proxy it is alive. Callers must call cancel() when they stop early
        (client gone)."""
        remaining = len(self.choices)
        loop = asyncio.get_running_loop()
        while remaining:
            if not self._items:
                self._waiter = waiter = loop.create_future()
                timer = loop.call_later(keepalive, _wake, waiter) if keepalive else None
                try:
                    await waiter
                finally:
                    self._waiter = None
                    if timer is not None:
                        timer.cancel()
                if not self._items:  # woken by the timer
                    yield None
                    continue
            item = self._items.popleft()
            if isinstance(item, APIError):
                raise item
            remaining -= item[1].finished
            yield item

    def cancel(self) -> None:
        """Abort every unfinished choice in the engine (frees its KV cache)."""
        self.fe.drop(self, None)


class Frontend:
    def __init__(self, tokenizer, engine: EngineProcess, model_name: str, *, max_num_seqs: int, max_waiting: int,
                 stall_timeout: float = 0.0, sse_keepalive: float | None = 15.0, tool_call_parser: str = "auto",
                 reasoning_parser: str = "auto"):
        self.tokenizer = tokenizer
        self.chat_template = ChatTemplate(tokenizer, tool_call_parser, reasoning_parser)
        self.sse_keepalive = sse_keepalive  # seconds of silence before an SSE comment line
        self.engine = engine
        self.model_name = model_name
        self.capacity = max_num_seqs + max_waiting
        self.state = State.LOADING
        self.info: Ready | None = None
        self.stats = EngineStats()
        self.metrics = Metrics(model_name, lambda: self.stats, lambda: self.state is State.READY)
        self.on_engine_exit: Callable[[int | None], None] = lambda code: None
        self._choices: dict[str, Choice] = {}
        self._ops: list[Op] = []
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Watchdog: with requests in flight, the engine sends a StepResult after every step (even a prefill chunk
        # that samples nothing). No message for stall_timeout seconds means it hangs: fail the requests, kill it,
        # and let the server exit so Docker or Kubernetes restarts it. 0 disables the watchdog.
        self.stall_timeout = stall_timeout
        self.last_progress = time.monotonic()
        self.stalled: str | None = None

    @property
    def max_model_len(self) -> int | None:
        return self.info.max_model_len if self.info else None

    @property
    def num_inflight(self) -> int:
        return len(self._choices)

    def attach(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine.attach(self._loop, self._on_message, self._on_exit)
        if self.stall_timeout > 0:
            self._watchdog_task = self._loop.create_task(self._watchdog())

    async def _watchdog(self) -> None:
        while self.state in (State.LOADING, State.READY, State.DRAINING):
            await asyncio.sleep(min(1.0, self.stall_timeout / 4))
            silent = time.monotonic() - self.last_progress
            if self.state is not State.LOADING and self._choices and silent > self.stall_timeout:
                self.stalled = (f"the engine made no progress for {silent:.0f} s (stall timeout "
                                f"{self.stall_timeout:g} s) with {self.num_inflight} request(s) in flight")
                log.error("%s; killing engine process %s", self.stalled, self.engine.pid)
                self.engine.kill()  # EOF on its socket then fails the requests and ends the server (_on_exit)
                return

    # ---- admission ----
    def check_available(self) -> None:
        if self.state is State.LOADING:
            raise unavailable("the model is still loading", retry_after=5)
        if self.state is State.DRAINING:
            raise unavailable("the server is shutting down")
        if self.state is State.DEAD:
            raise unavailable("the engine process has stopped; the server is restarting")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def check_fits(self, count: int, param: str) -> None:
        """A request with more sequences than the server can ever hold is a client error, not 'retry later'."""
        if count > self.capacity:
            raise bad_request(f"the request needs {count} sequences (prompts x n) but this server holds at most "
                              f"{self.capacity} (max_num_seqs + max_waiting); send fewer prompts or a smaller n",
                              param)

    def admit(self, count: int) -> None:
        if self.num_inflight + count > self.capacity:
            raise APIError(429, f"too many requests waiting ({self.num_inflight} in flight, capacity "
                           f"{self.capacity}); retry later", code="queue_full", headers={"Retry-After": "1"})

    def check_token_ids(self, params: SamplingParams) -> None:
        try:
            check_token_ids(params, self.info.vocab_size)
        except RequestError as e:
            raise from_request_error(e) from None

    def check_prompt(self, ids: list[int], max_tokens: int | None, param: str) -> None:
        """Before anything is sent: a streaming request's 400 must come before its 200 and first chunk."""
        try:
            check_prompt(ids, max_tokens, vocab_size=self.info.vocab_size, max_model_len=self.info.max_model_len,
                         param=param)
        except RequestError as e:
            raise from_request_error(e) from None

    # ---- tokenizer ----
    @staticmethod
    async def off_loop(size: int, work: Callable[[], T]) -> T:
        """Run `work` in a thread when it handles more than LONG_TEXT characters in all (one request's whole batch,
        not each string): a long tokenization would stall every stream served by this loop."""
        if size > LONG_TEXT:
            return await asyncio.get_running_loop().run_in_executor(None, work)
        return work()

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return (await self.encode_many([text], add_special_tokens))[0]

    async def encode_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return await self.off_loop(sum(map(len, texts)), lambda: [
            self.tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts])

    async def decode_many(self, prompts: list[list[int]]) -> list[str]:
        return await self.off_loop(CHARS_PER_TOKEN * sum(map(len, prompts)), lambda: [self.decode(x) for x in prompts])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one Frontend per process, bounded by the vocabulary
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        return tokenizers.token_bytes(self.tokenizer, token_id)

    # ---- requests ----
    def submit(self, request_id: str, prompts: list[list[int]], params: list[list[SamplingParams]],
               arrival: float | None = None) -> Generation:
        """Send prompts[i] once per entry of params[i]; choice index = position in that flattened order.
        `arrival`: time.monotonic() when the HTTP request came in (default now)."""
        self.admit(sum(map(len, params)))  # still room after the (possibly off-loop) template and tokenizing
        self.check_available()  # the engine may have died while this request was being tokenized
        gen = Generation(self, request_id, [len(p) for p in prompts], arrival)
        if not self._choices:  # the engine was idle: its silence until now was not a stall
            self.last_progress = time.monotonic()
        for ids, plist in zip(prompts, params):
            for p in plist:
                index = len(gen.choices)
                eid = f"{request_id}-{index}"
                ch = Choice(eid, index, gen, RequestState(eid, ids, p, self.tokenizer))
                gen.choices.append(ch)
                self._choices[eid] = ch
                self._send(AddRequest(eid, tuple(ids), p))
        return gen

    def drop(self, gen: Generation, error: APIError | None) -> None:
        for ch in gen.choices:
            if self._choices.pop(ch.engine_id, None) is not None:
                self._send(AbortRequest(ch.engine_id))
                if error is None:  # the client went away
                    self.metrics.finished("abort")
        if error is not None:
            gen.put(error)

    def abort_all(self) -> None:
        """Finish every request now with finish_reason "abort" (shutdown grace period over)."""
        for ch in list(self._choices.values()):
            del self._choices[ch.engine_id]
            self._send(AbortRequest(ch.engine_id))
            self.metrics.finished("abort")
            ch.gen.put((ch.index, ch.state.abort()))

    async def call(self, name: str):
        fut = self._loop.create_future()
        cid = next(self._ids)
        self._calls[cid] = fut
        self._send(Call(cid, name))
        try:
            return await asyncio.wait_for(fut, RPC_TIMEOUT)
        except asyncio.TimeoutError:
            raise unavailable(f"the engine process did not answer '{name}' within {RPC_TIMEOUT:.0f} s") from None
        finally:
            self._calls.pop(cid, None)

    def _send(self, op: Op) -> None:
        # Everything queued during one event-loop iteration goes out as one message.
        if not self._ops:
            self._loop.call_soon(self._flush)
        self._ops.append(op)

    def _flush(self) -> None:
        ops, self._ops = self._ops, []
        if ops:
            self.engine.send(ops)

    # ---- engine process events (event-loop thread) ----
    def _on_message(self, msg: StepResult | Ready | Fatal) -> None:
        self.last_progress = time.monotonic()  # the watchdog's evidence that the engine is alive
        if isinstance(msg, StepResult):
            self._on_step(msg)
        elif isinstance(msg, Ready):
            self.info = msg
            if self.state is State.LOADING:
                self.state = State.READY
            log.info("engine ready: pid %d, max_model_len %d", msg.pid, msg.max_model_len)
        elif isinstance(msg, Fatal):
            log.error("%s", msg.message)

    def _on_step(self, step: StepResult) -> None:
        self.stats = step.stats
        now = time.monotonic()
        for out in step.outputs:
            ch = self._choices.get(out.request_id)
            if ch is None:
                continue  # aborted here while the step ran
            try:
                self._deliver(ch, out, now)
            except Exception as e:  # a bug in one request's text layer fails that request, not the others
                log.exception("processing the output of %s failed", out.request_id)
                self.drop(ch.gen, APIError(500, f"the server failed while decoding this request's output: "
                                                f"{type(e).__name__}"))
        for r in step.rejected:
            ch = self._choices.get(r.request_id)
            if ch is not None:
                self.drop(ch.gen, _rejection(r))
        for reply in step.replies:
            fut = self._calls.get(reply.call_id)
            if fut is not None and not fut.done():
                fut.set_result(reply.result)

    def _deliver(self, ch: Choice, out, now: float) -> None:
        """One engine output through the request's text layer to its stream, with the latency metrics."""
        m = self.metrics
        ro, abort = fold(ch.state, out)
        if ch.gen.first_at is None:  # once per request (n choices share one arrival)
            ch.gen.first_at = now
            m.ttft.observe(now - ch.gen.arrival)
        if ch.last_at is not None:  # a run of decode steps brings several tokens at once: each gets its share
            n = max(1, len(out.new_token_ids))
            for _ in range(n):
                m.itl.observe((now - ch.last_at) / n)
        ch.last_at = now
        if abort:
            self._send(AbortRequest(out.request_id))
        if ro.finished:
            del self._choices[out.request_id]
            m.e2e.observe(now - ch.gen.arrival)
            m.finished(ro.finish_reason)
        ch.gen.put((ch.index, ro))

    def _on_exit(self, code: int | None) -> None:
        if self.engine.stopping:
            return
        self.state = State.DEAD
        if self.stalled:
            dead = unavailable("the engine stopped making progress; the server is restarting")
        else:
            log.error("engine process %s exited unexpectedly (exit code %s); failing %d request(s) and shutting "
                      "down", self.engine.pid, code, self.num_inflight)
            dead = unavailable("the engine process died; the server is restarting")
        for gen in {ch.gen for ch in self._choices.values()}:
            self.drop(gen, dead)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(dead)
        self.on_engine_exit(code)


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _rejection(r: Rejected) -> APIError:
    return APIError(r.status, r.message, param=r.param, code=r.code)
