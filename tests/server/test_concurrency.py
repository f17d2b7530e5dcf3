"""Many concurrent streams, half of them abandoned mid-stream: the rest complete and every KV block comes back."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.server.conftest import API_KEY
from tests.server.live import LiveServer
from tests.waiting import wait_until

CLIENTS = 32
MAX_TOKENS = 48
ABANDONED_MAX_TOKENS = 2000


@pytest.fixture(scope="module")
def long_server(tiny_model):
    # A long max_model_len so abandoned requests cannot finish before the server notices the client left,
    # however fast the machine: 2000 tokens is thousands of decode steps.
    s = LiveServer(tiny_model, "--max-model-len", "2048", "--max-num-seqs", "16", "--served-model-name", "tiny",
                   api_key=API_KEY)
    try:
        yield s.wait_ready()
    finally:
        s.close()


async def stream(c: httpx.AsyncClient, i: int, abandon_after: int | None) -> dict:
    max_tokens = MAX_TOKENS if abandon_after is None else ABANDONED_MAX_TOKENS
    body = {"model": "tiny", "prompt": f"Client number {i} says", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    seen = {"chunks": 0, "text": "", "finish": None, "done": False}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                seen["done"] = True
                break
            choice = json.loads(line[6:])["choices"][0]
            seen["chunks"] += 1
            seen["text"] += choice["text"]
            seen["finish"] = choice["finish_reason"] or seen["finish"]
            if seen["chunks"] == abandon_after:
                return seen  # leaving the block closes the connection mid-stream
    return seen


async def run_clients(server) -> list[dict]:
    limits = httpx.Limits(max_connections=CLIENTS * 2)
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120, limits=limits) as c:
        return await asyncio.gather(*(stream(c, i, 3 if i % 2 else None) for i in range(CLIENTS)))


def test_abandoned_streams_are_aborted_and_the_rest_complete(long_server):
    server = long_server
    mark = server.log_size()
    tokens_before = server.metric("deploykit_generation_tokens_total")
    aborts_before = server.metric("deploykit_request_success_total", finished_reason="abort")
    results = asyncio.run(run_clients(server))

    kept = results[0::2]
    assert all(r["done"] and r["finish"] == "length" for r in kept), kept
    assert len({r["text"] for r in kept}) > 1  # different prompts, different greedy continuations

    wait_until(lambda: not (server.metric("deploykit_num_requests_running")
                            or server.metric("deploykit_kv_cache_usage_ratio")), timeout=15, interval=0.1,
               what="every request to leave the batch and give back its KV blocks")
    assert server.metric("deploykit_num_requests_running") == 0
    assert server.metric("deploykit_num_requests_waiting") == 0
    assert server.metric("deploykit_kv_cache_usage_ratio") == 0
    aborts = server.metric("deploykit_request_success_total", finished_reason="abort")
    assert aborts - aborts_before == CLIENTS // 2
    generated = server.metric("deploykit_generation_tokens_total") - tokens_before
    assert generated < (CLIENTS // 2) * (MAX_TOKENS + ABANDONED_MAX_TOKENS // 2)  # abandoned ones stopped early
    log = server.log(mark)
    assert "ERROR" not in log and "Traceback" not in log and "Exception" not in log


def test_client_gone_before_a_blocking_response_aborts_it(long_server):
    server = long_server
    aborts = server.metric("deploykit_request_success_total", finished_reason="abort")
    tokens = server.metric("deploykit_generation_tokens_total")
    body = {"model": "tiny", "prompt": "Hello", "n": 8, "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        server.post("/v1/completions", body, timeout=1.0)
    wait_until(lambda: not server.metric("deploykit_num_requests_running"), timeout=15,
               what="the abandoned request to leave the batch")
    assert server.metric("deploykit_request_success_total", finished_reason="abort") - aborts == 8
    assert server.metric("deploykit_kv_cache_usage_ratio") == 0
    assert server.metric("deploykit_generation_tokens_total") - tokens < 8 * 2000
