"""Where every request ends. ``answered`` wraps each route's handler: whatever the handler does,
the client gets our envelope (500 included), the route's metrics see the status, the reply keeps
its x-request-id (``RequestContextMiddleware`` adds it to whatever reaches it) and a traceback's
log line keeps the request id (logged here, while the id is set). ``unless_gone`` runs a request's
work so that it ends with the request: when the client leaves, or the handler itself is cancelled
(shutdown, an outer timeout), the work is cancelled and has released what it holds (admission
tokens, queued inputs, the engine call) before the handler goes on."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response

from embedserve.gateway.errors import APIError, error_response
from embedserve.gateway.metrics import GatewayMetrics
from embedserve.http_server import wait_disconnect
from embedserve.logs import request_id_var

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]
#: what a route counts once it has answered: the status and the seconds it took
Observe = Callable[[int, float], None]
T = TypeVar("T")

#: not HTTP's: what the access log and the metrics say of a request whose client left
CLIENT_GONE = 499


class ClientGone(Exception):
    """The client left before its answer was ready (mid-upload or while its work ran)."""


class AnsweredElsewhere(Exception):
    """Raised through a handler by the middleware that answers the request itself (a body
    over the cap, found while the handler reads it): it passes ``answered`` untouched."""


def internal_error(request: Request, exc: BaseException) -> Response:
    """A failure nobody mapped to a status: its traceback logged under the request id, which the
    client's 500 names too."""
    log.error("request failed", exc_info=exc, extra={"method": request.method, "path": request.url.path})
    rid = request_id_var.get()
    where = f" (request id {rid})" if rid else ""
    return error_response(
        APIError(500, f"Internal error{where}; its traceback is in the gateway's log", code="internal_error")
    )


def answered(handler: Handler, observe: Observe | None = None) -> Handler:
    """``handler`` ending in a response whatever happens in it, counted by ``observe``."""

    async def answer(request: Request) -> Response:
        start = time.perf_counter()
        try:
            response = await handler(request)
        except APIError as err:
            response = error_response(err)
        except ClientGone:
            response = Response(status_code=CLIENT_GONE)
        except AnsweredElsewhere:
            raise
        except Exception as exc:
            response = internal_error(request, exc)
        if observe is not None:
            observe(response.status_code, time.perf_counter() - start)
        return response

    return answer


async def unless_gone(request: Request, work: Awaitable[T], metrics: GatewayMetrics) -> T:
    """``work``'s result, or ``ClientGone`` as soon as the client leaves. Whoever stops waiting
    first (the client, or the caller's own cancellation, which propagates), the work is
    cancelled and has ended before this returns or raises."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        gone = not task.done()
        if gone:
            task.cancel()
            await asyncio.wait({task})  # its own cleanup: admission released, inputs dropped
            if not task.cancelled():
                task.exception()  # retrieved: nobody is left to answer with it
    if gone:
        metrics.client_disconnects.inc()
        raise ClientGone
    return task.result()
