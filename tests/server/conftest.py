"""One tiny random-weight model and one shared live server (with an API key) for the server tests."""
from __future__ import annotations

import openai
import pytest

from tests.server.live import LiveServer, free_port

API_KEY = "test-key-123"
MAX_MODEL_LEN = 128


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from engine.tinymodel import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="session")
def server(tiny_model):
    metrics_port = free_port()
    s = LiveServer(tiny_model, "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16",
                   "--served-model-name", "tiny", "--metrics-port", str(metrics_port), api_key=API_KEY)
    s.metrics_port = metrics_port  # a listener serving /metrics alone (a pod's Prometheus-only port)
    try:
        yield s.wait_ready()
    finally:
        s.close()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(tiny_model)
