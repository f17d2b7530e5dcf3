"""One chat generation as both chat APIs (/v1/chat/completions and /v1/responses) run it: the offered tools,
tool_choice and output format become a rendered prompt and, when the output is forced, a grammar; the model's text
comes back split into reasoning, content and tool calls.

Forcing: tool_choice `required` or a named function, and response_format `json_object` / `json_schema`, are
grammar-constrained (engine.grammar), so the JSON is valid for the schema however small the model. With tools
offered under `auto` and a JSON format, the grammar allows either a call or the JSON document. For a model that
thinks, the grammar admits the thinking first (`<think>…</think>`, or `…</think>` when the prompt opened it) and
constrains what follows; a prompt whose thinking is already closed (enable_thinking=false) constrains from the
first token.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from engine import grammar
from engine.server.errors import bad_request
from engine.server.reasoning import CLOSE, OPEN, ThinkSplitter, prompt_opens_thinking
from engine.server.templates import ChatTemplate, Message
from engine.server.tools import ArgsPiece, Format, Function, Stream, ToolCall

_CLOSED_AT_END = re.compile(r"</think>\s*\Z")


@dataclass(frozen=True, slots=True)
class OutputFormat:
    kind: str  # "text" | "json_object" | "json_schema"
    schema: dict | None = None  # json_schema only


@dataclass(frozen=True)
class ChatTurn:
    """What a chat request asks for, whichever API it came through. `params` names the request's fields in
    errors (the Responses API calls response_format `text`)."""
    messages: list[Message]
    functions: list[Function] = field(default_factory=list)
    tool_choice: str = "auto"  # auto | none | required | function (with tool_name)
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    output: OutputFormat | None = None
    template_kwargs: dict = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    params: dict = field(default_factory=lambda: {"tools": "tools", "tool_choice": "tool_choice",
                                                  "format": "response_format"})


@dataclass(slots=True)
class Delta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)  # completed in this delta
    pieces: list[ArgsPiece] = field(default_factory=list)  # calls' arguments as they stream

    def add(self, other: Delta) -> Delta:
        return Delta(self.reasoning + other.reasoning, self.content + other.content, self.calls + other.calls,
                     self.pieces + other.pieces)


class ChatOutput:
    """One choice's text -> reasoning, content and tool calls, as increments (`feed`, `finish`) and in total."""

    def __init__(self, thinking: ThinkSplitter | None, tools: Stream | None, max_calls: int | None = None):
        self.thinking, self.tools, self.max_calls = thinking, tools, max_calls
        self.reasoning, self.content, self.calls = "", "", []

    def _route(self, reasoning: str, content: str, end: bool) -> Delta:
        d = Delta(reasoning=reasoning)
        if self.tools is None:
            d.content = content
        else:
            parsed = self.tools.feed(content)
            if end:
                parsed.add(self.tools.finish())
            d.content, d.calls, d.pieces = parsed.content, parsed.calls, parsed.pieces
            if self.max_calls is not None:  # parallel_tool_calls false: calls after the first are dropped
                d.calls = d.calls[: max(0, self.max_calls - len(self.calls))]
                d.pieces = [pc for pc in d.pieces if pc.index < self.max_calls]
        self.reasoning += d.reasoning
        self.content += d.content
        self.calls += d.calls
        return d

    def feed(self, text: str) -> Delta:
        if self.thinking is None:
            return self._route("", text, False)
        return self._route(*self.thinking.feed(text), False)

    def finish(self) -> Delta:
        return self._route(*(self.thinking.finish() if self.thinking else ("", "")), True)

    def message(self) -> dict:
        """The assistant message fields: content (None when there are calls and only whitespace besides),
        reasoning_content when the model thought, tool_calls when it called."""
        content = self.content if not (self.calls and not self.content.strip()) else None
        out: dict = {"content": content}
        if self.thinking is not None and self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.calls:
            out["tool_calls"] = [openai_call(c) for c in self.calls]
        return out


def openai_call(c: ToolCall) -> dict:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def call_deltas(pieces: list[ArgsPiece]) -> list[dict]:
    """Streamed arguments in OpenAI's delta shape, one entry per call and chunk: the entry that announces a call
    carries index, id, type and name; later ones index and the next arguments text."""
    out: list[dict] = []
    for pc in pieces:
        if out and out[-1]["index"] == pc.index:
            out[-1]["function"]["arguments"] += pc.text
        elif pc.first:
            out.append({"index": pc.index, "id": pc.id, "type": "function",
                        "function": {"name": pc.name, "arguments": pc.text}})
        else:
            out.append({"index": pc.index, "function": {"arguments": pc.text}})
    return out


def finish_reason(out: ChatOutput, reason: str | None) -> str | None:
    return "tool_calls" if out.calls and reason == "stop" else reason


@dataclass(frozen=True)
class Prepared:
    prompt: str
    grammar: str | None
    format: Format | None  # the tool-call format to parse, None when no tools may be called
    opens_thinking: bool | None  # None: no reasoning parser
    max_calls: int | None = None  # 1 when parallel_tool_calls is false

    def output(self) -> ChatOutput:
        thinking = None if self.opens_thinking is None else ThinkSplitter(self.opens_thinking)
        return ChatOutput(thinking, self.format.stream() if self.format else None, self.max_calls)


def check_tools(turn: ChatTurn) -> list[Function]:
    """The functions the model may call under tool_choice (none: no tools at all), after the choice's checks."""
    names = [f.name for f in turn.functions]
    p = turn.params
    if len(set(names)) != len(names):
        raise bad_request(f"{p['tools']}: function names must be unique", p["tools"])
    if turn.tool_choice in ("required", "function") and not turn.functions:
        raise bad_request(f"{p['tool_choice']} {turn.tool_choice!r} needs {p['tools']}", p["tool_choice"])
    if turn.tool_choice == "function" and turn.tool_name not in names:
        raise bad_request(f"{p['tool_choice']} names the function {turn.tool_name!r}, which is not among "
                          f"{p['tools']} ({', '.join(names)})", p["tool_choice"])
    if turn.tool_choice == "none":
        return []
    return turn.functions


def schema_grammar(schema: dict, what: str, param: str) -> str:
    """The grammar of JSON documents valid for `schema`; a 400 naming what llguidance cannot enforce."""
    g = grammar.json_schema(schema)
    err = grammar.check(g)
    if err is not None:
        raise bad_request(f"{what} cannot be enforced: {err}. Remove or rewrite the unsupported parts of the "
                          "schema", param)
    return g


def build_grammar(tpl: ChatTemplate, turn: ChatTurn, functions: list[Function], prompt: str) -> str | None:
    """The grammar the output must follow, or None when it is free."""
    p = turn.params
    forced = turn.tool_choice in ("required", "function")
    fmt = turn.output.kind if turn.output else "text"
    if not forced and fmt == "text":
        return None
    rules: list[str] = []
    if forced:
        chosen = [f for f in functions if turn.tool_choice == "required" or f.name == turn.tool_name]
        for i, f in enumerate(functions):
            if f in chosen:
                schema_grammar(f.parameters, f"{p['tools']}[{i}] ({f.name}) parameters", p["tools"])
        rules.append(tpl.format.calls_rule(chosen, turn.parallel_tool_calls, tpl.tag))
        body = "calls"
    else:
        schema = turn.output.schema if fmt == "json_schema" else {"type": "object"}
        document = schema_grammar(schema, f"{p['format']} schema", p["format"])
        rules.append(f"json_body: {grammar.lark_json(schema)}")
        body = "json_body"
        if functions:  # tools under auto: a call is as welcome as the document
            rules.append(tpl.format.calls_rule(functions, turn.parallel_tool_calls, tpl.tag))
            body = "json_body | calls"
    thinking = tpl.thinks and not _CLOSED_AT_END.search(prompt)
    if not thinking and not forced and not functions:
        return document  # a plain JSON document: no Lark needed
    if not thinking:
        start = f"start: {body}"
    else:
        opened = prompt_opens_thinking(prompt)
        start = f"start: {'thought' if opened else 'thought?'} ({body})\n" + _thought(tpl, opened)
    g = grammar.lark("\n".join([start, *rules]))
    err = grammar.check(g)
    if err is not None:
        raise bad_request(f"the output cannot be constrained: {err}", p["tools"] if forced else p["format"])
    return g


def _thought(tpl: ChatTemplate, opened: bool) -> str:
    """Lark rule `thought`: the thinking before the constrained part, up to </think> and the blank after it. When
    </think> is one token, text can never contain it, so any text runs until it comes; spelled out, the text is a
    lazy terminal that ends at the first </think>."""
    head = "" if opened else f"{tpl.tag(OPEN)} "
    if tpl.tag(CLOSE) == CLOSE:
        return f"thought: {head}/(.|\\n)*/ {CLOSE} /[ \\n]*/"
    return f"thought: {head}thought_text /[ \\n]*/\nthought_text[lazy]: /(.|\\n)*<\\/think>/"


async def prepare(fe, turn: ChatTurn) -> Prepared:
    """Render the prompt and build the grammar (template work runs off the event loop when it is large)."""
    tpl: ChatTemplate = fe.chat_template
    if not tpl.available:
        raise bad_request("this model's tokenizer has no chat template; use /v1/completions", "messages")
    functions = check_tools(turn)
    size = sum(len(m.text) for m in turn.messages) + len(turn.messages) * 64 + len(str(functions))
    prompt = await fe.off_loop(size, lambda: tpl.render(
        turn.messages, functions, add_generation_prompt=turn.add_generation_prompt,
        continue_final_message=turn.continue_final_message, kwargs=turn.template_kwargs))
    g = build_grammar(tpl, turn, functions, prompt)
    return Prepared(prompt, g, tpl.format if functions else None,
                    prompt_opens_thinking(prompt) if tpl.thinks else None,
                    None if turn.parallel_tool_calls else 1)
