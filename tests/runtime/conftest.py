"""A tiny random-weight model for the `deploykit up/down/status/logs` tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from engine.tinymodel import make_tiny_model
    path = Path(make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny")))
    return path
