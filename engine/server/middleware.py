"""ASGI gate in front of every route: API-key check and request-body size cap, answered in OpenAI's error shape
before FastAPI parses anything."""
from __future__ import annotations

import hmac

from engine.server.errors import APIError

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})  # probes and scrapers carry no key
# An early error response on a connection whose body is still arriving makes many clients see a reset instead
# of the status; up to this much is read and discarded first. Beyond it the connection is simply closed.
DRAIN_LIMIT = 64 << 20


class Gate:
    def __init__(self, app, *, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_body = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.key is not None and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            err = APIError(401, "invalid or missing API key; send it as 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await self._reject(err, scope, receive, send, drain=True, limit=self.max_body)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            # A client waiting for "100 Continue" has not sent the body: answer without asking for it.
            waiting = any(k == b"expect" and v.lower() == b"100-continue" for k, v in scope["headers"])
            await self._reject(self._too_large(), scope, receive, send,
                               drain=not waiting and length.isdigit() and int(length) <= DRAIN_LIMIT)
            return
        chunks, size, more = [], 0, True
        while more:  # buffer the body (bounded) so a chunked upload cannot exceed the cap either
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            more = msg.get("more_body", False)
            if size > self.max_body:
                await self._reject(self._too_large(), scope, receive, send, drain=more)
                return
            chunks.append(chunk)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # afterwards: http.disconnect, which streaming responses listen for

        await self.app(scope, replay, send)

    def _authorized(self, scope) -> bool:
        auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = auth.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    def _too_large(self) -> APIError:
        return APIError(413, f"request body is larger than the limit of {self.max_body} bytes",
                        code="request_too_large")

    @staticmethod
    async def _reject(err: APIError, scope, receive, send, *, drain: bool, limit: int = DRAIN_LIMIT) -> None:
        seen = 0
        while drain and seen <= limit:
            msg = await receive()
            if msg["type"] != "http.request":
                break
            seen += len(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        await err.response()(scope, receive, send)
