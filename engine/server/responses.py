"""OpenAI's Responses API (`POST /v1/responses`), what the Agents SDK and newer clients call by default, on the same
chat pipeline as /v1/chat/completions (engine.server.chat): `input` (text or a list of messages, function calls and
their outputs), `instructions`, function tools, `text.format`, and streaming as typed events.

Stateless: nothing is stored (`store` is ignored and reported false), so `previous_response_id` and `conversation`
are 400s telling the client to send the whole conversation, and GET /v1/responses/{id} is a 404.
"""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from engine.errors import RequestError
from engine.params import SamplingParams
from engine.server import chat
from engine.server import protocol as p
from engine.server.errors import APIError, bad_request, from_request_error
from engine.server.frontend import Frontend
from engine.server.serving import EventStream, arguments_object, collect, dumps, received, usage_of
from engine.server.templates import Message
from engine.server.tools import Function, ToolCall

_ITEM = ConfigDict(extra="ignore", allow_inf_nan=False)
TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text", "refusal")


class Part(BaseModel):
    model_config = _ITEM
    type: p.Text
    text: p.Text | None = None
    refusal: p.Text | None = None


Content = p.Text | Annotated[list[Part], Field(max_length=p.MAX_PARTS)]


class InputItem(BaseModel):
    """Any input item; each type's fields are checked where it is converted (engine.server.responses.messages)."""
    model_config = _ITEM
    type: p.Text | None = None  # "message" when absent
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: Content | None = None
    call_id: p.Text | None = None
    name: p.Text | None = None
    arguments: p.Text | None = None
    output: Content | None = None


class ResponseTool(BaseModel):
    model_config = _ITEM
    type: p.Text
    name: p.FunctionName | None = None
    description: p.Text | None = None
    parameters: p.JSONObject | None = None
    strict: bool | None = None


class NamedTool(BaseModel):
    model_config = _ITEM
    type: p.Text
    name: p.FunctionName | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: p.Text | None = None
    schema_: p.JSONObject | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = _ITEM
    format: TextFormat | None = None


class Reasoning(BaseModel):
    model_config = _ITEM
    effort: p.Text | None = None  # passed to the chat template as `reasoning_effort`


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: p.Text | None = None
    input: p.Text | Annotated[list[InputItem], Field(min_length=1, max_length=p.MAX_MESSAGES)]
    instructions: p.Text | None = None
    tools: Annotated[list[ResponseTool], Field(max_length=p.MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: p.PositiveInt | None = None
    temperature: p._ranged("temperature") = 1.0
    top_p: p._ranged("top_p") = 1.0
    stream: bool = False
    reasoning: Reasoning | None = None
    # extensions (vLLM's)
    top_k: p._ranged("top_k", int) = 0
    min_p: p._ranged("min_p") = 0.0
    repetition_penalty: p._ranged("repetition_penalty") = 1.0
    seed: int | None = None
    chat_template_kwargs: p.JSONObject | None = None


PARAMS = {"tools": "tools", "tool_choice": "tool_choice", "format": "text"}


def _text(content, where: str) -> tuple[str, ...]:
    if content is None:
        return ()
    if isinstance(content, str):
        return (content,)
    out = []
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS:
            raise bad_request(f"{where}[{j}] is of type {part.type!r}; only text parts ({', '.join(TEXT_PARTS[:3])}) "
                              "are supported", "input")
        out.append(part.text if part.text is not None else part.refusal or "")
    return tuple(out)


def messages(req: ResponsesRequest) -> list[Message]:
    out: list[Message] = [Message("system", (req.instructions,))] if req.instructions else []
    if isinstance(req.input, str):
        return out + [Message("user", (req.input,))]
    names: dict[str, str] = {}  # call_id -> function name, for the outputs
    thought: str | None = None  # a reasoning item, kept for the assistant turn after it
    for i, item in enumerate(req.input):
        kind = item.type or "message"
        where = f"input[{i}]"
        if kind == "message":
            if item.role is None:
                raise bad_request(f"{where}: a message needs a role (user, system, developer, assistant)", "input")
            parts = _text(item.content, f"{where}.content")
            role = "system" if item.role == "developer" else item.role
            out.append(Message(role, parts, isinstance(item.content, list) and role != "assistant",
                               reasoning=thought if role == "assistant" else None))
            thought = None if role == "assistant" else thought
        elif kind == "function_call":
            if not item.call_id or not item.name:
                raise bad_request(f"{where}: a function_call needs call_id and name", "input")
            call = (item.call_id, item.name, arguments_object(item.arguments or "{}", f"{where}.arguments", "input"))
            names[item.call_id] = item.name
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and (last.tool_calls or not last.parts):
                out[-1] = Message("assistant", last.parts, tool_calls=last.tool_calls + (call,),
                                  reasoning=last.reasoning)
            else:
                out.append(Message("assistant", None, tool_calls=(call,), reasoning=thought))
                thought = None
        elif kind == "function_call_output":
            if not item.call_id:
                raise bad_request(f"{where}: a function_call_output needs call_id", "input")
            out.append(Message("tool", _text(item.output, f"{where}.output") or ("",), name=names.get(item.call_id),
                               tool_call_id=item.call_id))
        elif kind == "reasoning":
            thought = "\n".join(_text(item.content, f"{where}.content")) or None
        else:
            raise bad_request(f"{where} is of type {kind!r}; this server takes message, function_call, "
                              "function_call_output and reasoning items", "input")
    if not out:
        raise bad_request("input holds no message, call or call output", "input")
    return out


def turn(req: ResponsesRequest) -> chat.ChatTurn:
    functions = []
    for i, t in enumerate(req.tools or ()):
        if t.type != "function" or not t.name:
            raise bad_request(f"tools[{i}] is of type {t.type!r}; only function tools (with a name) run on this "
                              "server", "tools")
        functions.append(Function(t.name, t.description, t.parameters or {"type": "object"}, bool(t.strict)))
    choice, named = req.tool_choice or "auto", None
    if isinstance(choice, NamedTool):
        if choice.type != "function" or not choice.name:
            raise bad_request(f"tool_choice of type {choice.type!r} is not supported; use auto, none, required or "
                              "{\"type\": \"function\", \"name\": ...}", "tool_choice")
        choice, named = "function", choice.name
    fmt = req.text.format if req.text and req.text.format else None
    output = None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise bad_request("text.format of type json_schema needs a schema", "text")
        output = chat.OutputFormat("json_schema", fmt.schema_)
    elif fmt is not None and fmt.type == "json_object":
        output = chat.OutputFormat("json_object")
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning and req.reasoning.effort:
        kwargs.setdefault("reasoning_effort", req.reasoning.effort)
    return chat.ChatTurn(messages(req), functions, choice, named, req.parallel_tool_calls, output, kwargs,
                         params=PARAMS)


# ---- the response object ----

def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Shape:
    """The response object and its output items for one generation, built up as the text arrives."""

    def __init__(self, req: ResponsesRequest, rid: str, model: str, created: int):
        self.req, self.rid, self.model, self.created = req, rid, model, created
        self.items: list[dict] = []

    def response(self, status: str, usage: dict | None = None, reason: str | None = None) -> dict:
        r = self.req
        fmt = r.text.format.model_dump(by_alias=True, exclude_none=True) if r.text and r.text.format else \
            {"type": "text"}
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": self.items, "instructions": r.instructions,
                "tools": [t.model_dump(exclude_none=True) for t in r.tools or ()],
                "tool_choice": r.tool_choice.model_dump() if isinstance(r.tool_choice, BaseModel)
                else r.tool_choice or "auto",
                "parallel_tool_calls": r.parallel_tool_calls, "temperature": r.temperature, "top_p": r.top_p,
                "max_output_tokens": r.max_output_tokens, "text": {"format": fmt}, "store": False,
                "previous_response_id": None, "reasoning": r.reasoning.model_dump() if r.reasoning else None,
                "truncation": "disabled", "metadata": (r.model_extra or {}).get("metadata") or {},
                "error": None, "incomplete_details": {"reason": reason} if reason else None,
                "usage": None if usage is None else {
                    "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                    "total_tokens": usage["total_tokens"],
                    "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                    "output_tokens_details": {"reasoning_tokens": 0}}}


def _reasoning_item(text: str, status: str) -> dict:
    return {"id": _id("rs"), "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def _message_item(text: str, status: str) -> dict:
    return {"id": _id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text or
            status != "in_progress" else []}


def _call_item(c, status: str, arguments: str | None = None) -> dict:
    return {"id": f"fc_{c.id.removeprefix('call_')}", "type": "function_call", "call_id": c.id, "name": c.name,
            "arguments": c.arguments if arguments is None else arguments, "status": status}


async def create_response(fe: Frontend, req: ResponsesRequest, request: Request) -> Response:
    arrival = received(fe, req, "responses")
    t = turn(req)

    def params(g: str | None) -> SamplingParams:
        try:
            return SamplingParams(max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
                                  top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                                  seed=req.seed, grammar=g)
        except RequestError as e:
            raise from_request_error(e) from None

    params(None)
    fe.admit(1)
    prep = await chat.prepare(fe, t)
    sp = params(prep.grammar)
    ids = await fe.encode(prep.prompt, add_special_tokens=False)
    fe.check_prompt(ids, req.max_output_tokens, "input")
    rid = _id("resp")
    gen = fe.submit(rid, [ids], [[sp]], arrival)  # admits again, after the template and tokenizing
    shape = Shape(req, rid, fe.model_name, gen.created)
    out = prep.output()
    if req.stream:
        return EventStream(_events(gen, shape, out), gen)
    if not await collect(gen, request):
        return Response(status_code=499)
    c = gen.choices[0].state.completion()
    out.feed(c.text)
    out.finish()
    status = "incomplete" if c.finish_reason == "length" else "completed"
    if out.reasoning:
        shape.items.append(_reasoning_item(out.reasoning, "completed"))
    if out.content.strip() or not out.calls:
        shape.items.append(_message_item(out.content, status))
    shape.items += [_call_item(call, "completed") for call in out.calls]
    body = shape.response(status, usage_of(gen), "max_output_tokens" if status == "incomplete" else None)
    return Response(dumps(body), media_type="application/json")


async def _events(gen, shape: Shape, out: chat.ChatOutput) -> AsyncIterator[str]:
    """The typed event stream: created, in_progress, then per output item added -> deltas -> done, then completed
    (or incomplete when max_output_tokens cut it)."""
    seq = 0

    def event(kind: str, **body) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {dumps({'type': kind, 'sequence_number': seq - 1, **body})}\n\n"

    open_item: dict | None = None  # the reasoning or message item deltas go to
    calls_at: dict[str, int] = {}  # call id -> output index of its function_call item

    def close(status: str = "completed") -> list[str]:
        nonlocal open_item
        item, open_item = open_item, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": shape.items.index(item), "content_index": 0}
        text = item.pop("_text")
        item["status"] = status
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            done = [event("response.reasoning_text.done", text=text, **where),
                    event("response.content_part.done", part=item["content"][0], **where)]
        else:
            item["content"] = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
            done = [event("response.output_text.done", text=text, logprobs=[], **where),
                    event("response.content_part.done", part=item["content"][0], **where)]
        return done + [event("response.output_item.done", output_index=where["output_index"], item=item)]

    def write(kind: str, text: str) -> list[str]:
        nonlocal open_item
        lines = []
        if open_item is None or open_item["type"] != kind:
            lines += close()
            open_item = _reasoning_item("", "in_progress") if kind == "reasoning" else \
                _message_item("", "in_progress")
            open_item["_text"] = ""
            shape.items.append(open_item)
            index = len(shape.items) - 1
            added = {k: v for k, v in open_item.items() if k != "_text"}
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else \
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            lines += [event("response.output_item.added", output_index=index, item=added),
                      event("response.content_part.added", item_id=open_item["id"], output_index=index,
                            content_index=0, part=part)]
        open_item["_text"] += text
        where = {"item_id": open_item["id"], "output_index": shape.items.index(open_item), "content_index": 0}
        delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return lines + [event(delta, delta=text, **where, **extra)]

    def emit(d: chat.Delta) -> list[str]:
        lines = write("reasoning", d.reasoning) if d.reasoning else []
        if d.content and (d.content.strip() or (open_item is not None and open_item["type"] == "message")):
            lines += write("message", d.content)
        for pc in d.pieces:  # a call's item opens with its first piece; its arguments stream as deltas
            if pc.first:
                lines += close()
                shape.items.append(_call_item(ToolCall(pc.id, pc.name, ""), "in_progress"))
                calls_at[pc.id] = len(shape.items) - 1
                lines.append(event("response.output_item.added", output_index=calls_at[pc.id],
                                   item=dict(shape.items[-1])))
            if pc.text:
                index = calls_at[pc.id]
                lines.append(event("response.function_call_arguments.delta", delta=pc.text,
                                   item_id=shape.items[index]["id"], output_index=index))
        for c in d.calls:
            index = calls_at[c.id]
            where = {"item_id": shape.items[index]["id"], "output_index": index}
            lines.append(event("response.function_call_arguments.done", arguments=c.arguments, **where))
            shape.items[index] = _call_item(c, "completed")
            lines.append(event("response.output_item.done", output_index=index, item=shape.items[index]))
        return lines

    yield event("response.created", response=shape.response("in_progress"))
    yield event("response.in_progress", response=shape.response("in_progress"))
    reason = None
    try:
        async for item in gen.stream(keepalive=gen.fe.sse_keepalive):
            if item is None:
                yield ": keep-alive\n\n"
                continue
            _, ro = item
            for line in emit(out.feed(ro.text)):
                yield line
            if ro.finished:
                reason = ro.finish_reason
                for line in emit(out.finish()):
                    yield line
    except APIError as e:  # headers are out: report in-band, as OpenAI's stream does
        yield event("error", code=e.code, message=e.message, param=e.param)
        return
    if not any(i["type"] in ("message", "function_call") for i in shape.items):
        for line in write("message", ""):  # every response has its message, even an empty one
            yield line
    for line in close("incomplete" if reason == "length" else "completed"):
        yield line
    if reason == "length":
        yield event("response.incomplete", response=shape.response("incomplete", usage_of(gen), "max_output_tokens"))
    else:
        yield event("response.completed", response=shape.response("completed", usage_of(gen)))
