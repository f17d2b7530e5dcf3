"""Every error the server returns, in OpenAI's shape {"error": {message, type, param, code}}, and the handlers that
turn framework errors (pydantic validation, unknown routes, bugs) into that shape."""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from engine.errors import RequestError

log = logging.getLogger("engine.server")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
         500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(json.dumps(self.body()), self.status, self.headers, media_type="application/json")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, retry_after: int | None = None) -> APIError:
    return APIError(503, message, headers={"Retry-After": str(retry_after)} if retry_after else None)


def from_request_error(e: RequestError) -> APIError:
    """The engine's request errors carry the OpenAI parameter and code as data."""
    return APIError(400, e.message, param=e.param, code=e.code)


def _field_path(loc) -> list[str]:
    """pydantic's error location as the user wrote the body: field names and list indices, without the union
    member tags it inserts ("function-after[_utf8(), str]", "list[int]", "str")."""
    out = []
    for part in loc:
        if isinstance(part, int):
            out.append(str(part))
        elif part != "body" and part.isidentifier() and part not in _TYPE_TAGS:
            out.append(part)
    return out


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "tuple", "literal"})
# In a union every member reports; the member the value was meant for failed a check of ours or a constraint,
# the others only say "should be a valid list": those are shown only when nothing else is wrong.
_MISMATCH = ("_type", "union_tag_invalid", "literal_error")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    meant = [e for e in errors if not str(e.get("type", "")).endswith(_MISMATCH)]
    errors = meant or errors  # a real complaint makes the other union members' "not a list" noise
    parts, param, seen = [], None, set()
    for err in errors:
        if err.get("type") == "json_invalid":
            return f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", None
        loc = _field_path(err.get("loc", ()))
        if not loc and err.get("loc", ()) in ((), ("body",)):  # the body as a whole: not JSON, or not an object
            return f"request body must be a JSON object (Content-Type: application/json): {err.get('msg')}", None
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        line = f"{'.'.join(loc)}: {msg}" if loc else msg
        if line not in seen:
            seen.add(line)
            parts.append(line)
        param = param or (loc[0] if loc else None)
        if len(parts) == 3:
            break
    return "; ".join(parts) or "invalid request", param


def install(app: FastAPI) -> None:
    """FastAPI answers validation errors with 422 and its own shape; OpenAI clients expect 400 and this shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(exc)
        return bad_request(message, param).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> Response:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}").response()
