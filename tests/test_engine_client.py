"""The gateway's aiohttp engine client against real sockets: an answer, a refused connection
and a server that never answers map to (status, body), CallFailed and CallTimeout."""

from __future__ import annotations

import asyncio
import socket

import pytest

from embedserve.upstream.client import AiohttpEngineClient, CallFailed, CallTimeout

ANSWER = b'{"data": []}'


async def _serve(handler: object) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)  # type: ignore[arg-type]
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (int(ln.split(b":")[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")), 0
    )
    await reader.readexactly(length)
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (len(ANSWER), ANSWER)
    )
    await writer.drain()
    writer.close()


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(30)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_answer_refused_and_silent_engines() -> None:
    async def main() -> None:
        client = AiohttpEngineClient(read_timeout_s=0.5)
        ok_server, ok_url = await _serve(_answer)
        silent_server, silent_url = await _serve(_silent)
        try:
            assert await client.post_json(ok_url + "/v1/embeddings", b"{}") == (200, ANSWER)
            with pytest.raises(CallFailed):
                await client.post_json(f"http://127.0.0.1:{_closed_port()}/v1/embeddings", b"{}")
            with pytest.raises(CallTimeout):
                await client.post_json(silent_url + "/v1/embeddings", b"{}")
            with pytest.raises(CallTimeout):
                await client.get(silent_url + "/health", 0.3)
            with pytest.raises(CallFailed):
                await client.get(f"http://127.0.0.1:{_closed_port()}/health", 1.0)
        finally:
            await client.aclose()
            ok_server.close()
            silent_server.close()

    asyncio.run(main())
