"""The OpenAI server on a real trained model loaded straight from its .gguf, through the `openai` client: chat ends
cleanly at the template's end token, streaming is the same text, `n` and `max_tokens` behave; and `deploykit serve`
answers from a spec whose model.source is the .gguf.

Checks of content use distributions where bf16 could flip a greedy string (see tests/engine/fidelity.py).
"""
from __future__ import annotations

import math
import sys

import openai
import pytest
import yaml

from tests.server.live import LiveServer, clean_env

QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def server(smollm2):
    s = LiveServer(smollm2, "--max-model-len", "2048", "--max-num-seqs", "8", "--served-model-name", "smollm2")
    try:
        yield s.wait_ready()
    finally:
        s.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_answers_and_ends_at_the_templates_end_token(client):
    r = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=128, temperature=0)
    (choice,) = r.choices
    text = choice.message.content
    assert choice.finish_reason == "stop" and r.usage.completion_tokens < 128  # <|im_end|> ended it, not the cap
    assert text.strip() and "<|im_end|>" not in text and "<|im_start|>" not in text
    assert "4" in text, text


def test_streaming_is_the_same_answer(client):
    whole = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=128, temperature=0)
    chunks = list(client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=128, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_choices_and_max_tokens_cut_offs(client):
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Tell me a story."}],
                                       n=3, max_tokens=24, temperature=1.0, seed=5)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1  # seeds seed, seed+1, seed+2: different samples
    assert all(c.finish_reason in ("stop", "length") for c in r.choices) and 3 <= r.usage.completion_tokens <= 72
    cut = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 5 and cut.choices[0].text


def test_the_model_knows_a_fact(client):
    """A distribution, not a greedy string: ' Paris' is the most likely next token by a wide margin."""
    r = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=1, temperature=0,
                                  logprobs=5)
    top = r.choices[0].logprobs.top_logprobs[0]
    best = max(top, key=top.get)
    assert best == " Paris" and math.exp(top[best]) > 0.5, top


def test_deploykit_serve_answers_from_a_gguf_spec(tmp_path, smollm2):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"apiVersion": "deploykit/v1", "kind": "Deployment", "name": "smol",
                                    "model": {"source": smollm2, "max_model_len": 1024},
                                    "placement": {"strategy": "single"},
                                    "serving": {"max_num_seqs": 4, "kv_cache": "64MiB"}}))
    s = LiveServer(smollm2, cmd=[sys.executable, "-m", "deploykit.cli", "serve", str(spec)], env=clean_env())
    try:
        s.wait_ready()
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in c.models.list()] == ["SmolLM2-135M-Instruct.Q4_1"]  # the file's name, less .gguf
        r = c.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=QUESTION, max_tokens=128,
                                      temperature=0)
        assert r.choices[0].finish_reason == "stop" and "4" in r.choices[0].message.content
        assert s.get("/debug/binding").json()["engine"]["source"] == "plan"
    finally:
        s.close()
