"""Two engines behind one gateway: work goes to both (fewest outstanding tokens), and when
one dies the other carries the traffic while the supervisor brings the first back."""

from __future__ import annotations

import concurrent.futures
import os
import signal
from pathlib import Path
from typing import Any

import httpx

from embedserve.config import BUNDLED_MODEL
from tests.conftest import start_stack, wait_until


def engines(url: str) -> list[dict[str, Any]]:
    return httpx.get(url + "/health/memory", timeout=5).json()["engines"]


def test_two_engines_share_work_and_survive_one_death(tmp_path: Path) -> None:
    stack = start_stack(BUNDLED_MODEL, tmp_path,
                        env={"EMBEDSERVE_ENGINE__REPLICAS": "2", "EMBEDSERVE_ENGINE__CPU_THREADS": "1"})
    try:
        # up means every engine's warm-up call answered: both take calls now, not after a health check
        assert [e["ready"] for e in engines(stack.url)] == [True, True]
        body = {"model": stack.model_name, "input": ["a sentence about memory"] * 4}

        def call(_: int) -> int:
            return httpx.post(stack.url + "/v1/embeddings", json=body, timeout=30).status_code

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert set(pool.map(call, range(48))) == {200}
        state = engines(stack.url)
        assert len(state) == 2 and all(e["ready"] for e in state)
        assert all(e["calls"] > 0 for e in state), state

        pids = [a["pid"] for a in httpx.get(stack.url + "/health/memory").json()["allocator"]]
        assert len(pids) == 2
        os.kill(pids[1], signal.SIGKILL)
        wait_until(lambda: sum(e["ready"] for e in engines(stack.url)) == 1, timeout=15)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert set(pool.map(call, range(12))) == {200}  # the survivor serves everything
        wait_until(lambda: all(e["ready"] for e in engines(stack.url)), timeout=90)
        assert call(0) == 200
    finally:
        assert stack.stop() == 0
