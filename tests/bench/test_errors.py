"""`deploykit bench` against a real HTTP server that misbehaves (tests/bench/misbehaving.py): 5xx, 429, dropped
connections and errors inside streams are counted with samples, never crash the run; a server without usage chunks
or /tokenize gets counted chunks and estimated prompt lengths, both labelled; Ctrl-C keeps what was measured; the
plot is a PNG and --compare reads two runs."""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys

import pytest

from tests.bench.misbehaving import Misbehaving
from tests.runtime.helpers import ROOT
from tests.waiting import wait_until

SMALL = ("--requests", "10", "--max-tokens", "4", "--prompt-tokens", "16", "--no-progress", "--warmup", "0")


def bench(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploykit.cli", "bench", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120, **kw)


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow
def test_errors_are_counted_with_samples_and_the_run_completes(tmp_path):
    with Misbehaving() as server:
        r = bench(server.url, "--concurrency", "1,2", *SMALL, "--out", tmp_path / "r.json", "--plot", tmp_path / "r.png")
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "r.json").read_text())
    for lv in doc["levels"]:  # 10 requests in turn: good, 500, 429, cut mid-body, error event
        assert (lv["requests"], lv["errors"]) == (2, 8)
        assert {e["error"]: e["count"] for e in lv["error_samples"]} == {
            "HTTP 500: engine exploded": 2, "HTTP 429: queue full": 2, "error in the stream: stopped mid-way": 2,
            "the server closed the connection before the end of the answer": 2}
        assert len(lv["raw"]) == 10 and sorted(x["status"] for x in lv["raw"] if x["error"]).count(500) == 2
        assert lv["tokens_from"] == {"chunks": 2}  # no usage chunk: counted, and labelled
        assert lv["output_tokens"] == 2 * 4
    assert doc["prompts"]["exact"] is False and doc["prompts"]["source"].startswith("estimate")
    assert "prompt lengths are an estimate" in r.stdout
    assert "2 x HTTP 429: queue full" in r.stdout
    assert "their tokens are counted content chunks" in r.stdout
    assert png_size(tmp_path / "r.png") == (1100, 440)


def test_without_usage_a_stream_that_ended_on_length_made_max_tokens(tmp_path):
    with Misbehaving(behaviours=("good", "grouped")) as server:
        r = bench(server.url, "--concurrency", "1", *SMALL, "--out", tmp_path / "r.json")
    assert r.returncode == 0, r.stderr
    [lv] = json.loads((tmp_path / "r.json").read_text())["levels"]
    assert lv["tokens_from"] == {"chunks": 5, "length": 5}
    grouped = [x for x in lv["raw"] if x["counted"] == "length"]
    assert all(x["chunks"] == 2 and x["output_tokens"] == 4 for x in grouped)
    assert lv["output_tokens"] == 10 * 4
    assert "they ended with finish_reason length, so each made max_tokens tokens" in r.stdout


def test_a_server_that_fails_everything_exits_10_after_showing_why(tmp_path):
    with Misbehaving(behaviours=("500",)) as server:
        r = bench(server.url, "--concurrency", "2", *SMALL)
    assert r.returncode == 10, r.stderr
    assert "10 x HTTP 500: engine exploded" in r.stdout
    assert "every request failed" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_ctrl_c_prints_and_writes_what_was_measured(tmp_path):
    with Misbehaving(behaviours=("good",), chunks=4, delay=0.05) as server:
        p = subprocess.Popen([sys.executable, "-m", "deploykit.cli", "bench", server.url, "--concurrency", "1",
                              "--requests", "1000", "--max-tokens", "4", "--no-progress", "--warmup", "0",
                              "--out", tmp_path / "partial.json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=ROOT)
        wait_until(lambda: server.completions >= 4, timeout=60, what="bench to finish 4 requests")
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    doc = json.loads((tmp_path / "partial.json").read_text())
    assert doc["interrupted"] is True
    [lv] = doc["levels"]
    assert lv["interrupted"] and 3 <= lv["requests"] < 1000 and lv["errors"] == 0
    assert "(interrupted)" in out and "measured before Ctrl-C" in out and "Traceback" not in err


@pytest.mark.slow
def test_compare_shows_two_runs_side_by_side_with_ratios(tmp_path):
    with Misbehaving(behaviours=("good",)) as server:
        for name in ("a", "b"):
            r = bench(server.url, "--concurrency", "1,2", *SMALL, "--out", tmp_path / f"{name}.json")
            assert r.returncode == 0, r.stderr
    r = bench("--compare", tmp_path / "a.json", tmp_path / "b.json", "--plot", tmp_path / "c.png")
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if "a.json" in line or "b.json" in line]
    assert len(rows) == 1 + 4  # the title, then each run at each of the 2 levels
    b_rows = [line.split("│") for line in rows if "b.json" in line and "compared" not in line]
    assert all(float(cells[4]) > 0 for cells in b_rows)  # "× first" of throughput: a ratio, not blank
    png_size(tmp_path / "c.png")
    (tmp_path / "junk.json").write_text("{}")
    r = bench("--compare", tmp_path / "a.json", tmp_path / "junk.json")
    assert r.returncode == 10 and "not a deploykit bench result" in r.stderr


def test_an_unreachable_endpoint_exits_10_naming_it():
    r = bench("http://127.0.0.1:9/v1", *SMALL, env={**os.environ, "NO_PROXY": "*"})
    assert r.returncode == 10
    assert "no answer from http://127.0.0.1:9" in r.stderr and "Traceback" not in r.stderr


def test_usage_mistakes_are_refused_before_any_load():
    r = bench("http://127.0.0.1:9", "--requests", "4", "--duration", "5")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr
    r = bench("http://127.0.0.1:9", "--sweep")
    assert r.returncode == 10 and "--sweep brings deployments up from a spec" in r.stderr and "Traceback" not in r.stderr
