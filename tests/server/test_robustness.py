"""The server stays up and answers correctly under bad input and a stuck engine: lone surrogates and oversized lists
are 400s, a fuzzer over the request models finds no 5xx, a hung engine turns /health to 503 and fails its requests
instead of hanging them, quiet streams send keep-alives, browsers get CORS, and the default bind is loopback."""
from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import API_KEY, MAX_MODEL_LEN
from tests.server.live import LiveServer


def post(server, path: str, body: bytes, **headers) -> httpx.Response:
    return httpx.post(server.url + path, content=body, timeout=60,
                      headers={"Content-Type": "application/json", **server.headers, **headers})


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udc00"], "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\udfff"], "max_tokens": 2}', "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
     "messages"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
])
def test_lone_surrogates_are_400_naming_the_field(server, path, body, param):
    r = post(server, path, body.encode())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "lone surrogate" in err["message"] and "function-after" not in err["message"]


@pytest.mark.parametrize("field, value, param", [
    ("stop_token_ids", list(range(4097)), "stop_token_ids"),
    ("logit_bias", {str(i): 1.0 for i in range(1025)}, "logit_bias"),
    ("prompt", ["x"] * 1025, "prompt"),
])
def test_lists_are_capped(server, field, value, param):
    r = post(server, "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 1, field: value}).encode())
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_messages_and_tools_are_capped(server):
    base = {"messages": [{"role": "user", "content": "hi"}] * 4097, "max_tokens": 1}
    r = post(server, "/v1/chat/completions", json.dumps(base).encode())
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    r = post(server, "/v1/chat/completions", json.dumps({"messages": base["messages"][:1], "tools": tools}).encode())
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


# ---- fuzzing the request models ----

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats(allow_nan=False)
    | st.text(st.characters(codec=None, exclude_categories=()), max_size=40),  # lone surrogates included
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=12)
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop",
          "stream", "stream_options", "logprobs", "top_logprobs", "seed", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "stop_token_ids", "min_tokens", "ignore_eos", "echo", "logit_bias", "tools",
          "response_format", "max_completion_tokens", "add_generation_prompt", "best_of", "suffix", "user",
          "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "continue_final_message", "reasoning_effort",
          "functions", "function_call", "input", "instructions", "text", "max_output_tokens", "reasoning",
          "previous_response_id", "store"]
VALID = {"/v1/completions": {"prompt": "Hello", "max_tokens": 3},
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3},
         "/v1/responses": {"input": "Hello", "max_output_tokens": 3},
         "/tokenize": {"prompt": "Hello"}, "/detokenize": {"tokens": [5, 6]}}


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(path=st.sampled_from(sorted(VALID)), changes=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=4),
       raw=st.none() | JSON)
def test_fuzzed_requests_never_get_a_5xx(server, path, changes, raw):
    """A valid body with random fields replaced by random JSON (any type, nesting, huge numbers, lone surrogates),
    or random JSON instead of a body."""
    body = raw if raw is not None else {**VALID[path], **changes}
    if isinstance(body, dict) and body.get("stream") is True:
        with httpx.stream("POST", server.url + path, json=body, headers=server.headers, timeout=60) as r:
            text = "".join(r.iter_text())
        assert r.status_code < 500, text
        last = text.rstrip().rsplit("\n\n", 1)[-1]  # the Responses API ends with its final typed event
        ends = ("data: [DONE]",) if path != "/v1/responses" else ("event: response.completed",
                                                                 "event: response.incomplete", "event: error")
        assert r.status_code != 200 or last.startswith(ends), text[-300:]
        return
    r = post(server, path, json.dumps(body).encode())  # ensure_ascii: surrogates travel as \\udxxx escapes
    assert r.status_code < 500, (body, r.text)
    r.json()


# ---- a stuck engine, quiet streams ----

def _engine_pid(s: LiveServer) -> int:
    return s.get("/debug/binding").json()["engine"]["pid"]


def test_a_hung_engine_fails_its_requests_turns_health_503_and_exits(tiny_model):
    """SIGSTOP freezes the engine process mid-stream: a real hang. After --stall-timeout without a step the front end
    fails the in-flight request (an in-band error on its stream), /health says 503, and the server exits 1 so
    Docker's restart policy or Kubernetes' liveness probe replaces it."""
    s = LiveServer(tiny_model, "--max-model-len", str(MAX_MODEL_LEN), "--stall-timeout", "2",
                   "--sse-keepalive", "0.5").wait_ready()
    try:
        pid = _engine_pid(s)
        body = {"prompt": "Hello", "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            rest = [line for line in lines if line]
        waited = time.monotonic() - stopped
        assert 2 <= waited < 8, waited
        assert rest[-1] == "data: [DONE]"
        err = json.loads(rest[-2][6:])["error"]
        assert "stopped making progress" in err["message"] and err["type"] == "service_unavailable"
        status = httpx.get(f"{s.url}/health", timeout=2).status_code
        assert status == 503
        assert s.proc.wait(timeout=30) == 1
        assert "made no progress for" in s.log()
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except (OSError, UnboundLocalError):
            pass
        s.close()


def test_a_frozen_engine_never_blocks_the_front_end_even_mid_message(tiny_model):
    """A request far bigger than the socket buffer (64 choices of a 2000-token prompt, ~0.5 MB pickled) sent to a
    frozen engine: the front end keeps answering /health while the bytes wait, and the watchdog still fires."""
    s = LiveServer(tiny_model, "--max-model-len", "2048", "--stall-timeout", "3").wait_ready()
    try:
        pid = _engine_pid(s)
        os.kill(pid, signal.SIGSTOP)
        big = {"prompt": [10 + i % 1000 for i in range(2000)], "max_tokens": 8, "n": 64}  # tiny vocab: 1024
        with httpx.Client(timeout=60) as c:
            import threading
            result = {}
            t = threading.Thread(target=lambda: result.update(r=c.post(f"{s.url}/v1/completions", json=big)))
            t.start()
            # Time for the request to reach the front end and fill the socket: nothing outside shows a send half
            # done. A slower arrival makes the check below prove less; it cannot make it fail.
            time.sleep(1.0)
            started = time.monotonic()
            assert httpx.get(f"{s.url}/health", timeout=5).status_code == 200  # the loop is free
            assert time.monotonic() - started < 2
            t.join(timeout=30)
        assert result["r"].status_code == 503 and "stopped making progress" in result["r"].text
        assert s.proc.wait(timeout=30) == 1
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except (OSError, UnboundLocalError):
            pass
        s.close()


def test_a_quiet_stream_sends_keep_alives_and_then_finishes(tiny_model):
    """A request that waits (a queue, a long prefill) shorter than the stall timeout: its stream sends a keep-alive
    comment every --sse-keepalive seconds of silence, then the tokens once the engine moves again. The engine is
    frozen before the request is sent, so the silence is certain: freezing it after the first token raced the
    engine, which can finish all 20 tokens of the tiny model before the signal lands on a loaded 2-CPU machine."""
    s = LiveServer(tiny_model, "--max-model-len", str(MAX_MODEL_LEN), "--sse-keepalive", "0.3").wait_ready()
    pid = _engine_pid(s)
    try:
        body = {"prompt": "Hello", "max_tokens": 20, "ignore_eos": True, "stream": True}
        os.kill(pid, signal.SIGSTOP)  # the pause under test: lifted below once two keep-alives came through
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as r:
            lines = (line for line in r.iter_lines() if line)
            quiet = [next(lines), next(lines)]
            os.kill(pid, signal.SIGCONT)
            rest = list(lines)
        assert r.status_code == 200 and quiet == [": keep-alive", ": keep-alive"], quiet
        data = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        assert data[-1]["choices"][0]["finish_reason"] == "length" and rest[-1] == "data: [DONE]"
    finally:
        os.kill(pid, signal.SIGCONT)
        s.close()


# ---- browsers, and where the server listens ----

def test_cors_preflight_is_answered_without_a_key_and_errors_carry_cors_headers(tiny_model):
    origin = "https://app.example.com"
    s = LiveServer(tiny_model, "--max-model-len", str(MAX_MODEL_LEN), "--allowed-origins", f"{origin},http://a:3000",
                   api_key=API_KEY).wait_ready()
    try:
        pre = httpx.options(f"{s.url}/v1/chat/completions", headers={  # what the OpenAI JS SDK sends
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os,x-stainless-lang"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == origin
        assert "x-stainless-os" in pre.headers["access-control-allow-headers"].lower()
        denied = httpx.get(f"{s.url}/v1/models", headers={"Origin": origin})  # no key: 401 the browser can read
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == origin
        ok = httpx.get(f"{s.url}/v1/models", headers={"Origin": origin, "Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == origin
        other = httpx.options(f"{s.url}/v1/models", headers={"Origin": "https://evil.example",
                                                              "Access-Control-Request-Method": "GET"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    finally:
        s.close()
    without = LiveServer(tiny_model, "--max-model-len", str(MAX_MODEL_LEN)).wait_ready()
    try:  # CORS is off unless asked for
        r = httpx.get(f"{without.url}/v1/models", headers={"Origin": origin})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    finally:
        without.close()


def test_bad_origins_are_a_usage_error(tiny_model):
    s = LiveServer(tiny_model, "--allowed-origins", "app.example.com")
    assert s.proc.wait(timeout=60) == 2 and "is not an origin" in s.log()
    s.close()


def test_serving_beyond_loopback_without_a_key_warns(tiny_model):
    s = LiveServer(tiny_model, "--max-model-len", str(MAX_MODEL_LEN), host="0.0.0.0").wait_ready()
    try:
        assert "with no API key" in s.log()
    finally:
        s.close()
    s = LiveServer(tiny_model, "--max-model-len", str(MAX_MODEL_LEN)).wait_ready()
    try:
        assert "with no API key" not in s.log()
    finally:
        s.close()


def test_a_batch_of_short_prompts_is_tokenized_off_the_event_loop(tiny_model):
    """The decision is per request, not per string: 64 prompts of 400 characters (25,600 in all, none long alone)
    are tokenized in one worker thread, so streams on the loop keep flowing; a short batch stays on the loop."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from engine import tokenizer as tokenizers
    from engine.server.frontend import LONG_TEXT, Frontend
    real = tokenizers.load(tiny_model)
    threads = []

    def encode(text, add_special_tokens=True):
        threads.append(threading.get_ident())
        return real.encode(text, add_special_tokens=add_special_tokens)

    fe = SimpleNamespace(tokenizer=SimpleNamespace(encode=encode), off_loop=Frontend.off_loop)

    async def run(texts):
        threads.clear()
        ids = await Frontend.encode_many(fe, texts)
        return ids, set(threads), threading.get_ident()

    batch = ["the cache keeps data close " * 15] * 64
    assert len(batch[0]) < LONG_TEXT < sum(map(len, batch))
    ids, used, loop_thread = asyncio.run(run(batch))
    assert ids == [real.encode(t) for t in batch] and loop_thread not in used and len(used) == 1
    ids, used, loop_thread = asyncio.run(run(batch[:4]))
    assert ids == [real.encode(t) for t in batch[:4]] and used == {loop_thread}
