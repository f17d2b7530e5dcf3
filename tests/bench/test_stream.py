"""bench's streaming client (deploykit/bench/stream.py) against a real HTTP server on loopback: a worker keeps its
connection, a kept connection the server closed while idle is retried on a new one, SSE lines split across reads,
a server that goes silent times out, and HTTPS verifies the server's certificate."""
from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

from deploykit.bench import client, report, stream
from tests.bench.misbehaving import Misbehaving


def workload(url: str, **kw) -> client.Workload:
    return client.Workload(url, "fake", 4, ignore_eos=False, **kw)


def run(w: client.Workload, concurrency: int, requests: int) -> list[client.Result]:
    return client.run(client.run_level(w, ["hi"] * requests, concurrency=concurrency, requests=requests))


def test_a_worker_keeps_its_connection_while_the_server_does():
    with Misbehaving(behaviours=("good",)) as server:
        results = run(workload(server.url), concurrency=2, requests=8)
    assert [r.error for r in results] == [None] * 8
    assert all(r.chunks == 4 and r.output_tokens == 4 and r.status == 200 for r in results)
    assert server.connections == 2  # one a worker, not one a request


def test_a_kept_connection_the_server_closed_is_retried_on_a_new_one():
    async def two_requests(url: str) -> list[float]:
        endpoint = stream.Endpoint(url, "/v1/completions", {})
        ends = []
        for _ in range(2):
            tally = client.Tally(chat=False)
            ends.append(await endpoint.post(b'{"prompt": "hi", "stream": true}', tally, timeout=10))
            assert len(tally.stamps) == 4 and tally.status == 200
            await asyncio.sleep(0.5)  # the server closes the idle connection meanwhile
        endpoint.close()
        return ends

    with Misbehaving(behaviours=("good",), idle=0.1) as server:
        ends = client.run(two_requests(server.url))
    assert ends[0] < ends[1]
    assert server.connections == 2


def test_sse_lines_split_across_reads_are_put_back_together():
    with Misbehaving(behaviours=("trickle",), chunks=6) as server:
        [r] = run(workload(server.url), concurrency=1, requests=1)
    assert r.error is None and r.chunks == 6 and r.output_tokens == 6 and r.counted == "chunks"
    assert len(r.itl) == 5 and all(g >= 0 for g in r.itl)


def test_a_server_that_goes_silent_fails_the_request_after_the_timeout():
    with Misbehaving(behaviours=("stall",), delay=5.0) as server:
        t0 = time.perf_counter()
        [r] = run(workload(server.url, timeout=0.4), concurrency=1, requests=1)
    assert r.error == "TimeoutError: no answer for 0.4 s"
    assert r.chunks == 1 and r.ttft is not None and 0.4 <= r.e2e < 3.0 and time.perf_counter() - t0 < 4.0


def test_an_unreachable_endpoint_is_a_counted_error():
    with Misbehaving() as server:
        url = server.url
    [r] = run(workload(url), concurrency=1, requests=1)  # the server is gone: refused
    assert r.error.startswith("ConnectionRefusedError: ") and r.status is None


def test_https_verifies_the_certificate(tmp_path, monkeypatch):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert], check=True,
                   capture_output=True)
    with Misbehaving(behaviours=("good",), tls=(str(cert), str(key))) as server:
        assert server.url.startswith("https://")
        [bad] = run(workload(server.url), concurrency=1, requests=1)  # not signed by a CA this host trusts
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # read when a default context is made
        [good] = run(workload(server.url), concurrency=1, requests=1)
    assert bad.error.startswith("SSLCertVerificationError: ") and "certificate verify failed" in bad.error
    assert good.error is None and good.chunks == 4


def test_a_url_that_is_not_http_is_refused():
    with pytest.raises(ValueError, match="not an http"):
        stream.Endpoint("ftp://example.org", "/v1/completions", {})


def test_a_level_whose_client_took_a_tenth_of_a_cpu_says_so_under_the_table():
    def level(c: int, share: float) -> dict:
        return {"concurrency": c, "error_samples": [], "tokens_from": {"usage": 8}, "short_requests": 0,
                "output_tokens": 800, "client_cpu_s": share * 2.0, "client_cpu_share": share}

    doc = {"prompts": {"exact": True}, "levels": [level(1, 0.02), level(16, 0.3)]}
    assert report.notes(doc) == ["concurrency 16: this client used 30% of a CPU (750 µs a token); on a host it "
                                 "shares with the server, that is CPU the server did not get"]
