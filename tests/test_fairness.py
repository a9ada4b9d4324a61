"""One large request beside short ones on the real CPU stack: the huge one is refused at
once with the measured capacity, an admitted large one does not starve the short ones,
and nobody gets a 5xx. Bounds are loose (a shared 2-core machine); the benchmark
``python bench/suite.py --only huge-request`` measures the real figures."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from embedserve.config import BUNDLED_MODEL
from tests.conftest import RunningStack, start_stack


def huge_body(model: str, inputs: int, words: int) -> dict[str, object]:
    """As bench/probes.py's huge-request scenario builds it: distinct words, so no input repeats."""
    texts = [" ".join(f"memory{i} token{j}" for j in range(words // 2)) for i in range(inputs)]
    return {"model": model, "input": texts}


NO_STARVING_S = 10.0  # a short request's worst case here; the target (1 s) lives in the benchmark
#: The stack's deadline. The huge request below is ~256,000 tokens after the 256-token cap, so
#: it is past what the engine embeds in time below ~12,800 tokens/s. With the default 60 s it
#: would be below ~4,300 tokens/s only: a fresh stack on a quiet 2-core VM embeds ~5,700 and
#: answered it 200 after 45 s.
DEADLINE_S = 20


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    env = {"EMBEDSERVE_GATEWAY__REQUEST_TIMEOUT_S": str(DEADLINE_S)}
    stack = start_stack(BUNDLED_MODEL, tmp_path_factory.mktemp("fairness-stack"), env=env)
    yield stack
    stack.stop()


def test_a_huge_request_is_refused_at_once_with_the_capacity(stack: RunningStack) -> None:
    body = huge_body(stack.model_name, 1000, 400)  # within 2,048 inputs and 300,000 tokens
    t0 = time.monotonic()
    r = httpx.post(stack.url + "/v1/embeddings", json=body, timeout=120)
    took = time.monotonic() - t0
    print(f"refused in {took:.2f} s")
    assert r.status_code == 413, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "request_exceeds_capacity" and "tokens/s" in err["message"]
    assert took < 30  # tokenising 400,000 words, not computing them


def test_a_large_request_does_not_starve_short_ones(stack: RunningStack) -> None:
    url = stack.url + "/v1/embeddings"
    large = huge_body(stack.model_name, 48, 300)  # ~12,000 tokens: admitted
    short: list[tuple[int, float]] = []

    def send_large() -> int:
        return httpx.post(url, json=large, timeout=120).status_code

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        big = pool.submit(send_large)
        time.sleep(0.5)  # the large request is queued and being computed
        one = {"model": stack.model_name, "input": "short one"}
        with httpx.Client(timeout=120) as c:
            while not big.done():
                t0 = time.monotonic()
                status = c.post(url, json=one).status_code
                short.append((status, time.monotonic() - t0))
        assert big.result() == 200
    latencies = [s for _, s in short]
    print(f"{len(short)} short requests beside the large one: P50 {np.percentile(latencies, 50):.2f} s, "
          f"max {max(latencies):.2f} s")
    assert short and all(status == 200 for status, _ in short)
    assert max(latencies) < NO_STARVING_S
