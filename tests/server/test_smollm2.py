"""The OpenAI server on a real trained model loaded straight from its .gguf, through the `openai` client: chat ends
cleanly at the template's end token, streaming is the same text, `n` and `max_tokens` behave; and `deploykit serve`
answers from a spec whose model.source is the .gguf.

Checks of content use distributions where bf16 could flip a greedy string (see tests/engine/fidelity.py).
"""
from __future__ import annotations

import json
import math
import sys

import jsonschema
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


# ---- what agent frameworks send, on the real model (its template takes no tools: ours describe them) ----

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                           "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30},
                                                       "maxItems": 4}},
          "required": ["name", "age", "hobbies"], "additionalProperties": False}


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_is_valid_for_the_schema(client, choice):
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice=choice,
                                       parallel_tool_calls=False, temperature=0.7, seed=1, max_tokens=128)
    (c,) = r.choices
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER)
    assert "paris" in args["city"].lower(), args  # the model read the question, not just the grammar


@pytest.mark.slow
def test_a_two_turn_tool_conversation_answers_from_the_result(client):
    first = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=128)
    msg = first.choices[0].message
    history = ASK + [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": msg.tool_calls[0].id,
                                                         "content": '{"temperature": 31, "sky": "sunny"}'}]
    second = client.chat.completions.create(model="smollm2", messages=history, tools=TOOLS, temperature=0,
                                            max_tokens=96)
    (c,) = second.choices
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20  # the call and its result were rendered


@pytest.mark.slow
def test_json_schema_output_validates_for_20_samples_at_temperature_1(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    msgs = [{"role": "user", "content": "Describe a fictional person as JSON with name, age and hobbies."}]
    r = client.chat.completions.create(model="smollm2", messages=msgs, response_format=fmt, n=20, temperature=1.0,
                                       seed=3, max_tokens=200)
    assert len(r.choices) == 20
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), PERSON)


@pytest.mark.slow
def test_responses_api_text_and_function_calls(client):
    r = client.responses.create(model="smollm2", input="What is 2 + 2?", instructions="Answer briefly.",
                                max_output_tokens=128, temperature=0)
    assert r.status == "completed" and "4" in r.output_text and r.usage.output_tokens < 128
    with client.responses.stream(model="smollm2", input="What is 2 + 2?", instructions="Answer briefly.",
                                 max_output_tokens=128, temperature=0) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "".join(deltas) == final.output_text == r.output_text
    tools = [{"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
              "parameters": WEATHER, "strict": True}]
    with client.responses.stream(model="smollm2", input="What is the weather like in Paris today?", tools=tools,
                                 tool_choice="required", parallel_tool_calls=False, max_output_tokens=128,
                                 temperature=0) as s:
        args = "".join(e.delta for e in s if e.type == "response.function_call_arguments.delta")
        final = s.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather" and call.arguments == args
    jsonschema.validate(json.loads(args), WEATHER)
    done = client.responses.create(model="smollm2", tools=tools, max_output_tokens=64, temperature=0, input=[
        {"role": "user", "content": "What is the weather like in Paris today?"}, call.model_dump(),
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 31, "sky": "sunny"}'}])
    assert done.status in ("completed", "incomplete") and done.output
