"""ASGI middleware: request ids and access logs, head- and body-size caps, API keys.

Pure ASGI (not BaseHTTPMiddleware) so request bodies stream through untouched and a
client disconnect is not turned into an exception.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from embedserve.contracts.errors import error_body
from embedserve.gateway.errors import head_too_large
from embedserve.gateway.request_scope import AnsweredElsewhere, internal_error
from embedserve.gateway.trim import LARGE_BODY_BYTES
from embedserve.logs import request_id_var

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
#: told of each request a middleware answers itself (a route never sees it), with its status
Refused = Callable[[Scope, int], None]


def _ignore(scope: Scope, status: int) -> None:
    pass

log = logging.getLogger("embedserve.access")
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


async def _send_error(
    send: Send,
    status: int,
    message: str,
    code: str | None,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = error_body(status, message, None, code)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra_headers or [])})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return bytes(value)
    return None


#: Paths probes and scrapers poll; their lines only with ``log_access=all``.
PROBE_PATHS = ("/health", "/metrics")


def access_level(mode: str, path: str, status: int, warming: bool) -> int | None:
    """The level of a request's access line, or None for no line. ``all``: every request.
    ``errors``: requests answered 4xx or 5xx, except what a healthy service answers by design
    and /metrics already counts (429 at capacity, 503 while it is warming up) and probes; so a
    client polling a starting stack, or a load balancer's health checks, write nothing."""
    level = logging.WARNING if status >= 500 else logging.INFO
    if mode == "all":
        return level
    if status < 400 or status == 429 or (status == 503 and warming) or path.startswith(PROBE_PATHS):
        return None
    return level


class RequestContextMiddleware:
    """A request id on every response and log line; an access line per request as
    ``log_access`` says (``access_level``). A route's handler ends in ``answered``
    (request_scope.py); what another route (health, the framework's own) lets escape is answered
    here the same way, while the request id is still set."""

    def __init__(
        self, app: ASGIApp, access: str = "errors", warming: Callable[[], bool] = lambda: False
    ) -> None:
        """``warming``: true while the stack answers 503 ``warming_up``."""
        self.app = app
        self.access = access
        self.warming = warming

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = (_header(scope, b"x-request-id") or b"").decode("latin-1")
        rid = given if _SAFE_ID.match(given) else uuid.uuid4().hex
        token = request_id_var.set(rid)
        start = time.perf_counter()
        status = 500
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            response = internal_error(Request(scope), exc)
            if started:  # too late for an answer: the server closes the connection
                raise
            await response(scope, receive, send_with_id)
        finally:
            path = scope.get("path", "")
            level = access_level(self.access, path, status, status == 503 and self.warming())
            if level is not None:
                log.log(
                    level,
                    "request",
                    extra={
                        "method": scope.get("method"),
                        "path": path,
                        "status": status,
                        "duration_ms": round((time.perf_counter() - start) * 1000, 2),
                    },
                )
            request_id_var.reset(token)


class HeadLimitMiddleware:
    """431 in the OpenAI envelope for a request head (URL and headers) over ``max_bytes``.
    The HTTP parser's own cap (service/http_server.py) counts whole reads of 64-256 KiB,
    so the exact limit is enforced here."""

    def __init__(self, app: ASGIApp, max_bytes: int, refused: Refused = _ignore) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.refused = refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
            size += sum(len(k) + len(v) + 4 for k, v in scope.get("headers", []))
            if size > self.max_bytes:
                err = head_too_large(self.max_bytes)
                self.refused(scope, err.status)
                await _send_error(send, err.status, err.message, err.code)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for bodies over the cap, by Content-Length or by counting a streamed body;
    ``after_large_body`` once a request whose body had ``large_bytes`` or more is answered."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        after_large_body: Callable[[], None] | None = None,
        large_bytes: int = LARGE_BODY_BYTES,
        refused: Refused = _ignore,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.after_large_body = after_large_body
        self.large_bytes = large_bytes
        self.refused = refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        too_big = f"Request body exceeds the limit of {self.max_bytes} bytes"
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            self.refused(scope, 413)
            await _send_error(send, 413, too_big, "request_too_large")
            return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                self.refused(scope, 413)
                await _send_error(send, 413, too_big, "request_too_large")
        finally:
            if seen >= self.large_bytes and self.after_large_body is not None:
                self.after_large_body()


class _BodyTooLarge(AnsweredElsewhere):
    pass


class ApiKeyMiddleware:
    """Bearer keys, compared in constant time. Health and metrics are protected only when
    configured, so Kubernetes probes and Prometheus work without a key."""

    def __init__(
        self, app: ASGIApp, keys: list[str], protected_prefixes: tuple[str, ...], refused: Refused = _ignore
    ) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.prefixes = protected_prefixes
        self.refused = refused

    def _allowed(self, scope: Scope) -> bool:
        auth = _header(scope, b"authorization") or b""
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return False
        ok = False
        for key in self.keys:  # no early exit: timing does not tell which key matched
            ok |= hmac.compare_digest(key, token.strip())
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        protected = scope["type"] == "http" and self.keys and path.startswith(self.prefixes)
        if protected and not self._allowed(scope):
            self.refused(scope, 401)
            await _send_error(
                send,
                401,
                "Invalid or missing API key (Authorization: Bearer <key>)",
                "invalid_api_key",
                [(b"www-authenticate", b"Bearer")],
            )
            return
        await self.app(scope, receive, send)


class RouteFastPath:
    """Hands one hot route straight to its handler, past FastAPI's router, dependency solver
    and inner exception layers: about a fifth of the event loop's work per short request,
    and the event loop is what one gateway runs out of first (python -m bench.cpu.gateway_cpu).
    Innermost of our middlewares, so ids, size caps, keys and the outer error handler still
    apply; every other method or path goes on to FastAPI unchanged."""

    def __init__(
        self, app: ASGIApp, method: str, path: str, handler: Callable[[Request], Awaitable[Response]]
    ) -> None:
        self.app = app
        self.method = method
        self.path = path
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == self.path and scope["method"] == self.method:
            response = await self.handler(Request(scope, receive))
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
