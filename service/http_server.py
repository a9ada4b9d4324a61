"""uvicorn's httptools protocol with bounded reads: a cap on the request head, and clocks on
how long a client may take to send its head and its body.

httptools (llhttp) parses HTTP in C: about 13% less gateway CPU per short request than h11
(measured with ``python -m bench.cpu.gateway_cpu``), and one gateway's event loop is its
throughput limit. But neither httptools nor uvicorn bounds a request while it arrives:

* no head-size limit (a 100 MB header was buffered whole), so this counts the bytes fed
  while a head is unfinished and answers 431 in the OpenAI envelope once they pass the cap:
  at most the cap plus one read (64-256 KiB) is ever buffered. ``gateway.max_head_bytes``
  (checked exactly by HeadLimitMiddleware) stays the precise limit; this is the backstop;
* no time limit: uvicorn's only timer is the keep-alive between requests, so a client that
  trickles its head or body a byte at a time holds a connection for as long as it likes.
  Here a head must be complete within ``header_timeout_s`` of its first byte (of the
  connection, for the first request), and a body may stall at most ``body_idle_timeout_s``
  and must average at least ``MIN_BODY_BYTES_PER_S`` beyond that allowance (Apache's
  mod_reqtimeout rule), so a one-byte-a-second trickle is cut too. Expiry answers 408 in
  the envelope and closes the connection. While uvicorn has paused reading (the app has not
  taken the body yet), the client is not the slow one and the body clocks wait.

Both refusals end in a lingering close (``_close_with``): the client may still be sending.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import uvicorn
from starlette.requests import Request
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from embedserve.contracts.errors import (
    HEAD_TOO_LARGE,
    REQUEST_TIMEOUT,
    error_body,
    head_too_large_message,
    request_timeout_message,
)

log = logging.getLogger(__name__)

#: A body slower than this on average (beyond its first body_idle_timeout_s) is cut off:
#: Apache's mod_reqtimeout default MinRate.
MIN_BODY_BYTES_PER_S = 500.0

#: After a 408 or 431 the connection is half-closed and what the client still sends is read
#: and dropped until it closes its side, for at most this long (nginx's lingering close).
LINGER_S = 2.0


def bounded_httptools(
    max_head_bytes: int, header_timeout_s: float = 20.0, body_idle_timeout_s: float = 20.0
) -> type[HttpToolsProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)``."""

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_bytes = 0
            self._in_head = True
            self._phase: str | None = None  # "head", "body" or None (nothing owed by the client)
            self._deadline = 0.0  # head: its end; body: the rate allowance's end
            self._idle_until = 0.0  # body: the end of the current stall allowance
            self._timer: asyncio.TimerHandle | None = None
            self._lingering = False  # answered with an error: reading only to close cleanly
            self._linger_timer: asyncio.TimerHandle | None = None

        # -- the clocks --------------------------------------------------------------
        def _arm(self, at: float) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_at(at, self._expire)

        def _disarm(self) -> None:
            self._phase = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _start_head(self) -> None:
            self._phase = "head"
            self._deadline = self.loop.time() + header_timeout_s
            self._arm(self._deadline)

        def _expire(self) -> None:
            self._timer = None
            now = self.loop.time()
            if self.transport is None or self.transport.is_closing() or self._phase is None:
                return
            cycle = self.cycle
            if self._phase == "head":
                if cycle is not None and not cycle.response_complete:
                    self._arm(now + header_timeout_s)  # a pipelined head waits for the answer before it
                    return
                self._cut("head", header_timeout_s)
                return
            if self.flow.read_paused:  # uvicorn holds the client back, not the other way round
                self._idle_until = now + body_idle_timeout_s
                self._deadline += body_idle_timeout_s
            due = min(self._idle_until, self._deadline)
            if now < due:
                self._arm(due)
                return
            self._cut("body", body_idle_timeout_s)

        def _cut(self, part: str, seconds: float) -> None:
            log.info("slow client cut off", extra={"part": part, "limit_s": seconds})
            body = error_body(408, request_timeout_message(part, seconds), code=REQUEST_TIMEOUT)
            self._close_with(b"408 Request Timeout", body)
            self._disarm()

        def _close_with(self, status: bytes, body: bytes) -> None:
            """Answers ``status`` and ends the connection with a lingering close: the write side
            is shut (FIN after the answer), then what the client still sends is read and dropped
            until it closes its side, for at most ``LINGER_S``. Closing a socket that holds
            unread bytes, or that the client still writes to, makes the kernel reset the
            connection, and the reset can reach the client before it has read the answer: it
            sees "connection reset", not the 408 or 431."""
            head = (
                b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            )
            transport = self.transport
            transport.write(head + body)
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True  # the app sees a client that left (a counted disconnect)
                cycle.message_event.set()  # and writes nothing more, as after connection_lost
            if not transport.can_write_eof():  # no half-close (TLS): a plain close
                transport.close()
                return
            self._lingering = True
            transport.write_eof()
            self.flow.resume_reading()
            # abort, not close: a client that reads nothing would keep close() waiting to flush
            self._linger_timer = self.loop.call_later(LINGER_S, transport.abort)

        # -- uvicorn's protocol, with the clocks and the head cap ---------------------
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._start_head()  # a new connection owes its first request head

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._linger_timer is not None:
                self._linger_timer.cancel()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._phase is None:  # the first byte of the next request on this connection
                self._start_head()

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()
            now = self.loop.time()
            self._phase = "body"
            self._idle_until = self._deadline = now + body_idle_timeout_s
            self._arm(self._deadline)

        def on_body(self, body: bytes) -> None:
            super().on_body(body)
            self._idle_until = self.loop.time() + body_idle_timeout_s
            self._deadline += len(body) / MIN_BODY_BYTES_PER_S

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head, self._head_bytes = True, 0
            self._disarm()  # until the next request's first byte (uvicorn's keep-alive meanwhile)

        def data_received(self, data: bytes) -> None:
            if self._lingering:
                return  # dropped; the client's EOF (uvicorn's eof_received) closes the connection
            if self._in_head:
                if self._head_bytes > max_head_bytes:
                    return  # already refused; the transport is closing
                self._head_bytes += len(data)
            super().data_received(data)
            if self._in_head and self._head_bytes > max_head_bytes and not self.transport.is_closing():
                self._refuse()

        def _refuse(self) -> None:
            body = error_body(431, head_too_large_message(max_head_bytes), code=HEAD_TOO_LARGE)
            self._close_with(b"431 Request Header Fields Too Large", body)
            self._disarm()

        def shutdown(self) -> None:
            if self._lingering:  # a stopping server waits for no client
                self.transport.close()
            else:
                super().shutdown()

    return BoundedHttpToolsProtocol


class QuietServer(uvicorn.Server):
    """uvicorn without its "running on" line: the stack prints its own URL once it can
    answer, and an engine's port is no URL for a user."""

    def _log_started_message(self, listeners: Any) -> None:
        pass


async def wait_disconnect(request: Request) -> None:
    """Returns when the client has gone (read after the body: only a disconnect is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
