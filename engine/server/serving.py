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
from engine.server import protocol as p
from engine.server.errors import APIError, bad_request, from_request_error
from engine.server.frontend import Frontend, Generation

MIN_LOGPROB = -9999.0  # JSON has no -Infinity; OpenAI clients expect a number
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering (nginx in front)


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _params(req: p.SamplingFields, max_tokens: int | None, logprobs: int | None) -> list[SamplingParams]:
    """One SamplingParams per choice: with a seed, choice i uses seed + i (reproducible, yet the choices differ)."""
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    kw = {"max_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
          "min_p": req.min_p, "repetition_penalty": req.repetition_penalty, "presence_penalty": req.presence_penalty,
          "frequency_penalty": req.frequency_penalty, "stop": stop, "stop_token_ids": tuple(req.stop_token_ids or ()),
          "ignore_eos": req.ignore_eos, "min_tokens": req.min_tokens, "logprobs": logprobs}
    try:
        if req.seed is None:
            return [SamplingParams(**kw)] * req.n
        return [SamplingParams(**kw, seed=req.seed + i) for i in range(req.n)]
    except RequestError as e:
        raise from_request_error(e) from None


def _usage(gen: Generation) -> dict:
    done = sum(len(ch.state.token_ids) for ch in gen.choices)
    prompt = sum(gen.prompt_lens)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(gen: Generation, request: Request) -> bool:
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


class _Stream(StreamingResponse):
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
    """SSE framing shared by both endpoints: `chunk(index, output)` -> dict or None (nothing to send). A comment
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
                yield f"data: {_dumps(c)}\n\n"
        if usage_chunk is not None:
            yield f"data: {_dumps(usage_chunk(_usage(gen)))}\n\n"
    except APIError as e:  # headers are already sent: report in-band, as OpenAI does
        yield f"data: {_dumps(e.body())}\n\n"
    yield "data: [DONE]\n\n"


# ---- /v1/completions ----

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


async def create_completion(fe: Frontend, req: p.CompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    fe.check_available()
    fe.check_model(req.model)
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of different from n is not supported", "best_of")
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.echo and req.logprobs is not None:
        raise bad_request("echo together with logprobs (prompt logprobs) is not supported", "echo")
    params = _params(req, req.max_tokens, req.logprobs)
    single = isinstance(req.prompt, str) or not req.prompt or isinstance(req.prompt[0], int)
    count = (1 if single else len(req.prompt)) * req.n
    fe.check_fits(count, "n")
    fe.check_stop_tokens(params[0])
    fe.admit(count)  # a full queue answers 429 before any tokenizing
    prompts = await _prompts(fe, req.prompt)
    for ids in prompts:
        fe.check_prompt(ids, req.max_tokens, "prompt")
    fe.admit(count)  # still room after the (possibly off-loop) tokenizing
    rid, model = f"cmpl-{uuid.uuid4().hex}", fe.model_name
    gen = fe.submit(rid, prompts, [params] * len(prompts), arrival)
    if req.echo:  # each prompt decoded once, not once per choice
        texts = await fe.decode_many(prompts)
        echo = [texts[i // req.n] for i in range(len(gen.choices))]
    else:
        echo = None

    if req.stream:
        head = {"id": rid, "object": "text_completion", "created": gen.created, "model": model}
        with_usage = req.stream_options is not None and req.stream_options.include_usage
        offsets = [0] * len(gen.choices)

        def chunk(i: int, ro) -> dict | None:
            text = ro.text
            if echo is not None and echo[i] is not None:
                text, echo[i] = echo[i] + text, None
            if not text and not ro.finished and not ro.logprobs:
                return None  # text held back (partial UTF-8 / possible stop string)
            lp = None
            if ro.logprobs is not None and req.logprobs is not None:
                lp = _completion_logprobs(fe, ro.logprobs, offsets[i])
                offsets[i] += sum(len(t) for t in lp["tokens"])
            c = {**head, "choices": [{"index": i, "text": text, "logprobs": lp,
                                      "finish_reason": ro.finish_reason if ro.finished else None}]}
            return {**c, "usage": None} if with_usage else c

        usage = (lambda u: {**head, "choices": [], "usage": u}) if with_usage else None
        return _Stream(_events(gen, chunk, [], usage), gen)

    if not await _collect(gen, request):
        return Response(status_code=499)
    choices = []
    for ch in gen.choices:
        c = ch.state.completion()
        lp = None if req.logprobs is None else p.CompletionLogprobs(**_completion_logprobs(fe, c.logprobs or [], 0))
        choices.append(p.CompletionChoice(index=ch.index, text=(echo[ch.index] if echo else "") + c.text,
                                          logprobs=lp, finish_reason=c.finish_reason))
    body = p.CompletionResponse(id=rid, created=gen.created, model=model, choices=choices,
                                usage=p.Usage(**_usage(gen)))
    return Response(body.model_dump_json(), media_type="application/json")


# ---- /v1/chat/completions ----

def _chat_logprobs(fe: Frontend, lps) -> list[dict]:
    def entry(token_id: int, logprob: float) -> dict:
        s = fe.token_text(token_id)
        return {"token": s, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(fe.token_bytes(token_id))}
    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]


async def create_chat_completion(fe: Frontend, req: p.ChatCompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    fe.check_available()
    fe.check_model(req.model)
    if req.tools:
        raise bad_request("tools are not supported", "tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_request("only response_format {\"type\": \"text\"} is supported", "response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
    max_tokens = req.max_completion_tokens or req.max_tokens
    params = _params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
    fe.check_fits(req.n, "n")
    fe.check_stop_tokens(params[0])
    fe.admit(req.n)  # a full queue answers 429 before any template rendering or tokenizing
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
    ids = await fe.encode(await fe.render_chat(messages, req.add_generation_prompt), add_special_tokens=False)
    fe.check_prompt(ids, max_tokens, "messages")
    fe.admit(req.n)
    rid, model = f"chatcmpl-{uuid.uuid4().hex}", fe.model_name
    gen = fe.submit(rid, [ids], [params], arrival)

    if req.stream:
        head = {"id": rid, "object": "chat.completion.chunk", "created": gen.created, "model": model}
        with_usage = req.stream_options is not None and req.stream_options.include_usage
        extra = {"usage": None} if with_usage else {}
        role = {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        start = [f"data: {_dumps({**head, 'choices': [{'index': i, **role}], **extra})}\n\n" for i in range(req.n)]

        def chunk(i: int, ro) -> dict | None:
            if not ro.text and not ro.finished and not ro.logprobs:
                return None
            lp = {"content": _chat_logprobs(fe, ro.logprobs)} if ro.logprobs is not None and req.logprobs else None
            delta = {"content": ro.text} if ro.text else {}
            return {**head, "choices": [{"index": i, "delta": delta, "logprobs": lp,
                                         "finish_reason": ro.finish_reason if ro.finished else None}], **extra}

        usage = (lambda u: {**head, "choices": [], "usage": u}) if with_usage else None
        return _Stream(_events(gen, chunk, start, usage), gen)

    if not await _collect(gen, request):
        return Response(status_code=499)
    choices = []
    for ch in gen.choices:
        c = ch.state.completion()
        lp = p.ChatLogprobs(content=_chat_logprobs(fe, c.logprobs or [])) if req.logprobs else None
        choices.append(p.ChatChoice(index=ch.index, message=p.AssistantMessage(content=c.text), logprobs=lp,
                                    finish_reason=c.finish_reason))
    body = p.ChatCompletionResponse(id=rid, created=gen.created, model=model, choices=choices,
                                    usage=p.Usage(**_usage(gen)))
    return Response(body.model_dump_json(), media_type="application/json")
