"""Admission control under a burst far above capacity (fake engine): the excess is answered
429 + Retry-After at once, every admitted request succeeds, nothing is 5xx, and the tokens
in flight return to zero. The real-stack figures are in results/overload-cpu/."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

from tests.conftest import metric, wait_until
from tests.fake_engine import FakeEngine
from tests.test_gateway_unit import make_client, wait_ready

MODEL = "all-MiniLM-L6-v2"


def test_burst_over_the_token_bound_gets_429_and_admitted_requests_succeed() -> None:
    gate = threading.Event()
    engine = FakeEngine(gate=gate)  # admitted work stays in the engine until the gate opens
    with make_client(engine, max_tokens_in_flight=40, request_timeout_s=60) as c:
        wait_ready(c)
        offered: list[int] = []
        c.app.state.load.offered = offered.append  # type: ignore[attr-defined]

        def call(i: int) -> Any:
            return c.post("/v1/embeddings", json={"model": MODEL, "input": [[i + 1] * 10]})

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            futures = [pool.submit(call, i) for i in range(32)]
            # 40 tokens in flight = 4 requests of 10: the other 28 are answered while those
            # 4 are still in the engine, so they were refused at once, not queued
            wait_until(lambda: sum(f.done() for f in futures) >= 28, timeout=60, interval=0.01)
            refused = [f.result() for f in futures if f.done()]
            assert len(refused) == 28 and not gate.is_set()
            for r in refused:
                assert r.status_code == 429, r.text
                assert r.headers["retry-after"].isdigit()
                assert r.json()["error"]["type"] == "rate_limit_error"
                assert r.json()["error"]["code"] == "overloaded"
            assert metric(c.get("/metrics").text, "embedserve_tokens_in_flight") == 40
            gate.set()
            admitted = [f.result() for f in futures if all(f.result() is not r for r in refused)]
        assert [r.status_code for r in admitted] == [200] * 4
        text = c.get("/metrics").text
        assert metric(text, "embedserve_tokens_in_flight") == 0
        assert metric(text, "embedserve_rejected_total", reason="tokens_in_flight") == 28
        # the load signal counts what was asked, refused or not: 32 requests of 10 tokens
        assert offered == [10] * 32
        # a request larger than the whole bound is still served when nothing else runs
        assert c.post("/v1/embeddings", json={"model": MODEL, "input": [[7] * 100]}).status_code == 200

