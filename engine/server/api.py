"""The FastAPI app: routes of the OpenAI-compatible API plus health, metrics, tokenizer and debug endpoints."""
from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from deploykit import __version__
from deploykit.binding_report import BindingReport, EngineReport, FrontendReport
from engine.server import errors, responses, serving
from engine.server import protocol as p
from engine.server.frontend import Frontend, State
from engine.server.middleware import Gate

ERRORS = {code: {"model": p.ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}


def build_app(fe: Frontend, *, api_key: str | None, max_body_bytes: int, allowed_origins: tuple[str, ...] = (),
              on_shutdown: Callable[[], None] = lambda: None):
    """Returns the ASGI app: the FastAPI app inside the auth/body-size gate, inside CORS when origins are allowed
    (outermost, so a browser's preflight OPTIONS is answered without a key and every answer, a 401 included,
    carries the CORS headers the browser needs to show it)."""
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        fe.attach()
        yield
        on_shutdown()

    app = FastAPI(title="deploykit engine", version=__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    errors.install(app)

    @app.get("/health")
    async def health() -> Response:
        ok = fe.state is State.READY
        return JSONResponse({"status": "ok" if ok else fe.state.value}, 200 if ok else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = fe.metrics.render()
        return Response(body, media_type=content_type)

    def card() -> p.ModelCard:
        return p.ModelCard(id=fe.model_name, created=started, root=fe.model_name, max_model_len=fe.max_model_len)

    @app.get("/v1/models", response_model=p.ModelList, responses=ERRORS)
    async def models() -> p.ModelList:
        return p.ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}", response_model=p.ModelCard, responses=ERRORS)
    async def model(model_id: str) -> p.ModelCard:
        """What the SDK's `models.retrieve(id)` calls; ids may contain '/' (hub names)."""
        fe.check_model(model_id)
        return card()

    @app.post("/v1/completions", response_model=p.CompletionResponse, responses=ERRORS)
    async def completions(req: p.CompletionRequest, request: Request) -> Response:
        return await _counted(fe, serving.create_completion(fe, req, request))

    @app.post("/v1/chat/completions", response_model=p.ChatCompletionResponse, responses=ERRORS)
    async def chat_completions(req: p.ChatCompletionRequest, request: Request) -> Response:
        return await _counted(fe, serving.create_chat_completion(fe, req, request))

    @app.post("/v1/responses", responses=ERRORS)
    async def create_response(req: responses.ResponsesRequest, request: Request) -> Response:
        return await _counted(fe, responses.create_response(fe, req, request))

    @app.get("/v1/responses/{response_id}", responses=ERRORS)
    async def get_response(response_id: str) -> Response:
        raise errors.APIError(404, f"response {response_id!r} not found: this server is stateless and stores no "
                                   "responses (store is always false)", param="response_id", code="not_found")

    @app.post("/tokenize", response_model=p.TokenizeResponse, responses=ERRORS)
    async def tokenize(req: p.TokenizeRequest) -> p.TokenizeResponse:
        ids = await fe.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return p.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=fe.max_model_len)

    @app.post("/detokenize", response_model=p.DetokenizeResponse, responses=ERRORS)
    async def detokenize(req: p.DetokenizeRequest) -> p.DetokenizeResponse:
        vocab = len(fe.tokenizer)
        bad = next((t for t in req.tokens if t >= vocab), None)
        if bad is not None:
            raise errors.bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return p.DetokenizeResponse(prompt=(await fe.decode_many([req.tokens]))[0])

    @app.get("/debug/binding", responses=ERRORS)
    async def debug_binding() -> dict:
        """The engine process's CPU/memory binding report, every thread with its allowed and last CPU."""
        if fe.state in (State.LOADING, State.DEAD):
            fe.check_available()
        engine = await fe.call("binding")
        if not isinstance(engine, EngineReport):  # the engine failed to build it: {"error": ...}
            return {"engine": engine, "frontend": _frontend_binding().to_dict()}
        return BindingReport(engine, _frontend_binding()).to_dict()

    gated = Gate(app, api_key=api_key, max_body_bytes=max_body_bytes)
    if not allowed_origins:
        return gated
    from starlette.middleware.cors import CORSMiddleware
    # allow_headers "*": the OpenAI SDKs send their own (x-stainless-*, openai-*) next to Authorization
    return CORSMiddleware(gated, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                          allow_headers=["*"], max_age=600)


async def _counted(fe: Frontend, handler) -> Response:
    try:
        return await handler
    except errors.APIError as e:
        fe.metrics.rejected(e.status)
        raise


def _frontend_binding() -> FrontendReport:
    import os
    return FrontendReport(os.getpid(), tuple(sorted(os.sched_getaffinity(0))))
