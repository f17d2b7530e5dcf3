"""Shared fixtures: synthesized sysroots and spec builders."""

from __future__ import annotations

import copy
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
