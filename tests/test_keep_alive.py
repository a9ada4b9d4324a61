"""Idle keep-alive connections outlive the clients' own pool timeouts.

uvicorn closes an idle connection after 5 s by default: exactly httpx's (and so the OpenAI
SDK's) pool expiry and under aiohttp's 15 s, so a client could send on a connection the
server was closing that instant and see the request dropped."""

from __future__ import annotations

import socket
import time

from tests.conftest import RunningStack

REQUEST = b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n"


def _answer(s: socket.socket) -> bytes:
    """One whole response (head and content-length body); b"" if the server closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        if not (chunk := s.recv(65536)):
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")).split(b":")[1]
    )
    while len(body) < length:
        body += s.recv(65536)
    return data


def test_idle_connection_is_kept_past_the_clients_pool_timeouts(minilm_stack: RunningStack) -> None:
    host, port = minilm_stack.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(REQUEST)
        assert _answer(s).startswith(b"HTTP/1.1 200")
        time.sleep(6.5)  # past uvicorn's default 5 s and httpx's 5 s expiry
        s.sendall(REQUEST)
        assert _answer(s).startswith(b"HTTP/1.1 200"), "the server closed an idle connection"
