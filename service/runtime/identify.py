"""Engines elsewhere tell the gateway what they are, before it derives its limits.

The gateway's defaults follow its engines' kind (``Settings.gateway_limits``: one call of 512
tokens at a time and 32,768 tokens in flight in front of the CPU engine, 4 calls of the batch
budget and 262,144 in front of SGLang). ``up`` knows the kind of the engines it starts; in front
of engines elsewhere (``engine.urls``: compose's and Kubernetes' gateway containers) the gateway
asks them, ``GET /get_model_info`` (``contracts/wire.EngineInfo``), unless
``engine.external_kind`` already says.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import httpx
from pydantic import ValidationError

from embedserve.catalog import served_models
from embedserve.config import Settings
from embedserve.contracts.wire import EngineInfo
from embedserve.runtime.model_plan import resolve_engine_kind
from embedserve.runtime.supervisor import EngineStartError

log = logging.getLogger(__name__)

#: answers of an engine that is up but has no such endpoint: not ours, not SGLang
NO_INFO = (404, 405)


async def ask_engine_kind(
    urls: list[str],
    wait_s: float,
    poll_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    transport: httpx.AsyncBaseTransport | None = None,
) -> str:
    """What the first of ``urls`` to answer says it is (cpu or sglang); an engine without the
    endpoint counts as SGLang, as before engines said. ``EngineStartError`` when none answers
    within ``wait_s`` (0: one round)."""
    deadline = clock() + wait_s
    last = ""
    async with httpx.AsyncClient(timeout=5.0, transport=transport) as client:
        while True:
            for url in urls:
                try:
                    r = await client.get(url.rstrip("/") + "/get_model_info")
                except httpx.HTTPError as exc:
                    last = f"{url}: {type(exc).__name__}"
                    continue
                if r.status_code in NO_INFO:
                    log.warning("an engine does not say what it is: SGLang's defaults", extra={"url": url})
                    return "sglang"
                if r.status_code != 200:
                    last = f"{url}: HTTP {r.status_code}"
                    continue
                try:
                    return EngineInfo.model_validate_json(r.content).engine
                except ValidationError:
                    last = f"{url}: an answer that is not an engine's model info"
            if clock() >= deadline:
                raise EngineStartError(
                    f"no engine of EMBEDSERVE_ENGINE__URLS said what it is (GET /get_model_info) within "
                    f"{wait_s:g} s, last {last}; start the engines first, or set "
                    "EMBEDSERVE_ENGINE__EXTERNAL_KIND to cpu or sglang"
                )
            await asyncio.sleep(poll_s)


def _asks(settings: Settings) -> bool:
    e = settings.engine
    return bool(e.urls) and e.external_kind == "ask" and resolve_engine_kind(settings) == "external"


async def _told(settings: Settings, wait_s: float | None) -> str:
    urls = settings.engine.urls
    kind = await ask_engine_kind(urls, settings.engine.startup_timeout_s if wait_s is None else wait_s)
    log.info("engines elsewhere said what they are", extra={"urls": urls, "engine_kind": kind})
    return kind


async def identify_engines(settings: Settings, wait_s: float | None = None) -> Settings:
    """``settings`` with ``engine.external_kind`` as the engines elsewhere said, for each model
    served by engines it does not start (a model's own, in ``served.models``); ``wait_s``:
    how long to wait for an answer (default ``engine.startup_timeout_s``)."""
    if not settings.served.models:
        if not _asks(settings):
            return settings
        return settings.with_engine(external_kind=await _told(settings, wait_s))
    models = []
    for m, entry in zip(settings.served.models, served_models(settings), strict=True):
        if _asks(entry.settings):
            kind = await _told(entry.settings, wait_s)
            m = m.model_copy(update={"engine": {**m.engine, "external_kind": kind}})
        models.append(m)
    return settings.model_copy(update={"served": settings.served.model_copy(update={"models": models})})
