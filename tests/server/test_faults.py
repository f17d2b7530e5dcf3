"""A fault in one operation stays with it: an exception while aborting or answering a call does not end the
engine's loop, and an exception in one request's text layer fails that request (500) while the others in the same
step get their outputs. Faults no real input produces today, so they are injected into the real objects."""
from __future__ import annotations

import asyncio
import socket
from multiprocessing.connection import Connection

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.messages import AbortRequest, AddRequest, Call, EngineStats, StepResult, TokenOutput
from engine.params import SamplingParams
from engine.server.errors import APIError
from engine.server.frontend import Frontend, State
from engine.server.worker import _Loop


def test_engine_loop_survives_a_failing_abort_and_call(tiny_model, monkeypatch):
    core = EngineCore(EngineConfig(tiny_model, dtype="float32", max_model_len=64))
    a, b = socket.socketpair()
    loop = _Loop(core, Connection(a.detach()), report=lambda: 1 / 0)
    rejected, replies = [], []
    loop._apply(AddRequest("r1", (5, 6, 7), SamplingParams(max_tokens=2)), rejected, replies)
    assert loop.live == {"r1"} and not rejected

    def broken(rid):
        raise RuntimeError("boom")
    monkeypatch.setattr(core, "abort_request", broken)
    loop._apply(AbortRequest("r1"), rejected, replies)  # raised inside: logged, never out of the loop
    assert "r1" in loop.live  # the core still runs it: it stays tracked, so a failed step can still fail it
    loop._apply(Call(7, "binding"), rejected, replies)  # the report itself raises ZeroDivisionError
    assert replies[-1].call_id == 7 and "ZeroDivisionError" in replies[-1].result["error"]
    monkeypatch.undo()
    loop._apply(AddRequest("r2", (5, 6), SamplingParams(max_tokens=1)), rejected, replies)
    assert "r2" in loop.live and not rejected  # still taking requests
    b.close()


class _Engine:
    """The engine-process handle as the front end sees it: what was sent is recorded."""
    pid = 0
    stopping = False

    def __init__(self):
        self.sent = []

    def send(self, ops):
        self.sent += ops


def test_a_failing_text_layer_fails_one_request_not_the_step(tokenizer, monkeypatch):
    async def main():
        engine = _Engine()
        fe = Frontend(tokenizer, engine, "tiny", max_num_seqs=4, max_waiting=4)
        fe._loop = asyncio.get_running_loop()
        fe.state = State.READY
        params = [[SamplingParams(max_tokens=4)]]
        bad = fe.submit("bad", [[5, 6]], params)
        good = fe.submit("good", [[5, 6]], params)

        def broken(out):
            raise UnicodeError("detokenizer bug")
        monkeypatch.setattr(bad.choices[0].state, "process", broken)
        step = StepResult(outputs=(TokenOutput("bad-0", (9,), None, False, None),
                                   TokenOutput("good-0", (9,), None, False, None)), stats=EngineStats())
        fe._on_step(step)
        await asyncio.sleep(0)  # the batched abort goes out on the next loop iteration
        index, ro = await anext(good.stream())
        assert index == 0 and ro.token_ids == [9] and not ro.finished
        with pytest.raises(APIError) as err:
            await anext(bad.stream())
        assert err.value.status == 500
        assert "bad-0" not in fe._choices and "good-0" in fe._choices
        assert AbortRequest("bad-0") in engine.sent  # its KV cache is freed in the engine

    asyncio.run(main())
