"""`deploykit doctor --url`: a correctly started engine server (tests/server/live.py, tcmalloc preloaded as the
image does) gets all ✔ while doctor drives a generation through it; a broken one is named. Heavy: run under the
heavy-job lock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploykit import errors
from tests.server.live import LiveServer, clean_env

ROOT = Path(__file__).resolve().parents[2]
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
API_KEY = "doctor-key"
pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from engine.tinymodel import make_tiny_model
    # ~30 MB of weights: each decode step has enough work for both OpenMP workers.
    return make_tiny_model(str(tmp_path_factory.mktemp("doctor-model")), "qwen2", hidden=512, layers=4, heads=8,
                           kv_heads=2, intermediate=2048)


def doctor(*args: str) -> tuple[int, dict, str]:
    r = subprocess.run([sys.executable, "-m", "deploykit.cli", "doctor", *args, "--format", "json"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, (json.loads(r.stdout) if r.stdout else {}), r.stderr


def test_a_correctly_started_engine_gets_all_checks(model):
    if not TCMALLOC.exists():
        pytest.skip(f"{TCMALLOC} missing (scripts/test installs libtcmalloc-minimal4)")
    s = LiveServer(model, "--max-model-len", "256", "--max-num-seqs", "4", "--dtype", "bfloat16", api_key=API_KEY,
                   env=clean_env(LD_PRELOAD=str(TCMALLOC)))
    try:
        s.wait_ready()
        code, rep, err = doctor("--url", s.url, "--api-key", API_KEY, "--seconds", "3")
    finally:
        s.close()
    levels = {f["id"]: (f["level"], f["title"]) for sec in rep["sections"] for f in sec["findings"]}
    assert code == 0, err
    assert not {k: v for k, v in levels.items() if v[0] != "ok"}
    busy = levels["threads.busy"][1]
    assert busy.startswith("2 of 2 OpenMP threads busy") and "on 2 CPU(s) 0-1" in busy, busy
    assert "memory bind on node(s) 0" in levels["binding.memory"][1]
    assert levels["malloc.tcmalloc"][0] == "ok"
    assert rep["data"]["binding_after"]["engine"]["environment"]["LD_PRELOAD"] == str(TCMALLOC)


def test_an_engine_started_without_binding_is_named(model):
    """--binding none: threads unpinned and memory left to the default policy; doctor says so."""
    s = LiveServer(model, "--max-model-len", "256", "--max-num-seqs", "4", "--binding", "none", env=clean_env())
    try:
        s.wait_ready()
        code, rep, _ = doctor("--url", s.url, "--seconds", "2")
    finally:
        s.close()
    levels = {f["id"]: f["level"] for sec in rep["sections"] for f in sec["findings"]}
    assert levels["binding.cpus"] == "warn" and levels["malloc.tcmalloc"] == "warn"
    assert code == 0  # nothing critical on one node: unpinned threads are slower, not broken


def test_errors_are_messages():
    code, _, err = doctor("--url", "http://127.0.0.1:9")
    assert code == errors.EXIT_CODES[errors.TargetError] and "cannot reach the server" in err
