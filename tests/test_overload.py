"""Admission control under a burst far above capacity (fake engine): the excess is answered
429 + Retry-After at once, every admitted request succeeds, nothing is 5xx, and the tokens
in flight return to zero. The real-stack figures are in results/overload-cpu/."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

from tests.fake_engine import FakeEngine
from tests.test_gateway_unit import make_client, wait_ready

MODEL = "all-MiniLM-L6-v2"


def test_burst_over_the_token_bound_gets_429_and_admitted_requests_succeed() -> None:
    engine = FakeEngine(delay_s=0.3)
    with make_client(engine, max_tokens_in_flight=40, request_timeout_s=10) as c:
        wait_ready(c)

        def call(i: int) -> tuple[int, float, Any]:
            t0 = time.monotonic()
            r = c.post("/v1/embeddings", json={"model": MODEL, "input": [[i + 1] * 10]})
            return r.status_code, time.monotonic() - t0, r

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            results = list(pool.map(call, range(32)))
        statuses = [s for s, _, _ in results]
        assert set(statuses) == {200, 429}, statuses
        assert statuses.count(200) >= 4  # 40 tokens in flight = 4 requests at a time
        for status, took, r in results:
            if status == 429:
                assert r.headers["retry-after"].isdigit()
                assert r.json()["error"]["type"] == "rate_limit_error"
                assert r.json()["error"]["code"] == "overloaded"
                assert took < 1.0  # refused at once, not after queueing
        metrics = c.get("/metrics").text
        assert "embedserve_tokens_in_flight 0.0" in metrics
        assert 'embedserve_rejected_total{reason="tokens_in_flight"}' in metrics
        # a request larger than the whole bound is still served when nothing else runs
        assert c.post("/v1/embeddings", json={"model": MODEL, "input": [[7] * 100]}).status_code == 200
