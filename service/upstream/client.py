"""The two HTTP calls the gateway makes to an engine, behind a small interface so that
tests can put a fake engine in place of the network.

aiohttp, not httpx: its C parser makes each engine call about 0.7 ms cheaper. Against an
instant engine, one request in flight, the gateway's P50 went from 3.1 to 2.1 ms."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import aiohttp

from embedserve.core.tracing import engine_headers

JSON = {"content-type": "application/json"}


class CallTimeout(Exception):
    """The engine did not answer in time."""


class CallFailed(Exception):
    """The engine could not be reached, or the connection broke."""


class EngineClient(Protocol):
    async def post_json(self, url: str, body: bytes) -> tuple[int, bytes]:
        """Status and body of a POST; raises CallTimeout or CallFailed."""
        ...

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        """Status and body of a GET; raises CallTimeout or CallFailed."""
        ...

    async def aclose(self) -> None: ...


@contextlib.contextmanager
def _mapped_errors() -> Iterator[None]:
    try:
        yield
    except TimeoutError as exc:
        raise CallTimeout(type(exc).__name__) from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise CallFailed(type(exc).__name__) from exc


class AiohttpEngineClient:
    """One pooled session. Idle connections expire after 2 s, before the engine's server
    closes them (uvicorn's and SGLang's keep-alive is 5 s): reusing one the server is closing
    at that instant would fail the call and mark a healthy engine down."""

    def __init__(self, read_timeout_s: float, max_connections: int = 256) -> None:
        self._timeout = aiohttp.ClientTimeout(total=None, connect=read_timeout_s, sock_read=read_timeout_s)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=2.0),
            timeout=self._timeout,
        )

    async def post_json(self, url: str, body: bytes) -> tuple[int, bytes]:
        with _mapped_errors():
            traced = engine_headers.get()  # a traced request's traceparent
            headers = JSON if traced is None else JSON | traced
            async with self._session.post(url, data=body, headers=headers) as r:
                return r.status, await r.read()

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        with _mapped_errors():
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status, await r.read()

    async def aclose(self) -> None:
        await self._session.close()
