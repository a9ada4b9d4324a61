"""Slow clients are cut off: a request head must arrive within ``gateway.header_timeout_s``,
a body may stall at most ``gateway.body_idle_timeout_s`` and must keep a minimum rate, and
both end in 408 in the OpenAI envelope. A client that sends at a fair pace is never cut.

Real sockets on loopback against production's HTTP protocol (uvicorn with the bounded
httptools parser, in a thread) over a fake engine. Every trickle is a bounded loop: the test
asserts the server closed the connection before the client finished, not a duration."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from embedserve.config import Settings
from embedserve.gateway.app import create_app
from embedserve.http_server import MIN_BODY_BYTES_PER_S, bounded_httptools
from tests.conftest import free_port, metric, wait_until
from tests.fake_engine import FakeEngine, HttpxEngineClient

MODEL = "all-MiniLM-L6-v2"
LIMIT_S = 1.0  # both clocks, short so the test is quick; the defaults are 20 s


@dataclass
class Server:
    host: str
    port: int
    url: str


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    settings = Settings(
        engine={"kind": "external", "urls": ["http://fake-engine"]},
        gateway={"header_timeout_s": LIMIT_S, "body_idle_timeout_s": LIMIT_S},
        health={"sample_interval_s": 60},
        _env_file=None,
    )
    app = create_app(settings, engine_client=HttpxEngineClient(httpx.ASGITransport(app=FakeEngine().app())))
    g = settings.gateway
    port = free_port()
    protocol = bounded_httptools(g.max_head_bytes, g.header_timeout_s, g.body_idle_timeout_s)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, http=protocol))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    wait_until(lambda: srv.started and app.state.pool.any_ready, timeout=10, interval=0.02)
    yield Server("127.0.0.1", port, f"http://127.0.0.1:{port}")
    srv.should_exit = True
    thread.join(10)


BODY = json.dumps({"model": MODEL, "input": "hello"}).encode()
HEAD = (
    b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n" % len(BODY)
)


def _closed(sock: socket.socket) -> bytes | None:
    """What the server sent if it has closed the connection, else None (still open)."""
    sock.setblocking(False)
    try:
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data
    except BlockingIOError:
        return data or None
    finally:
        sock.setblocking(True)


def _trickle(server: Server, pieces: list[bytes], pause_s: float) -> tuple[int, bytes | None]:
    """Send ``pieces`` one per ``pause_s``; stop when the server closes. Returns how many
    pieces went out and what the server answered (None: it never closed)."""
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        for sent, piece in enumerate(pieces):
            answer = _closed(sock)
            if answer is not None:
                return sent, answer
            try:
                sock.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                return sent, b""
            time.sleep(pause_s)
        sock.settimeout(3 * LIMIT_S)
        try:
            return len(pieces), sock.recv(65536)
        except TimeoutError:
            return len(pieces), None


def _assert_408(answer: bytes | None) -> None:
    assert answer is not None, "the server never closed the connection"
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:200]
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_a_head_sent_one_header_at_a_time_is_cut_off(server: Server) -> None:
    lines = [b"GET /v1/models HTTP/1.1\r\n"] + [b"X-Slow-%d: y\r\n" % i for i in range(40)] + [b"\r\n"]
    sent, answer = _trickle(server, lines, LIMIT_S / 5)  # 10 lines a limit: 40 take 8 limits
    _assert_408(answer)
    assert sent < len(lines) // 2


def _read_to_end(sock: socket.socket) -> bytes:
    """Everything the server sends until its orderly close (a reset raises)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_client_still_sending_when_cut_off_reads_the_408(server: Server) -> None:
    """A client that writes its whole request before it reads (as most do) can still be
    sending when its head runs out of time. The server half-closes after the 408 and reads on
    for a moment, so those late bytes are taken and the client reads the answer and an
    orderly end, not a reset (sending into a closed connection gets one)."""
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\n")
        lines, late = 0, -1
        while late < 5:  # header lines 10 ms apart, and five more once the answer is in
            sock.sendall(b"X-Slow-%d: y\r\n" % lines)
            lines += 1
            assert lines < 5 * LIMIT_S / 0.01, "the server never answered"
            if late >= 0 or select.select([sock], [], [], 0.01)[0]:
                late += 1
                time.sleep(0.01)
        _assert_408(_read_to_end(sock))


def test_a_head_over_the_cap_in_one_write_reads_the_431(server: Server) -> None:
    """The server answers 431 after the first read past the cap, with most of a 1 MB head
    still unread in the socket: it reads on and discards it, so the client's write completes
    and the client reads the 431 (closing on unread bytes would reset the connection)."""
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 2**20 + b"\r\n\r\n"
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(head)
        answer = _read_to_end(sock)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_header_fields_too_large"


def test_a_connection_that_sends_nothing_is_closed(server: Server) -> None:
    with socket.create_connection((server.host, server.port), timeout=10 * LIMIT_S) as sock:
        answer = sock.recv(65536)
    _assert_408(answer)


def test_a_stalled_body_is_cut_off(server: Server) -> None:
    sent, answer = _trickle(server, [HEAD + BODY[:5], b"", b"", b"", b"", b"", b""], LIMIT_S)
    _assert_408(answer)
    assert sent < 7


def test_a_body_trickled_a_byte_at_a_time_is_cut_off(server: Server) -> None:
    """Never idle for a whole limit, but far below the minimum rate."""
    assert MIN_BODY_BYTES_PER_S * LIMIT_S > 50
    pieces = [HEAD] + [BODY[i : i + 1] for i in range(len(BODY))]
    sent, answer = _trickle(server, pieces, LIMIT_S / 5)
    _assert_408(answer)
    assert sent < len(pieces)
    # the app saw a client that left: counted, not an error
    left = "embedserve_client_disconnects_total"
    wait_until(lambda: metric(httpx.get(server.url + "/metrics").text, left) >= 1)


def test_a_fair_client_is_not_cut(server: Server) -> None:
    """A body in pieces a little under a limit apart, and a keep-alive connection idle for
    longer than both limits, are served."""
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        for _ in range(2):
            sock.sendall(HEAD + BODY[:10])
            time.sleep(LIMIT_S * 0.6)
            sock.sendall(BODY[10:])
            answer = b""
            while b'"usage"' not in answer:
                chunk = sock.recv(65536)
                assert chunk, f"closed: {answer[:200]!r}"
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
            time.sleep(LIMIT_S * 1.5)  # idle between requests: keep-alive's business, not these clocks
