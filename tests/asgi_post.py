"""A POST handed to an ASGI app directly, from a client that sends its body and then stays, so a
test can cancel the app's task as a server that stops (or an outer timeout) would."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]


async def post_and_stay(app: App, path: str, body: bytes) -> None:
    scope = {
        "type": "http", "http_version": "1.1", "method": "POST", "path": path, "raw_path": path.encode(),
        "query_string": b"", "scheme": "http", "root_path": "", "server": ("testserver", 80),
        "client": ("127.0.0.1", 1), "headers": [],
    }
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client never leaves
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        pass

    await app(scope, receive, send)
