"""Bad input gets the right 4xx in OpenAI's error shape, never a 5xx; the API key guards everything but probes."""
from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, MAX_MODEL_LEN
from tests.server.live import ROOT, LiveServer


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def complete(server, **body) -> httpx.Response:
    return server.post("/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 4, **body})


def test_prompt_plus_max_tokens_over_the_context_names_both_numbers(server):
    err = error(complete(server, max_tokens=MAX_MODEL_LEN), 400)
    assert str(MAX_MODEL_LEN) in err["message"] and str(MAX_MODEL_LEN + 1) in err["message"]
    assert err["code"] == "context_length_exceeded"
    long_prompt = list(range(10, 10 + MAX_MODEL_LEN))
    err = error(complete(server, prompt=long_prompt, max_tokens=None), 400)
    assert f"{MAX_MODEL_LEN} tokens" in err["message"]


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [5, 100000]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),  # outside the vocabulary
    ({"suffix": "and then"}, "suffix"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format"),
    ({"prompt": [True, False]}, "prompt"),
    ({"n": 10_000}, "n"),  # more sequences than the server can ever hold: not a "retry later" 429
    ({"stop_token_ids": [100_000]}, "stop_token_ids"),
    ({"stop_token_ids": [100_000], "stream": True}, "stop_token_ids"),  # checked before the 200 is sent
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_invalid_parameters_are_400_naming_the_parameter(server, body, param):
    assert error(complete(server, **body), 400)["param"] == param


def test_nan_is_rejected_not_sampled(server):
    r = server.post("/v1/completions", content=b'{"prompt": "x", "temperature": NaN}',
                    headers={"Content-Type": "application/json"})
    error(r, 400)


def test_chat_parameter_checks(server):
    def chat(**body):
        return server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **body})
    assert error(chat(top_logprobs=2), 400)["param"] == "top_logprobs"
    assert error(chat(messages=[]), 400)["param"] == "messages"
    assert error(chat(messages=[{"role": "wizard", "content": "x"}]), 400)["param"] == "messages"
    assert error(chat(tools=[{"type": "function", "function": {"name": "no spaces"}}]), 400)["param"] == "tools"
    assert error(chat(tools=[{"type": "retrieval"}]), 400)["param"] == "tools"
    assert chat(max_tokens=2, unknown_field={"sdk": "extra"}).status_code == 200  # unknown fields are ignored


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_api_key_required_except_for_probes(server):
    url = server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert error(r, 401)["code"] == "invalid_api_key"
    assert error(httpx.get(f"{url}/v1/models"), 401)
    assert error(httpx.get(f"{url}/debug/binding"), 401)
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(url + path).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()


def test_invalid_json_and_non_json_bodies_are_400(server):
    for content in (b'{"prompt": "hi",', b"not json", b"[1, 2]"):
        r = server.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
        error(r, 400)


def test_bodies_over_the_limit_are_413(server):
    big = b'{"prompt": "' + b"a" * (10 << 20) + b'"}'
    r = server.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert error(r, 413)["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit applies while streaming the body in
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"a" * (1 << 20)
        yield b'"}'
    r = server.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
    error(r, 413)
    assert server.get("/health").status_code == 200


def test_unknown_route_and_method_keep_the_error_shape(server):
    error(server.get("/v1/nothing"), 404)
    error(server.get("/v1/completions"), 405)


def test_schemathesis_finds_no_server_errors(tiny_model):
    """Generated valid and invalid requests for every operation in /openapi.json: none may get a 5xx. Own server:
    a crash found here must not take the shared one down."""
    s = LiveServer(tiny_model, "--max-model-len", "64", "--no-access-log", api_key=API_KEY)
    try:
        s.wait_ready()
        cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{s.url}/openapi.json",
               "--checks", "not_a_server_error", "-H", f"Authorization: Bearer {API_KEY}",
               "--max-examples", "40", "--seed", "1", "--request-timeout", "60", "--no-color"]
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + s.log()[-3000:]
        assert "Traceback" not in s.log() and "ERROR" not in s.log()
    finally:
        s.close()
