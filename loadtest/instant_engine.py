"""An engine that answers instantly with fixed vectors: raw ASGI, no framework, so that a
benchmark of the gateway measures the gateway. ``python -m embedserve.loadtest.instant_engine PORT [DIM]``
(DIM 384 by default; 2560 answers like the 4B)."""

from __future__ import annotations

import functools
import sys
from typing import Any

import numpy as np
import orjson

from embedserve.contracts.wire import encode_response

DIM = int(sys.argv[2]) if __name__ == "__main__" and len(sys.argv) > 2 else 384


@functools.lru_cache(maxsize=4096)
def reply(n: int, as_base64: bool = False) -> bytes:
    """The same answer for every call of ``n`` inputs, built once."""
    return encode_response("instant", np.full((n, DIM), 0.05, dtype=np.float32), n, as_base64)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/health":
        out = b""
    else:
        req = orjson.loads(body)
        out = reply(len(req["input"]), req.get("encoding_format") == "base64")
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": out})


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
