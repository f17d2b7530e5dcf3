"""Text-level engines over EngineCore: blocking Engine.generate and AsyncEngine.stream (one step-loop thread)."""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import uuid
from typing import AsyncIterator, Sequence

from engine.config import EngineConfig
from engine.core import EngineCore, EngineStats
from engine.errors import EngineError, ModelLoadError, RequestError
from engine.outputs import Completion, RequestOutput, RequestState
from engine.sampling import SamplingParams

log = logging.getLogger("engine")

Prompt = str | list[int]


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {model_dir} (expected tokenizer.json / "
                             f"tokenizer_config.json saved with save_pretrained): {e}") from e


class Engine:
    """Synchronous engine: the core plus tokenizer and the per-request text layer."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.core = EngineCore(config)
        self.tokenizer = load_tokenizer(config.model)
        self._ids = itertools.count()

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def new_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> RequestState:
        """Tokenize and admit one request into the core; returns its text-layer state."""
        ids = self.encode(prompt)
        self.core.add_request(request_id, ids, params)
        return RequestState(request_id, ids, params, self.tokenizer)

    def step(self, states: dict[str, RequestState]) -> list[RequestOutput]:
        """One core step, folded through the text layer; requests that finish are dropped from states."""
        results = []
        for out in self.core.step():
            state = states.get(out.request_id)
            if state is None:
                continue
            ro = state.process(out)
            if ro.finished:
                if not out.finished:  # a stop string ended it; the core still holds it
                    self.core.abort_request(out.request_id)
                del states[out.request_id]
            results.append(ro)
        return results

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[Completion]:
        params = params if params is not None else SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise RequestError(f"got {len(prompts)} prompts but {len(plist)} SamplingParams")
        order: list[RequestState] = []
        live: dict[str, RequestState] = {}
        try:
            for prompt, p in zip(prompts, plist):
                state = self.new_request(f"gen-{next(self._ids)}", prompt, p)
                order.append(state)
                live[state.request_id] = state
            while live:
                self.step(live)
        finally:
            for rid in live:
                self.core.abort_request(rid)
        return [s.completion() for s in order]


class AsyncEngine:
    """Runs Engine's step loop in one background thread; coroutines talk to it through a command queue."""

    def __init__(self, config: EngineConfig):
        self.engine = Engine(config)
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._states: dict[str, RequestState] = {}        # engine thread only
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._error: BaseException | None = None
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="engine-step-loop", daemon=True)
        self._thread.start()

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        return self.engine.core.stats()

    async def stream(self, prompt: Prompt, params: SamplingParams | None = None,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        if self._error is not None:
            raise EngineError(f"engine step loop has failed: {self._error!r}")
        rid = request_id or uuid.uuid4().hex
        q: asyncio.Queue = asyncio.Queue()
        self._commands.put(("add", rid, prompt, params or SamplingParams(), (asyncio.get_running_loop(), q)))
        finished = False
        try:
            while not finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # consumer went away (disconnect, cancellation): free the slot
                self._commands.put(("abort", rid))

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self) -> None:
        self._running = False
        self._commands.put(("wake",))
        self._thread.join(timeout=10)

    # ---- engine thread ----
    def _deliver(self, rid: str, item) -> None:
        sink = self._sinks.get(rid)
        if sink is None:
            return
        if isinstance(item, BaseException) or item.finished:
            del self._sinks[rid]
        loop, q = sink
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed
            pass

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, prompt, params, sink = cmd
            self._sinks[rid] = sink
            if rid in self._states:
                self._deliver(rid, RequestError(f"request id {rid!r} is already in use"))
                return
            try:
                self._states[rid] = self.engine.new_request(rid, prompt, params)
            except EngineError as e:
                self._deliver(rid, e)
        elif cmd[0] == "abort":
            state = self._states.pop(cmd[1], None)
            if state is not None:
                self.engine.core.abort_request(cmd[1])
                self._deliver(cmd[1], state.abort())

    def _loop(self) -> None:
        while self._running:
            idle = not self.engine.core.has_unfinished_requests()
            try:
                cmd = self._commands.get(block=idle)
            except queue.Empty:
                cmd = None
            try:
                while cmd is not None:
                    self._handle(cmd)
                    cmd = self._commands.get_nowait() if not self._commands.empty() else None
                if self.engine.core.has_unfinished_requests():
                    for out in self.engine.step(self._states):
                        self._deliver(out.request_id, out)
            except Exception as e:  # a bug or OOM in the step: fail every request instead of hanging them
                log.exception("engine step loop failed")
                self._error = e
                for rid in list(self._sinks):
                    self._deliver(rid, EngineError(f"engine step loop failed: {e!r}"))
                self._running = False
