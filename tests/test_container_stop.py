"""``docker stop`` drains: the CPU profile's containers, started by
``deploy/docker/ci-containers.sh``, which names them in ``$EMBEDSERVE_E2E_CONTAINERS``
("GATEWAY ENGINE"); skipped when that is unset. The test ends both containers.

The engine container is paused (cgroup freezer) while requests are admitted, so all of them
are still in flight when the gateway gets SIGTERM; it resumes once the gateway is draining.
Every admitted request must complete with 200, a request arriving after SIGTERM must not be
admitted, and both containers must exit 0 within their grace periods (compose.yaml's 45 s
and 60 s).
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import time

import httpx
import pytest

from tests.conftest import ExternalStack, metric, wait_until

CONTAINERS = "EMBEDSERVE_E2E_CONTAINERS"
GATEWAY_GRACE_S = 45
ENGINE_GRACE_S = 60
ADMITTED = 6

pytestmark = pytest.mark.external_stack


@pytest.fixture()
def containers() -> tuple[str, str]:
    names = os.environ.get(CONTAINERS, "").split()
    if len(names) != 2:
        pytest.skip(f"{CONTAINERS} is not set")
    return names[0], names[1]


def docker(*args: str, timeout: float = 120) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"docker {' '.join(args)}: {done.stderr}"
    return done.stdout.strip()


def exit_code(container: str) -> int:
    return int(docker("inspect", "-f", "{{.State.ExitCode}}", container))


def logs(container: str) -> str:
    done = subprocess.run(["docker", "logs", container], capture_output=True, text=True, timeout=30)
    return done.stdout + done.stderr


def test_docker_stop_drains_admitted_requests(
    containers: tuple[str, str], external_stack: ExternalStack
) -> None:
    gateway, engine = containers
    url, model = external_stack.url, external_stack.model_name
    texts = [f"draining {i} on docker stop " * 4 for i in range(6)]
    body = {"model": model, "input": texts}
    tokens_each = httpx.post(url + "/v1/embeddings", json=body, timeout=30).json()["usage"]["total_tokens"]
    no_keepalive = httpx.Limits(max_keepalive_connections=0)

    def call() -> int | str:
        try:
            with httpx.Client(limits=no_keepalive, timeout=GATEWAY_GRACE_S + 30) as c:
                return c.post(url + "/v1/embeddings", json=body).status_code
        except httpx.ConnectError:
            return "refused"
        except httpx.HTTPError as exc:
            return type(exc).__name__

    def in_flight() -> float:
        return metric(httpx.get(url + "/metrics", timeout=5).text, "embedserve_tokens_in_flight")

    with concurrent.futures.ThreadPoolExecutor(ADMITTED + 2) as pool:
        docker("pause", engine)
        try:
            admitted = [pool.submit(call) for _ in range(ADMITTED)]
            wait_until(lambda: in_flight() == ADMITTED * tokens_each, timeout=20, interval=0.05)
            t0 = time.monotonic()
            stopping = pool.submit(docker, "stop", "-t", str(GATEWAY_GRACE_S), gateway, timeout=90)
            wait_until(lambda: "Shutting down" in logs(gateway), timeout=20, interval=0.1)
            late_call = pool.submit(call)
            concurrent.futures.wait([late_call], timeout=10)
            assert late_call.done(), "a request after SIGTERM waited for the engine: it was admitted"
            assert not any(f.done() for f in admitted), "answered while the engine was paused"
        finally:
            docker("unpause", engine)
        late = late_call.result()
        results = [f.result() for f in admitted]
        stopping.result()
    took = time.monotonic() - t0
    print(
        f"\nFIGURES docker stop: {ADMITTED} requests in flight at SIGTERM -> {results}; "
        f"late arrival -> {late}; gateway exit {exit_code(gateway)} in {took:.1f} s"
    )
    assert results == [200] * ADMITTED
    assert late in ("refused", 503), late
    assert exit_code(gateway) == 0
    assert took < GATEWAY_GRACE_S
    assert "timeout graceful shutdown exceeded" not in logs(gateway)

    t0 = time.monotonic()
    docker("stop", "-t", str(ENGINE_GRACE_S), engine, timeout=90)
    took = time.monotonic() - t0
    print(f"FIGURES docker stop: engine exit {exit_code(engine)} in {took:.1f} s")
    assert exit_code(engine) == 0
    assert took < ENGINE_GRACE_S
