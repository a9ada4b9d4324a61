"""An engine that answers instantly with fixed vectors (``/v1/embeddings``) or scores (a
reranker's ``/encode``): raw ASGI, no framework, so that a benchmark of the gateway measures the
gateway. ``python -m embedserve.loadtest.instant_engine PORT [DIM]`` (DIM 384 by default; 2560
answers like the 4B)."""

from __future__ import annotations

import functools
import sys
from collections.abc import MutableMapping
from typing import Any

import numpy as np
import orjson

from embedserve.contracts import score_wire
from embedserve.contracts.wire import encode_response

DIM = int(sys.argv[2]) if __name__ == "__main__" and len(sys.argv) > 2 else 384


@functools.lru_cache(maxsize=4096)
def reply(n: int, as_base64: bool = False) -> bytes:
    """The same answer for every call of ``n`` inputs, built once."""
    return encode_response("instant", np.full((n, DIM), 0.05, dtype=np.float32), n, as_base64)


async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    status = 200
    if scope["path"] == "/health":
        out = b""
    elif scope["method"] == "GET":  # /get_model_info among them: the gateway takes SGLang's defaults
        status, out = 404, b""
    elif scope["path"] == "/encode":  # each pair's score: its token count, so rows stay distinct
        pairs = score_wire.EncodeRequest.model_validate_json(body)
        lengths = [len(ids) for ids in pairs.batch()]
        out = score_wire.encode_response([n / 1000 for n in lengths], lengths, pairs.single)
    else:
        req = orjson.loads(body)
        out = reply(len(req["input"]), req.get("encoding_format") == "base64")
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": out})


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
