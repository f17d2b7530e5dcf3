"""OpenAI completions and chat completions: validated request -> engine requests -> JSON response or SSE stream."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from engine.errors import RequestError
from engine.params import SamplingParams
from engine.server import chat, fields
from engine.server import protocol as p
from engine.server.errors import APIError, bad_request, from_request_error
from engine.server.frontend import Frontend, Generation
from engine.server.templates import Message
from engine.server.tools import Function, call_id

MIN_LOGPROB = -9999.0  # JSON has no -Infinity; OpenAI clients expect a number
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering (nginx in front)


dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # one encoder, not one per call
_MARK = "\x00text\x00"  # stands for the text in a chunk template


def splice(chunk: dict) -> tuple[str, str]:
    """dumps(chunk) around the _MARK that is its last string (before it: the id and model name, whatever they hold):
    (before, after), where before + dumps(text) + after is dumps(chunk) with text in the mark's place. A stream's
    chunks mostly differ in one token's text only; encoding just that costs ~0.4 us against ~9 us for the whole
    chunk, paid per token on CPUs the front end may share with the engine."""
    before, _, after = dumps(chunk).rpartition(dumps(_MARK))
    return before, after


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI sends token ids as JSON object keys (strings)."""
    out = []
    for key, value in (bias or {}).items():
        try:
            tid = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids (integers as strings), got {key!r}",
                              "logit_bias") from None
        if tid < 0:
            raise bad_request(f"logit_bias keys must be token ids >= 0, got {key!r}", "logit_bias")
        out.append((tid, value))
    return tuple(sorted(out))


def _params(req: p.SamplingFields, max_tokens: int | None, logprobs: int | None,
            grammar_text: str | None = None) -> list[SamplingParams]:
    """One SamplingParams per choice: with a seed, choice i uses seed + i (reproducible, yet the choices differ)."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    kw = {"max_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
          "min_p": req.min_p, "repetition_penalty": req.repetition_penalty, "presence_penalty": req.presence_penalty,
          "frequency_penalty": req.frequency_penalty, "stop": stop, "stop_token_ids": tuple(req.stop_token_ids or ()),
          "ignore_eos": req.ignore_eos, "min_tokens": req.min_tokens, "logprobs": logprobs,
          "logit_bias": logit_bias(req.logit_bias), "grammar": grammar_text}
    try:
        if req.seed is None:
            return [SamplingParams(**kw)] * req.n
        return [SamplingParams(**kw, seed=req.seed + i) for i in range(req.n)]
    except RequestError as e:
        raise from_request_error(e) from None


def usage_of(gen: Generation) -> dict:
    done = sum(len(ch.state.token_ids) for ch in gen.choices)
    prompt = sum(gen.prompt_lens)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(gen: Generation, request: Request) -> bool:
    """Run a non-streaming generation to the end; False if the client went away first (its requests aborted)."""
    async def consume() -> None:
        async for _ in gen.stream():
            pass

    work = asyncio.ensure_future(consume())
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            work.result()  # re-raises APIError
            return True
        return False
    finally:
        for t in (work, gone):
            t.cancel()
        gen.cancel()


class EventStream(StreamingResponse):
    """An SSE response that aborts its generation however the response ends: done, client gone (cancellation),
    or cancelled before the first chunk was even produced."""

    def __init__(self, events: AsyncIterator[str], gen: Generation):
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self.gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.cancel()


async def _events(gen: Generation, chunk, start: list[str], usage_chunk) -> AsyncIterator[str]:
    """SSE framing shared by both endpoints: `chunk(index, output)` -> JSON text or None (nothing to send). A comment
    line goes out after every `keepalive` seconds of silence (queued, or a long prefill): clients, nginx and
    load balancers keep the connection, and a client that left is noticed."""
    try:
        for line in start:
            yield line
        async for item in gen.stream(keepalive=gen.fe.sse_keepalive):
            if item is None:
                yield ": keep-alive\n\n"
                continue
            index, ro = item
            c = chunk(index, ro)
            if c is not None:
                yield f"data: {c}\n\n"
        if usage_chunk is not None:
            yield f"data: {dumps(usage_chunk(usage_of(gen)))}\n\n"
    except APIError as e:  # headers are already sent: report in-band, as OpenAI does
        yield f"data: {dumps(e.body())}\n\n"
    yield "data: [DONE]\n\n"


# ---- /v1/completions ----

def _completion_grammar(fmt: p.ResponseFormat | None) -> str | None:
    """response_format on a completion: the text itself must be the JSON document."""
    out = output_format(fmt, "response_format")
    if out is None:
        return None
    return chat.schema_grammar(out.schema or {"type": "object"}, "response_format schema", "response_format")


async def _prompts(fe: Frontend, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        return [await fe.encode(prompt)]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt[0], str):
        return await fe.encode_many(prompt)  # one off-loop decision for the whole batch
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(x) for x in prompt]


def _completion_logprobs(fe: Frontend, lps, offset: int) -> dict:
    tokens = [fe.token_text(lp.token_id) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [max(lp.logprob, MIN_LOGPROB) for lp in lps],
            "top_logprobs": [{fe.token_text(t): max(v, MIN_LOGPROB) for t, v in ((lp.token_id, lp.logprob),) + lp.top}
                             for lp in lps],
            "text_offset": offsets}


def received(fe: Frontend, req, endpoint: str) -> float:
    """What every generation endpoint checks first, before any work: 503 unless the engine is ready, 404 for another
    model, the fields `endpoint` ignores or rejects. Returns when the request came in (time.monotonic()).
    Admission (429 for a full queue) follows once the request's size is known (Frontend.admit), and again in
    Frontend.submit, after the tokenizing."""
    arrival = time.monotonic()
    fe.check_available()
    fe.check_model(req.model)
    fields.check(req, endpoint)
    return arrival


async def create_completion(fe: Frontend, req: p.CompletionRequest, request: Request) -> Response:
    arrival = received(fe, req, "completions")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of different from n is not supported", "best_of")
    if req.echo and req.logprobs is not None:
        raise bad_request("echo together with logprobs (prompt logprobs) is not supported", "echo")
    params = _params(req, req.max_tokens, req.logprobs, _completion_grammar(req.response_format))
    single = isinstance(req.prompt, str) or not req.prompt or isinstance(req.prompt[0], int)
    count = (1 if single else len(req.prompt)) * req.n
    fe.check_fits(count, "n")
    fe.check_token_ids(params[0])
    fe.admit(count)  # a full queue answers 429 before any tokenizing
    prompts = await _prompts(fe, req.prompt)
    for ids in prompts:
        fe.check_prompt(ids, req.max_tokens, "prompt")
    rid, model = f"cmpl-{uuid.uuid4().hex}", fe.model_name
    gen = fe.submit(rid, prompts, [params] * len(prompts), arrival)  # admits again, after the tokenizing
    if req.echo:  # each prompt decoded once, not once per choice
        texts = await fe.decode_many(prompts)
        echo = [texts[i // req.n] for i in range(len(gen.choices))]
    else:
        echo = None

    if req.stream:
        head = {"id": rid, "object": "text_completion", "created": gen.created, "model": model}
        with_usage = req.stream_options is not None and req.stream_options.include_usage
        offsets = [0] * len(gen.choices)
        extra = {"usage": None} if with_usage else {}
        plain = [splice({**head, "choices": [{"index": i, "text": _MARK, "logprobs": None, "finish_reason": None}],
                         **extra}) for i in range(len(gen.choices))]

        def chunk(i: int, ro) -> str | None:
            text = ro.text
            if echo is not None and echo[i] is not None:
                text, echo[i] = echo[i] + text, None
            if not text and not ro.finished and not ro.logprobs:
                return None  # text held back (partial UTF-8 / possible stop string)
            lp = None
            if ro.logprobs is not None and req.logprobs is not None:
                lp = _completion_logprobs(fe, ro.logprobs, offsets[i])
                offsets[i] += sum(len(t) for t in lp["tokens"])
            if lp is None and not ro.finished:  # a plain token: only its text differs from the template
                before, after = plain[i]
                return before + dumps(text) + after
            return dumps({**head, "choices": [{"index": i, "text": text, "logprobs": lp,
                                               "finish_reason": ro.finish_reason if ro.finished else None}], **extra})

        usage = (lambda u: {**head, "choices": [], "usage": u}) if with_usage else None
        return EventStream(_events(gen, chunk, [], usage), gen)

    if not await collect(gen, request):
        return Response(status_code=499)
    choices = []
    for ch in gen.choices:
        c = ch.state.completion()
        lp = None if req.logprobs is None else p.CompletionLogprobs(**_completion_logprobs(fe, c.logprobs or [], 0))
        choices.append(p.CompletionChoice(index=ch.index, text=(echo[ch.index] if echo else "") + c.text,
                                          logprobs=lp, finish_reason=c.finish_reason))
    body = p.CompletionResponse(id=rid, created=gen.created, model=model, choices=choices,
                                usage=p.Usage(**usage_of(gen)))
    return Response(body.model_dump_json(), media_type="application/json")


# ---- /v1/chat/completions ----

def _chat_logprobs(fe: Frontend, lps) -> list[dict]:
    def entry(token_id: int, logprob: float) -> dict:
        s = fe.token_text(token_id)
        return {"token": s, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(fe.token_bytes(token_id))}
    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]


def output_format(fmt: p.ResponseFormat | None, param: str) -> chat.OutputFormat | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise bad_request(f"{param} of type json_schema needs json_schema: {{name, schema}}", param)
        return chat.OutputFormat("json_schema", fmt.json_schema.schema_)
    return chat.OutputFormat("json_object")


def arguments_object(text: str, where: str, param: str = "messages") -> dict:
    """A call's arguments as sent back in the history (JSON text) -> the object templates render."""
    try:
        args = json.loads(text) if text.strip() else {}
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise bad_request(f"{where} must be a JSON object as text, got {text[:80]!r}", param)
    return args


def chat_messages(messages: list[p.ChatMessage]) -> list[Message]:
    out = []
    for i, m in enumerate(messages):
        listed = isinstance(m.content, list)
        parts = tuple(x.text for x in m.content) if listed else None if m.content is None else (m.content,)
        calls = tuple((c.id or call_id(), c.function.name,
                       arguments_object(c.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments"))
                      for j, c in enumerate(m.tool_calls or ()))
        if calls and m.role != "assistant":
            raise bad_request(f"messages[{i}]: only assistant messages carry tool_calls", "messages")
        out.append(Message("system" if m.role == "developer" else m.role, parts, listed, m.name, calls,
                           m.tool_call_id, m.reasoning_content))
    return out


def chat_turn(req: p.ChatCompletionRequest) -> chat.ChatTurn:
    choice = req.tool_choice or "auto"
    named = choice.function.name if isinstance(choice, p.NamedToolChoice) else None
    functions = [Function(t.function.name, t.function.description, t.function.parameters or {"type": "object"},
                          bool(t.function.strict)) for t in req.tools or ()]
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    add_gen = req.add_generation_prompt
    if req.continue_final_message:
        if "add_generation_prompt" in req.model_fields_set and add_gen:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true: the first "
                              "continues the last message, the second starts a new one", "continue_final_message")
        add_gen = False
    return chat.ChatTurn(chat_messages(req.messages), functions, "function" if named else choice, named,
                         req.parallel_tool_calls, output_format(req.response_format, "response_format"), kwargs,
                         add_gen, req.continue_final_message)


async def create_chat_completion(fe: Frontend, req: p.ChatCompletionRequest, request: Request) -> Response:
    arrival = received(fe, req, "chat")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
    max_tokens = req.max_completion_tokens or req.max_tokens
    turn = chat_turn(req)
    _params(req, max_tokens, None)  # every sampling check before any template work
    fe.check_fits(req.n, "n")
    fe.admit(req.n)  # a full queue answers 429 before any template rendering or tokenizing
    prep = await chat.prepare(fe, turn)
    params = _params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, prep.grammar)
    fe.check_token_ids(params[0])
    ids = await fe.encode(prep.prompt, add_special_tokens=False)
    fe.check_prompt(ids, max_tokens, "messages")
    rid, model = f"chatcmpl-{uuid.uuid4().hex}", fe.model_name
    gen = fe.submit(rid, [ids], [params], arrival)  # admits again, after the template and tokenizing
    outs = [prep.output() for _ in gen.choices]

    if req.stream:
        head = {"id": rid, "object": "chat.completion.chunk", "created": gen.created, "model": model}
        with_usage = req.stream_options is not None and req.stream_options.include_usage
        extra = {"usage": None} if with_usage else {}
        role = {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        start = [f"data: {dumps({**head, 'choices': [{'index': i, **role}], **extra})}\n\n" for i in range(req.n)]
        plain = [splice({**head, "choices": [{"index": i, "delta": {"content": _MARK}, "logprobs": None,
                                              "finish_reason": None}], **extra}) for i in range(req.n)]

        def chunk(i: int, ro) -> str | None:
            out = outs[i]
            d = out.feed(ro.text)
            if ro.finished:
                d = d.add(out.finish())
            if not (d.reasoning or d.content or d.pieces) and not ro.finished and not ro.logprobs:
                return None
            delta: dict = {}
            if d.reasoning:
                delta["reasoning_content"] = d.reasoning
            if d.content:
                delta["content"] = d.content
            if d.pieces:
                delta["tool_calls"] = chat.call_deltas(d.pieces)
            lp = {"content": _chat_logprobs(fe, ro.logprobs)} if ro.logprobs is not None and req.logprobs else None
            if lp is None and not ro.finished and list(delta) == ["content"]:  # plain content: the template
                before, after = plain[i]
                return before + dumps(d.content) + after
            reason = chat.finish_reason(out, ro.finish_reason) if ro.finished else None
            return dumps({**head, "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}],
                          **extra})

        usage = (lambda u: {**head, "choices": [], "usage": u}) if with_usage else None
        return EventStream(_events(gen, chunk, start, usage), gen)

    if not await collect(gen, request):
        return Response(status_code=499)
    choices = []
    for ch, out in zip(gen.choices, outs):
        c = ch.state.completion()
        out.feed(c.text)
        out.finish()
        lp = p.ChatLogprobs(content=_chat_logprobs(fe, c.logprobs or [])) if req.logprobs else None
        choices.append(p.ChatChoice(index=ch.index, message=p.AssistantMessage(**out.message()), logprobs=lp,
                                    finish_reason=chat.finish_reason(out, c.finish_reason)))
    body = p.ChatCompletionResponse(id=rid, created=gen.created, model=model, choices=choices,
                                    usage=p.Usage(**usage_of(gen)))
    return Response(body.model_dump_json(), media_type="application/json")
