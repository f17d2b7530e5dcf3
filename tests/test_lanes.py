"""The fast lane (`scripts/test --fast`: -m "not slow and not docker") leaves out every test that needs Docker, a
live server or the real model, as tests/conftest.py marks them, and keeps the unit tests next to them."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAST = "not slow and not docker"


def collected(*args: str) -> set[str]:
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {line for line in r.stdout.splitlines() if "::" in line}


@pytest.mark.slow  # collects the whole suite in a subprocess (torch imports included): ~10 s
def test_the_fast_lane_has_no_docker_live_server_or_real_model_test():
    fast = collected("-m", FAST)  # the whole suite: tests/docker's conftest imports need the full collection
    assert not {t for t in fast if t.startswith("tests/docker/")}  # the docker fixture, direct or not
    # a LiveServer started in the test (robustness), in a module fixture (concurrency) or the shared `server`
    # fixture (openai_api); the real model (smollm2); `deploykit up` of live replicas (local_e2e, marked by hand)
    for module in ("test_concurrency", "test_openai_api", "test_smollm2", "test_local_e2e"):
        assert not {t for t in fast if f"/{module}.py::" in t}, module
    assert "tests/server/test_robustness.py::test_a_quiet_stream_sends_keep_alives_and_then_finishes" not in fast
    assert "tests/doctor/test_url.py::test_a_correctly_started_engine_gets_all_checks" not in fast
    # ...while the unit tests beside them stay in the lane
    kept = {t.split("::")[0] for t in fast}
    assert {"tests/server/test_chat_parsing.py", "tests/server/test_options.py", "tests/runtime/test_proxy.py",
            "tests/runtime/test_state.py", "tests/test_planner.py", "tests/render/test_golden.py"} <= kept
