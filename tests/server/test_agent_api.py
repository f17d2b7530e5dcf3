"""What agent frameworks send, through the official `openai` client against live servers on tiny random-weight
models whose chat templates take tools: a Qwen3-style one (<tool_call>, <think>) and a Llama-3-style one (JSON
calls). Random weights write gibberish, so every output whose shape is asserted is made well-formed by the
server's own constrained decoding (forced calls, response_format), never by a mock."""
from __future__ import annotations

import json
import threading

import jsonschema
import openai
import pytest

from tests.server.live import LiveServer

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
ANSWER = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}, "word": {"type": "string", "maxLength": 8}},
          "required": ["n", "ok", "word"], "additionalProperties": False}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def start(model: str) -> LiveServer:
    return LiveServer(model, "--max-model-len", "1024", "--max-num-seqs", "8", "--served-model-name", "m").wait_ready()


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory) -> str:
    from engine.tinymodel import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("agent") / "qwen3"), "qwen3", chat_template="qwen3")


@pytest.fixture(scope="module")
def qwen3(qwen3_model):
    s = start(qwen3_model)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def qc(qwen3) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{qwen3.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def qtok(qwen3_model):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(qwen3_model)


def check_call(call, name: str = "get_weather") -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER if name == "get_weather" else {"type": "object"})
    return args


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_has_arguments_valid_for_the_schema(qc, choice):
    r = qc.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                                   temperature=1.0, max_tokens=200, extra_body=NO_THINK)
    (c,) = r.choices
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    if choice != "required":
        check_call(call)
    else:
        check_call(call, call.function.name)


def test_streamed_tool_calls_use_openais_delta_shape(qc):
    chunks = list(qc.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False, temperature=1.0, seed=4, max_tokens=200, stream=True, extra_body=NO_THINK))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or ()]
    assert len(deltas) > 3 and {d.index for d in deltas} == {0}  # the arguments stream as they are written
    assert deltas[0].id.startswith("call_") and deltas[0].type == "function"
    assert deltas[0].function.name == "get_weather" and not any(d.id or d.function.name for d in deltas[1:])
    jsonschema.validate(json.loads("".join(d.function.arguments or "" for d in deltas)), WEATHER)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks)


def test_parallel_tool_calls_streamed_and_whole(qc):
    """parallel_tool_calls (the default) lets the forced grammar repeat the call; min_tokens keeps the random
    model from ending after the first (130: more than the longest call, twelve \\uXXXX escapes in `city`, takes).
    Every call validates; streamed, they arrive as indexes 0, 1, ... and the SDK's accumulated message equals the
    non-streamed one."""
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]  # the SDK parses them
    kw = {"model": "m", "messages": ASK, "tools": strict, "tool_choice": "required", "temperature": 1.0,
          "seed": 3, "max_tokens": 600, "extra_body": {**NO_THINK, "min_tokens": 130}}
    r = qc.chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls
    assert len(calls) >= 2 and len({c.id for c in calls}) == len(calls)
    for c in calls:
        check_call(c)
    with qc.chat.completions.stream(**kw) as s:
        for _ in s:
            pass
        final = s.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in calls]


def test_a_two_turn_tool_conversation_round_trips(qc, qtok):
    """The assistant message as the client got it (tool_calls, arguments as JSON text) and the tool's result go
    back through the model's template: the server renders exactly what the template renders for that history."""
    first = qc.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=200, extra_body=NO_THINK)
    msg = first.choices[0].message
    call = msg.tool_calls[0]
    history = ASK + [msg.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = qc.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=4, temperature=0,
                                        extra_body=NO_THINK)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    as_template = [ASK[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": json.loads(call.function.arguments)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    rendered = qtok.apply_chat_template(as_template, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                        enable_thinking=False)
    assert "sunny, 21 C" in rendered and call.function.arguments in rendered
    assert second.usage.prompt_tokens == len(qtok.encode(rendered, add_special_tokens=False))


def test_json_schema_output_is_valid_for_20_samples_at_temperature_1(qc):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    r = qc.chat.completions.create(model="m", messages=ASK, response_format=fmt, n=20, temperature=1.0, seed=1,
                                   max_tokens=200, extra_body=NO_THINK)
    assert len(r.choices) == 20
    for c in r.choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), ANSWER)
    assert len({c.message.content for c in r.choices}) > 1  # sampled, not one forced string
    streamed = qc.chat.completions.create(model="m", messages=ASK, response_format=fmt, temperature=1.0,
                                          max_tokens=200, stream=True, extra_body=NO_THINK)
    jsonschema.validate(json.loads("".join(ch.choices[0].delta.content or "" for ch in streamed)), ANSWER)


def test_constrained_and_free_requests_share_batches(qc):
    """A greedy unconstrained request gives the same text alone and batched with constrained ones."""
    kw = {"model": "m", "messages": ASK, "max_tokens": 24, "temperature": 0, "extra_body": {"ignore_eos": True}}
    alone = qc.chat.completions.create(**kw).choices[0].message.content
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
    threads = [threading.Thread(target=qc.chat.completions.create,
                                kwargs={"model": "m", "messages": ASK, "response_format": fmt, "max_tokens": 100,
                                        "temperature": 1.0, "n": 2, "extra_body": NO_THINK}) for _ in range(3)]
    for t in threads:
        t.start()
    together = qc.chat.completions.create(**kw).choices[0].message.content
    for t in threads:
        t.join()
    assert together == alone


def test_reasoning_lands_in_reasoning_content(qc, qtok):
    """Thinking on: logit_bias makes the random model open <think> and close it soon; the grammar then forces the
    JSON answer. The thinking is reasoning_content, the answer content, streamed or not; with thinking off there
    is none."""
    think, end = qtok.convert_tokens_to_ids(["<think>", "</think>"])
    kw = {"model": "m", "messages": ASK, "temperature": 1.0, "seed": 7, "max_tokens": 400,
          "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}},
          "logit_bias": {str(think): 100, str(end): 4}}
    r = qc.chat.completions.create(**kw)
    m = r.choices[0].message
    assert m.reasoning_content and "<think>" not in m.reasoning_content and "</think>" not in m.reasoning_content
    jsonschema.validate(json.loads(m.content), ANSWER)
    chunks = list(qc.chat.completions.create(**kw, stream=True))
    assert "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in chunks) == \
        m.reasoning_content
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == m.content
    off = qc.chat.completions.create(**{**kw, "extra_body": NO_THINK}).choices[0].message
    assert getattr(off, "reasoning_content", None) is None
    jsonschema.validate(json.loads(off.content), ANSWER)


def test_responses_create_and_stream_text_and_function_calls(qc):
    kw = {"model": "m", "extra_body": NO_THINK}
    r = qc.responses.create(input="Say hello", instructions="Be brief.", max_output_tokens=8, **kw)
    assert r.object == "response" and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and r.usage.output_tokens == 8 and r.output[0].type == "message"
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}
    with qc.responses.stream(input="Answer in JSON", text=fmt, max_output_tokens=200, **kw) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    jsonschema.validate(json.loads(final.output_text), ANSWER)
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.output_text.done" in kinds
    tools = [{"type": "function", "name": "get_weather", "description": "Current weather", "parameters": WEATHER,
              "strict": True}]
    r = qc.responses.create(input="Weather in Paris?", tools=tools, tool_choice="required", parallel_tool_calls=False,
                            max_output_tokens=200, **kw)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with qc.responses.stream(input="Weather in Paris?", tools=tools, parallel_tool_calls=False, max_output_tokens=200,
                             tool_choice={"type": "function", "name": "get_weather"}, **kw) as s:
        events = list(s)
        final = s.get_final_response()
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert deltas and final.output[0].type == "function_call"
    assert "".join(d.delta for d in deltas) == final.output[0].arguments
    jsonschema.validate(json.loads(final.output[0].arguments), WEATHER)
    # the call and its output go back as input items (stateless: the client sends the whole conversation)
    again = qc.responses.create(input=[{"role": "user", "content": "Weather in Paris?"}, call.model_dump(),
                                       {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
                                tools=tools, max_output_tokens=4, **kw)
    assert again.status in ("completed", "incomplete") and again.usage.input_tokens > r.usage.input_tokens


def test_responses_are_stateless(qwen3, qc):
    with pytest.raises(openai.BadRequestError) as e:
        qc.responses.create(model="m", input="and then?", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id" and "stateless" in e.value.body["message"]
    assert qwen3.get("/v1/responses/resp_123").status_code == 404
    with pytest.raises(openai.BadRequestError) as e:
        qc.responses.create(model="m", input="hi", tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools"


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    from engine.tinymodel import make_tiny_model
    model = make_tiny_model(str(tmp_path_factory.mktemp("agent") / "llama3"), "llama", chat_template="llama3")
    s = start(model)
    try:
        yield s, model
    finally:
        s.close()


def test_llama3_json_tool_calls(llama3):
    """Llama 3's format: a bare {"name", "parameters"} object, forced and parsed, streamed and not; the history
    goes back through its template (the result in an ipython turn)."""
    s, model = llama3
    c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
    r = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False, temperature=1.0, max_tokens=200)
    (call,) = r.choices[0].message.tool_calls
    check_call(call, call.function.name)
    chunks = list(c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=200, stream=True,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            parallel_tool_calls=False))
    (delta,) = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or ()]
    assert delta.function.name == "get_weather" and delta.index == 0
    jsonschema.validate(json.loads(delta.function.arguments), WEATHER)
    history = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    again = c.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=2)
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast.from_pretrained(model)
    rendered = tok.apply_chat_template(
        [ASK[0], {"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
         {"role": "tool", "content": "sunny"}], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<|start_header_id|>ipython<|end_header_id|>\n\nsunny" in rendered
    assert again.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))


# ---- a template without tools (tiny ChatML models): our instructions, the same parsing and forcing ----

def test_a_template_without_tools_still_gets_forced_calls(tiny_model):
    s = start(tiny_model)  # the shared server's 128-token context cannot hold the tools' description
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
        r = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, parallel_tool_calls=False,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                      temperature=1.0, max_tokens=200)
        (call,) = r.choices[0].message.tool_calls
        check_call(call)
        history = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        again = c.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=2)
        assert again.usage.prompt_tokens > r.usage.prompt_tokens
    finally:
        s.close()


def test_content_parts_are_joined_for_a_string_template(client, tokenizer):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=1)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hello\nworld"}], tokenize=False,
                                             add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


def test_logit_bias_steers_and_bans(client, tokenizer):
    fox, dog = tokenizer.encode(" fox")[-1], tokenizer.encode(" dog")[-1]

    def greedy(bias: dict) -> str:
        return client.completions.create(model="tiny", prompt="The quick brown", max_tokens=3, temperature=0,
                                         logit_bias={str(k): v for k, v in bias.items()}).choices[0].text
    assert greedy({fox: 100, dog: 90}) == tokenizer.decode([fox] * 3)
    assert greedy({fox: -100, dog: 90}) == tokenizer.decode([dog] * 3)  # -100 bans the favourite


def test_completions_take_a_json_schema(client):
    r = client.completions.create(model="tiny", prompt="JSON:", max_tokens=100, temperature=1.0,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "a", "schema": ANSWER}}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), ANSWER)


def test_unknown_fields_are_logged_once_per_name_and_legacy_functions_rejected(server, client):
    name = "x_field_nobody_knows"
    before = server.log()
    for _ in range(3):
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1, extra_body={name: 1, "store": True})
    logged = server.log()[len(before):]
    assert logged.count(f"ignoring unknown request field '{name}'") == 1, logged
    assert server.log().count("ignoring request field 'store'") == 1
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1,
                                       functions=[{"name": "f", "parameters": {}}])
    assert e.value.body["param"] == "functions" and "tools" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1, function_call="auto")
    assert e.value.body["param"] == "function_call" and "tool_choice" in e.value.body["message"]
