"""The gate in front of the API routes (/v1/*, /tokenize, /detokenize): pure ASGI middleware that
refuses, before a body is parsed, what must not reach a handler: draining (503), a missing or wrong
API key (401), a body over the size limit (413, checked against Content-Length and again while a
chunked body streams in). /health, /metrics and the playground stay open."""
from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from draftwise.entrypoints.openai.errors import APIError, error_response

if TYPE_CHECKING:
    from draftwise.entrypoints.openai.routes import ServerState


_GATED = ("/tokenize", "/detokenize")       # vLLM serves these beside /v1; same key, limits and drain


class Gate:
    """Pure ASGI middleware for /v1/*: draining (503), the API key (401), the request-size limit
    (413, checked against Content-Length and again while a chunked body streams in) and overload
    (429 with Retry-After); /health and /metrics stay open."""

    def __init__(self, app, state: "ServerState"):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/") or path in _GATED):
            st = self.state
            err = None
            if st.draining:
                err, outcome = APIError("the server is shutting down", 503, type="server_error",
                                        code="shutting_down"), "unavailable"
            elif st.api_key is not None and not _auth_ok(scope, st.api_key):
                err, outcome = APIError("Incorrect or missing API key: send 'Authorization: Bearer KEY'.",
                                        401, code="invalid_api_key"), "unauthorized"
            elif _content_length(scope) > st.max_request_bytes:
                err, outcome = _too_large(st.max_request_bytes), "too_large"
            if err is not None:
                await _refuse(st, err, outcome, scope, receive, send)
                return
            if scope["method"] == "POST" and not _has_content_length(scope):
                # a chunked body: read it here, up to the limit, then replay it to the app
                body = await _read_body(receive, st.max_request_bytes)
                if body is None:
                    await _refuse(st, _too_large(st.max_request_bytes), "too_large", scope, receive, send)
                    return
                receive = _replay(body, receive)
        await self.app(scope, receive, send)


def _too_large(limit: int) -> APIError:
    return APIError(f"the request body is larger than this server's limit of {limit} bytes "
                    "(--max-request-bytes)", 413, code="request_too_large")


async def _refuse(st: "ServerState", err: APIError, outcome: str, scope, receive, send) -> None:
    st.metrics.requests.labels(outcome=outcome).inc()
    resp = error_response(err)
    if err.status == 401:
        resp.headers["WWW-Authenticate"] = "Bearer"
    await resp(scope, receive, send)


def _content_length(scope) -> int:
    for k, v in scope.get("headers", ()):
        if k == b"content-length":
            try:
                return int(v)
            except ValueError:
                return 0
    return 0


def _has_content_length(scope) -> bool:
    return any(k == b"content-length" for k, _ in scope.get("headers", ()))


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole request body, or None as soon as it passes `limit` bytes."""
    parts, seen = [], 0
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return b"".join(parts)
        chunk = msg.get("body", b"")
        seen += len(chunk)
        if seen > limit:
            return None
        parts.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(parts)


def _replay(body: bytes, receive):
    """`receive` that first yields `body` in one message, then defers to the real one (disconnects)."""
    sent = False

    async def wrapped():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return wrapped


def _auth_ok(scope, api_key: str) -> bool:
    for k, v in scope.get("headers", ()):
        if k == b"authorization":
            val = v.decode("latin-1").strip()
            if val[:7].lower() == "bearer ":
                return hmac.compare_digest(val[7:].strip().encode(), api_key.encode())
            return False
    return False
