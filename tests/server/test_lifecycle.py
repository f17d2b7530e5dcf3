"""Process lifecycle: start from a plan, engine death (503 then a non-zero exit), SIGTERM draining (exit 0),
queue-full 429, and start-up failures."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests import plans
from tests.server.live import ROOT, LiveServer, clean_env, free_port
from tests.waiting import wait_until_async

needs_two_cpus = pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1")


def sse_lines(r: httpx.Response):
    return (line[6:] for line in r.iter_lines() if line.startswith("data: "))


@needs_two_cpus
def test_plan_replica_then_engine_death_gives_503_and_a_nonzero_exit(tiny_model, tmp_path):
    plan = plans.make_plan([plans.replica(0, [0], [1], [0], kv_cache_bytes=4 << 20)], model_path=tiny_model)
    plans.write(plan, tmp_path / "plan.json")
    s = LiveServer(tiny_model, "--plan", str(tmp_path / "plan.json"), "--replica", "0", "--max-model-len", "1000")
    try:
        s.wait_ready()
        (card,) = s.get("/v1/models").json()["data"]
        assert (card["id"], card["max_model_len"]) == ("planned", 1000)  # served name from the plan, flag wins
        rep = s.get("/debug/binding").json()
        assert (rep["engine"]["source"], rep["engine"]["planned_cpus"]) == ("plan", "0")
        assert [t["allowed_cpus"] for t in rep["engine"]["threads"] if t["omp_thread"] is not None] == ["0"]
        assert rep["frontend"]["allowed_cpus"] == "1"
        assert "binding (plan): inference CPUs 0 (1 OpenMP threads)" in s.log()
        # the engine extra's C event loop and HTTP parser, not uvicorn's pure-Python fallbacks (launch.py says why)
        assert "(uvloop event loop, httptools HTTP parser)" in s.log()

        body = {"prompt": "Hello", "max_tokens": 990, "ignore_eos": True, "stream": True}
        engine_pid = s.engine_pid()
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as r:
            lines = sse_lines(r)
            json.loads(next(lines))
            os.kill(engine_pid, signal.SIGKILL)
            killed = time.monotonic()
            rest = list(lines)
        assert rest[-1] == "[DONE]" and "engine process died" in json.loads(rest[-2])["error"]["message"]
        status = None
        while time.monotonic() - killed < 1.0 and status != 503:
            status = httpx.get(f"{s.url}/health", timeout=1).status_code
        assert status == 503
        assert s.proc.wait(timeout=30) == 1
        assert "engine process" in s.log() and "exited unexpectedly" in s.log()
    finally:
        s.close()


async def _drain_scenario(s: LiveServer, terminate) -> tuple[list, int, int, int, list[int]]:
    body = {"prompt": "Hello", "max_tokens": 600, "ignore_eos": True, "stream": True, "temperature": 0}

    async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
        started = [asyncio.Event(), asyncio.Event()]
        received: list[list[str]] = [[], []]

        async def stream(i: int) -> list[str]:
            lines = received[i]
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        started[i].set()
            return lines

        streams = [asyncio.create_task(stream(i)) for i in range(2)]  # fill max_num_seqs 2, no waiting room
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        full = await c.post("/v1/completions", json={**body, "stream": False})
        assert full.headers.get("retry-after")
        at_signal = [len(x) for x in received]
        terminate()

        async def draining() -> bool:  # the signal handled: /health turns 503 when draining starts
            return (await c.get("/health")).status_code == 503
        await wait_until_async(draining, timeout=30, what="the server to start draining")
        late = await c.post("/v1/completions", json={**body, "stream": False})
        health = await c.get("/health")
        return await asyncio.gather(*streams), full.status_code, late.status_code, health.status_code, at_signal


@pytest.mark.parametrize("group", [False, True], ids=["to-the-server", "to-its-process-group"])
def test_sigterm_finishes_in_flight_requests_then_exits_0(tiny_model, group):
    """`docker stop` signals PID 1; systemd, `timeout` and shells signal the whole group, engine included."""
    s = LiveServer(tiny_model, "--max-num-seqs", "2", "--max-waiting", "0", "--max-model-len", "1024",
                   new_session=group)
    try:
        s.wait_ready()
        terminate = ((lambda: os.killpg(s.proc.pid, signal.SIGTERM)) if group
                     else (lambda: s.proc.send_signal(signal.SIGTERM)))
        streams, full, late, health, at_signal = asyncio.run(_drain_scenario(s, terminate))
        assert (full, late, health) == (429, 503, 503)
        for lines, before in zip(streams, at_signal):
            assert lines[-1] == "[DONE]"
            assert len(lines) - before > 100  # much of each answer was generated after the signal
            chunks = [json.loads(x) for x in lines[:-1]]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert s.proc.wait(timeout=60) == 0
        assert "SIGTERM: no new requests" in s.log() and "Traceback" not in s.log()
    finally:
        s.close()


def test_missing_model_directory_exits_3(tmp_path):
    cmd = [sys.executable, "-m", "engine", "serve", str(tmp_path / "nope"), "--host", "127.0.0.1",
           "--port", str(free_port())]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT, env=clean_env(), timeout=120)
    assert r.returncode == 3 and "does not exist" in r.stderr


def test_model_that_cannot_load_exits_3_with_the_reason(tiny_model, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in os.listdir(tiny_model):
        if f.startswith("tokenizer"):
            shutil.copy(os.path.join(tiny_model, f), broken)
    s = LiveServer(str(broken))
    try:  # caught before any process starts, naming every missing piece
        assert s.proc.wait(timeout=120) == 3
        assert "lacks config.json, weights (*.safetensors)" in s.log() and "Traceback" not in s.log()
    finally:
        s.close()
    shutil.copy(os.path.join(tiny_model, "config.json"), broken)
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    s = LiveServer(str(broken))
    try:  # present but unreadable: the engine process reports it and the server exits 3
        assert s.proc.wait(timeout=120) == 3
        assert "engine failed to start" in s.log() and "model.safetensors" in s.log()
    finally:
        s.close()
