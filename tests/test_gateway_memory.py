"""The gateway's memory after large requests: tokenised in bounded groups, and given back to the
system afterwards (glibc kept what a 13 MiB body took, so an idle gateway stayed at its peak)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from embedserve.config import BUNDLED_MODEL, resolve_model_path
from embedserve.core import tokenize
from embedserve.core.tokenize import ModelTokenizer
from embedserve.gateway.trim import LARGE_BODY_BYTES, MemoryTrimmer, glibc_malloc_trim
from tests.conftest import wait_until
from tests.fake_engine import FakeEngine
from tests.test_gateway_unit import MODEL, make_client, wait_ready


def test_a_large_body_is_followed_by_a_trim_and_small_ones_are_not() -> None:
    calls: list[str] = []
    with make_client(FakeEngine()) as c:
        wait_ready(c)
        c.app.state.trimmer.trim = lambda: calls.append(threading.current_thread().name)  # type: ignore[attr-defined]
        for _ in range(3):
            assert c.post("/v1/embeddings", json={"model": MODEL, "input": "hello"}).status_code == 200
        large = b'{"model": "%s", "input": "hello"}' % MODEL.encode() + b" " * LARGE_BODY_BYTES
        r = c.post("/v1/embeddings", content=large, headers={"content-type": "application/json"})
        assert r.status_code == 200
        wait_until(lambda: calls, timeout=10)
    assert len(calls) == 1 and calls[0] != threading.main_thread().name  # off the event loop


def test_trims_come_at_most_once_an_interval_and_after_the_last_large_request() -> None:
    now = [100.0]
    calls: list[float] = []
    trimmer = MemoryTrimmer(lambda: calls.append(now[0]), min_interval_s=0.05, clock=lambda: now[0])

    async def scenario() -> None:
        trimmer.request_done()
        trimmer.request_done()  # one pending at most
        await asyncio.sleep(0.01)
        assert trimmer.trims == 1
        trimmer.request_done()  # within the interval of the last: later, not now
        await asyncio.sleep(0.01)
        assert trimmer.trims == 1
        now[0] += 0.05
        await asyncio.sleep(0.1)
        assert trimmer.trims == 2

    asyncio.run(scenario())
    assert len(calls) == 2


def test_the_c_library_trim_is_found_on_linux() -> None:
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc_trim")
    trim = glibc_malloc_trim()
    assert trim is not None
    trim()


def test_texts_are_tokenised_in_groups_with_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = ModelTokenizer(resolve_model_path(BUNDLED_MODEL), 64)
    texts = ["alpha beta gamma " * n for n in (1, 40, 3, 90, 2, 2, 2)]
    want = [tok.encode_texts([t])[0] for t in texts]
    sizes: list[int] = []
    real = tok.unknowns._tok

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def encode_batch_fast(self, group: list[str], **kw: Any) -> Any:
            sizes.append(sum(map(len, group)))
            return real.encode_batch_fast(group, **kw)

    monkeypatch.setattr(tok.unknowns, "_tok", Spy())
    monkeypatch.setattr(tokenize, "GROUP_CHARS", 1000)
    assert tok.encode_texts(texts) == want
    assert len(sizes) > 1 and sum(sizes) == sum(map(len, texts))
    assert all(s <= 1000 for s in sizes if s != len("alpha beta gamma " * 90))
