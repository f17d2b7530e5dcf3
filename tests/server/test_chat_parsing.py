"""The chat pipeline without a server: tool-call parsers and the think splitter on strings (streamed in any split
they add up to the whole-text answer), chat template capabilities found by probing, the fallback rendering for a
template without tools, and the grammars that force tool calls or JSON after a model's thinking."""
from __future__ import annotations

import json
import random

import pytest

from engine import grammar
from engine.server.chat import ChatOutput, ChatTurn, OutputFormat, build_grammar, call_deltas
from engine.server.errors import APIError
from engine.server.reasoning import ThinkSplitter, prompt_opens_thinking
from engine.server.templates import ChatTemplate, Message
from engine.server.tools import FORMATS, Function
from engine.tinymodel import train_tokenizer

WEATHER = Function("get_weather", "Current weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                                      "required": ["city"]})
ADD = Function("add", None, {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}})


def splits(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def streamed(fmt, text: str, seed: int):
    """(content, calls) of `text` fed in pieces; each call's streamed arguments add up to its arguments, in the
    order OpenAI's deltas need (the announcing piece first, with id and name)."""
    s = fmt.stream()
    content, calls, pieces = "", [], []
    for piece in [*splits(text, seed), None]:
        out = s.feed(piece) if piece is not None else s.finish()
        content, calls, pieces = content + out.content, calls + out.calls, pieces + out.pieces
    for i, c in enumerate(calls):
        mine = [p for p in pieces if p.id == c.id]
        assert [p.first for p in mine] == [True] + [False] * (len(mine) - 1) and mine[0].name == c.name
        assert "".join(p.text for p in mine) == c.arguments and {p.index for p in mine} == {i}
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


HERMES = [
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.\n", [("get_weather", {"city": "Paris"})]),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>\n',
     "", [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]),  # arguments as a JSON string too
    ("No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.", []),
    ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),  # kept as content
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}', "", [("add", {"a": 1})]),  # cut off before the close
    ("<tool_call>\n{\"name\": \"add\", \"argu", "<tool_call>\n{\"name\": \"add\", \"argu", []),
]


LLAMA = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"b": 2}}', "",
     [("add", {"a": 1}), ("add", {"b": 2})]),
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON that is not a call is content
    ("The weather is fine.", "The weather is fine.", []),
    ('{"name": "add", "parameters": {"a": 1}} and then text', '{"name": "add", "parameters": {"a": 1}} and then text',
     []),
]


@pytest.mark.parametrize("fmt, text, content, calls", [("hermes", *c) for c in HERMES] +
                         [("llama3_json", *c) for c in LLAMA])
def test_tool_calls_whole_and_streamed(fmt, text, content, calls):
    fmt = FORMATS[fmt]
    whole = fmt.parse(text)
    assert (whole.content, [(c.name, json.loads(c.arguments)) for c in whole.calls]) == (content, calls)
    for seed in range(20):
        assert streamed(fmt, text, seed) == (content, calls)
    assert all(c.id.startswith("call_") for c in whole.calls) and len({c.id for c in whole.calls}) == len(calls)


def test_hermes_arguments_stream_before_the_call_closes():
    """A call opened as {"name": ..., "arguments": { streams its arguments as they come (braces and quotes inside
    strings do not end them); what follows the arguments object inside the tag is dropped."""
    text = '<tool_call>\n{"name": "add", "arguments": {"a": "}\\"{", "b": {"c": 2}}, "x": 1}\n</tool_call>'
    s, seen = FORMATS["hermes"].stream(), []
    for ch in text[:-len("</tool_call>")]:
        seen += s.feed(ch).pieces
    assert not seen[0].text and seen[0].first and seen[0].name == "add"
    assert "".join(p.text for p in seen) == '{"a": "}\\"{", "b": {"c": 2}}'
    end = s.feed("</tool_call>")
    (call,) = end.calls
    assert json.loads(call.arguments) == {"a": '}"{', "b": {"c": 2}} and not end.content


def test_parallel_tool_calls_false_keeps_the_first_call():
    two = "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {{}}}}\n</tool_call>' for n in "ab")
    for max_calls, names in ((None, ["a", "b"]), (1, ["a"])):
        out = ChatOutput(None, FORMATS["hermes"].stream(), max_calls)
        pieces = out.feed(two[:70]).pieces + out.feed(two[70:]).pieces + out.finish().pieces
        assert [c["function"]["name"] for c in out.message()["tool_calls"]] == names
        assert [d.get("function", {}).get("name") for d in call_deltas(pieces) if "id" in d] == names


THINK = [
    ("<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", False, "The user wants 2+2.", "It is 4."),
    ("It is 4.", False, "", "It is 4."),  # thinking disabled: the answer starts at once
    ("The user wants 2+2.\n</think>\n\nIt is 4.", True, "The user wants 2+2.", "It is 4."),  # R1: opened in prompt
    ("<think>\nstill thinking when max_tokens hit", False, "still thinking when max_tokens hit", ""),
    ("<thinking is a word>", False, "", "<thinking is a word>"),
]


@pytest.mark.parametrize("text, opened, reasoning, content", THINK)
def test_think_blocks_split_whole_and_streamed(text, opened, reasoning, content):
    for seed in range(20):
        s, r, c = ThinkSplitter(opened), "", ""
        for piece in splits(text, seed):
            a, b = s.feed(piece)
            r, c = r + a, c + b
        a, b = s.finish()
        assert (r + a, c + b) == (reasoning, content)


def test_prompt_opens_thinking():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def qwen3():
    return ChatTemplate(train_tokenizer(chat_template="qwen3"))


@pytest.fixture(scope="module")
def chatml():
    return ChatTemplate(train_tokenizer())


def test_template_capabilities_and_formats(qwen3, chatml):
    assert qwen3.caps.tools and qwen3.thinks and qwen3.format.name == "hermes"
    assert not chatml.caps.tools and not chatml.thinks and not chatml.caps.content_parts
    llama = ChatTemplate(train_tokenizer(chat_template="llama3"))
    assert llama.caps.tools and llama.format.name == "llama3_json" and not llama.thinks
    assert ChatTemplate(train_tokenizer(), reasoning_parser="qwen3").thinks
    assert qwen3.tag("<tool_call>") == "<tool_call>" and chatml.tag("<tool_call>") == '"<tool_call>"'


HISTORY = [Message("system", ("Be brief.",)), Message("user", ("Weather in ", "Paris?"), listed=True),
           Message("assistant", None, tool_calls=(("c1", "get_weather", {"city": "Paris"}),)),
           Message("tool", ("sunny",), tool_call_id="c1"), Message("tool", ("22 C",), tool_call_id="c1")]


def test_a_template_with_tools_renders_them_itself(qwen3):
    out = qwen3.render(HISTORY, [WEATHER], add_generation_prompt=True, continue_final_message=False, kwargs={})
    assert '"name": "get_weather"' in out and "Current weather" in out  # listed by the template
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in out
    assert "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n22 C\n</tool_response>" in out
    assert "Weather in \nParis?" in out  # parts joined by newlines for a string-only template
    assert out.endswith("<|im_start|>assistant\n")


def test_a_template_without_tools_gets_the_formats_instructions_and_text(chatml):
    out = chatml.render(HISTORY, [WEATHER], add_generation_prompt=True, continue_final_message=False, kwargs={})
    system = out.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n") and "<tool_call>" in system
    assert '"name": "get_weather"' in system
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>") in out
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n22 C\n</tool_response>"
            "<|im_end|>") in out


def test_template_kwargs_and_continue_final_message(qwen3):
    user = [Message("user", ("hi",))]
    off = qwen3.render(user, [], add_generation_prompt=True, continue_final_message=False,
                       kwargs={"enable_thinking": False})
    assert off.endswith("<think>\n\n</think>\n\n")
    go_on = qwen3.render(user + [Message("assistant", ("The answer is",))], [], add_generation_prompt=False,
                         continue_final_message=True, kwargs={})
    assert go_on.endswith("The answer is")
    for bad in ({"tokenize": True}, {"tools": []}):
        with pytest.raises(APIError) as e:
            qwen3.render(user, [], add_generation_prompt=True, continue_final_message=False, kwargs=bad)
        assert e.value.param == "chat_template_kwargs"
    with pytest.raises(APIError) as e:
        qwen3.render(user, [], add_generation_prompt=False, continue_final_message=True, kwargs={})
    assert e.value.param == "continue_final_message"


def walk(tok, g: str, text: str) -> bool:
    """Whether the grammar accepts `text` (tokenized as the model would write it) and is complete after it."""
    import llguidance.hf
    m = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=len(tok)), g, log_level=0)
    return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()


OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


def test_forced_json_may_follow_thinking(qwen3):
    tok = qwen3.tokenizer
    turn = ChatTurn([Message("user", ("hi",))], output=OutputFormat("json_schema", OBJ))
    thinking = build_grammar(qwen3, turn, [], "<|im_start|>assistant\n")
    assert walk(tok, thinking, '<think>\nit is a number\n</think>\n\n{"a": 1}')
    assert walk(tok, thinking, '{"a": 1}')
    assert not walk(tok, thinking, 'plain text {"a": 1}')
    closed = build_grammar(qwen3, turn, [], "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert walk(tok, closed, '{"a": 1}') and not walk(tok, closed, '<think>\nx\n</think>\n\n{"a": 1}')
    opened = build_grammar(qwen3, turn, [], "<|im_start|>assistant\n<think>\n")
    assert walk(tok, opened, 'so, one\n</think>\n\n{"a": 1}')
    spelled = ChatTemplate(train_tokenizer(), reasoning_parser="qwen3")  # <think> is no token of its own here
    g = build_grammar(spelled, turn, [], "<|im_start|>assistant\n")
    assert walk(spelled.tokenizer, g, '<think>\nit is a number\n</think>\n\n{"a": 1}')
    assert walk(spelled.tokenizer, g, '{"a": 1}') and not walk(spelled.tokenizer, g, '<think>x {"a": 1}')
    g = build_grammar(spelled, turn, [], "<|im_start|>assistant\n<think>\n")
    assert walk(spelled.tokenizer, g, 'one</think>\n{"a": 1}')


def test_forced_calls_in_either_format(qwen3):
    tok = qwen3.tokenizer
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    one = ChatTurn([], [WEATHER, ADD], tool_choice="function", tool_name="add", parallel_tool_calls=False)
    g = build_grammar(qwen3, one, [WEATHER, ADD], closed)
    assert walk(tok, g, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    assert not walk(tok, g, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "x"}}\n</tool_call>')
    many = ChatTurn([], [WEATHER, ADD], tool_choice="required")
    g = build_grammar(qwen3, many, [WEATHER, ADD], closed)
    assert walk(tok, g, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "x"}}\n</tool_call>\n'
                        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>')
    llama = ChatTemplate(train_tokenizer(chat_template="llama3"))
    g = build_grammar(llama, many, [WEATHER, ADD], "")
    assert walk(llama.tokenizer, g, '{"name": "add", "parameters": {"b": 2}}; {"name": "get_weather", '
                                    '"parameters": {"city": "Rome"}}')


def test_unsupported_schema_is_a_400_naming_the_field(qwen3):
    bad = {"type": "object", "properties": {"a": {"not": {"type": "integer"}}}}
    with pytest.raises(APIError) as e:
        build_grammar(qwen3, ChatTurn([], output=OutputFormat("json_schema", bad)), [], "")
    assert e.value.param == "response_format" and "not" in e.value.message
    with pytest.raises(APIError) as e:
        build_grammar(qwen3, ChatTurn([], [Function("f", None, bad)], tool_choice="required"),
                      [Function("f", None, bad)], "")
    assert e.value.param == "tools" and "tools[0] (f)" in e.value.message
    assert grammar.check(build_grammar(qwen3, ChatTurn([], output=OutputFormat("json_object")), [], "")) is None
