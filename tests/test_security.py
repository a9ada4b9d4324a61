"""Security: API keys (env, file, several, Bearer only), the 401 envelope, health and metrics
protected separately, CORS off unless configured, a request id on every response and log
line, no request text in the logs, and header-size limits on the real server."""

from __future__ import annotations

import contextlib
import json
import select
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from embedserve.config import Settings
from embedserve.gateway.app import create_app
from tests.conftest import RunningStack, wait_until
from tests.fake_engine import FakeEngine, HttpxEngineClient
from tests.test_gateway_unit import make_client, wait_ready

MODEL = "all-MiniLM-L6-v2"
BODY = {"model": MODEL, "input": "a short text"}


def client_from_env(monkeypatch: pytest.MonkeyPatch, **env: str) -> TestClient:
    """Settings read from the environment, as ``embedserve up`` reads them."""
    monkeypatch.setenv("EMBEDSERVE_ENGINE__KIND", "external")
    monkeypatch.setenv("EMBEDSERVE_ENGINE__URLS", '["http://fake-engine"]')
    for key, value in env.items():
        monkeypatch.setenv(f"EMBEDSERVE_GATEWAY__{key.upper()}", value)
    settings = Settings(_env_file=None)
    client = HttpxEngineClient(httpx.ASGITransport(app=FakeEngine().app()))
    return TestClient(create_app(settings, engine_client=client))


def assert_401(r: Any) -> None:
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert err == {
        "message": err["message"],
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.headers["x-request-id"]


def test_keys_from_env_several_and_bearer_only(monkeypatch: pytest.MonkeyPatch) -> None:
    with client_from_env(monkeypatch, api_keys='["key-one", "key-two"]') as c:
        wait_ready(c)
        for auth in (
            None,
            "Bearer",
            "Bearer ",
            "Bearer wrong",
            "Basic key-one",
            "key-one",
            "Bearer key-one2",
        ):
            headers = {"authorization": auth} if auth is not None else {}
            assert_401(c.post("/v1/embeddings", json=BODY, headers=headers))
        assert_401(c.get("/v1/models"))
        for key in ("key-one", "key-two"):
            r = c.post("/v1/embeddings", json=BODY, headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200
        assert (
            c.post("/v1/embeddings", json=BODY, headers={"authorization": "bearer key-two"}).status_code
            == 200
        )


def test_keys_from_file_with_comments(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# rotated 2026-01\nfile-key-a\n\n  file-key-b  \n")
    with client_from_env(monkeypatch, api_keys_file=str(keys), api_keys='["env-key"]') as c:
        wait_ready(c)
        for key in ("file-key-a", "file-key-b", "env-key"):
            r = c.post("/v1/embeddings", json=BODY, headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200, key
        assert_401(c.post("/v1/embeddings", json=BODY, headers={"authorization": "Bearer # rotated 2026-01"}))


def test_requests_a_middleware_refuses_are_counted_by_status(monkeypatch: pytest.MonkeyPatch) -> None:
    """No route sees a body over the cap, a head over its cap or a request without a key; /metrics
    counts them by status all the same (scrapes and probes it refuses, it does not)."""
    def counted(c: TestClient) -> dict[str, float]:
        text = c.get("/metrics", headers={"authorization": "Bearer k"}).text
        return {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("embedserve_requests_total{")}

    with client_from_env(monkeypatch, api_keys='["k"]', max_body_bytes="1000", max_head_bytes="4096",
                         protect_health="true") as c:
        wait_ready(c)
        ok = {"authorization": "Bearer k"}
        assert c.post("/v1/embeddings", json=BODY, headers=ok).status_code == 200
        assert_401(c.post("/v1/embeddings", json=BODY))
        assert c.post("/v1/embeddings", json={**BODY, "input": "a" * 2000}, headers=ok).status_code == 413
        assert c.post("/v1/embeddings", json=BODY, headers={**ok, "x-pad": "a" * 5000}).status_code == 431
        assert c.get("/health/ready").status_code == 401  # a probe: not the API's
        assert c.post("/v1/rerank", json={"query": "q", "documents": ["d"]}).status_code == 401
        assert counted(c) == {"200": 1, "401": 1, "413": 1, "431": 1}
        scrape = c.get("/metrics", headers={"authorization": "Bearer k"}).text
        assert 'embedserve_score_requests_total{route="rerank",status="401"} 1.0' in scrape


def test_the_banners_curl_carries_a_key_where_the_gateway_asks_for_one(tmp_path: Path) -> None:
    """`up` prints a curl to paste: with keys on, it names the header to add (never the key)."""
    from embedserve.model_info import ModelInfo
    from embedserve.runtime.stack import _banner

    info = ModelInfo.load(Settings(_env_file=None).model)
    keys = tmp_path / "keys"
    keys.write_text("sk-secret\n")
    cases: list[tuple[dict[str, Any], bool]] = [({}, False), ({"api_keys": ["sk-secret"]}, True),
                                                ({"api_keys_file": str(keys)}, True)]
    for gateway, asked in cases:
        banner = _banner(Settings(gateway=gateway, _env_file=None), [info])
        assert ("Authorization: Bearer YOUR_API_KEY" in banner) is asked and "sk-secret" not in banner


@pytest.mark.parametrize(
    ("protect_health", "protect_metrics"), [(False, False), (True, False), (False, True)]
)
def test_health_and_metrics_protected_separately(protect_health: bool, protect_metrics: bool) -> None:
    gw = {"api_keys": ["k"], "protect_health": protect_health, "protect_metrics": protect_metrics}
    with make_client(FakeEngine(), **gw) as c:
        wait_ready(c)
        for path, protected in (
            ("/health/live", protect_health),
            ("/health/ready", protect_health),
            ("/health/memory", protect_health),
            ("/metrics", protect_metrics),
        ):
            r = c.get(path)
            if protected:
                assert_401(r)
                assert c.get(path, headers={"authorization": "Bearer k"}).status_code == 200
            else:
                assert r.status_code == 200, path


@pytest.fixture()
def open_client() -> Iterator[TestClient]:
    with make_client(FakeEngine(), max_body_bytes=10_000, max_tokens_in_flight=1) as c:
        wait_ready(c)
        yield c


def test_cors_is_off_by_default(open_client: TestClient) -> None:
    origin = {"origin": "https://evil.example"}
    preflight = open_client.options(
        "/v1/embeddings", headers={**origin, "access-control-request-method": "POST"}
    )
    assert "access-control-allow-origin" not in preflight.headers
    assert preflight.status_code >= 400 and "error" in preflight.json()
    r = open_client.post("/v1/embeddings", json=BODY, headers=origin)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_when_configured() -> None:
    """The same checks can fail: configuring an origin does add the header."""
    with make_client(FakeEngine(), cors_origins=["https://app.example"]) as c:
        wait_ready(c)
        r = c.post("/v1/embeddings", json=BODY, headers={"origin": "https://app.example"})
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        r = c.post("/v1/embeddings", json=BODY, headers={"origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers


def test_request_id_on_every_response(open_client: TestClient) -> None:
    c = open_client
    responses = [
        c.post("/v1/embeddings", json=BODY),  # 200
        c.post("/v1/embeddings", content=b"{", headers={"content-type": "application/json"}),  # 400
        c.post("/v1/embeddings", json={**BODY, "model": "nope"}),  # 404
        c.get("/v1/embeddings"),  # 405
        c.post("/v1/embeddings", json={"model": MODEL, "input": "x" * 20_000}),  # 413
        c.post("/v1/embeddings", content=b"x", headers={"content-type": "text/plain"}),  # 415
        c.get("/v1/models"),
        c.get("/health/live"),
        c.get("/metrics"),
        c.get("/no/such/path"),
    ]
    assert [r.status_code for r in responses] == [200, 400, 404, 405, 413, 415, 200, 200, 200, 404]
    ids = [r.headers.get("x-request-id") for r in responses]
    assert all(ids) and len(set(ids)) == len(ids)
    assert c.get("/v1/models", headers={"x-request-id": "trace-42"}).headers["x-request-id"] == "trace-42"
    for unsafe in ("a" * 200, "../etc", "x y"):
        rid = c.get("/v1/models", headers={"x-request-id": unsafe}).headers["x-request-id"]
        assert rid != unsafe and len(rid) == 32  # replaced, not echoed into logs


def test_oversized_head_is_431_in_the_envelope(open_client: TestClient) -> None:
    r = open_client.get("/v1/models", headers={"x-big": "a" * 40_000})
    assert r.status_code == 431 and r.json()["error"]["code"] == "request_header_fields_too_large"
    assert r.headers["x-request-id"]
    assert open_client.get("/v1/models", headers={"x-ok": "a" * 8_000}).status_code == 200


# -- the real stack: logs and the HTTP parser's limits -----------------------------------

SECRET = "sk-live-4f9c2b7e-DO-NOT-LOG-correct-horse-battery-staple"


def test_request_text_never_logged_and_every_line_has_a_request_id(minilm_stack: RunningStack) -> None:
    url = minilm_stack.url + "/v1/embeddings"
    name = minilm_stack.model_name
    with httpx.Client(timeout=60) as c:
        assert c.post(url, json={"model": name, "input": f"my key is {SECRET}"}).status_code == 200
        assert c.post(url, json={"model": name, "input": [SECRET, ""]}).status_code == 400
        assert c.post(url, json={"model": SECRET, "input": "x"}).status_code == 404
        bad = c.post(
            url,
            content=f'{{"model": "{name}", "input": "{SECRET}'.encode(),
            headers={"content-type": "application/json"},
        )
        assert bad.status_code == 400
        # a 404, as the default access log (gateway errors only) writes a line for it
        marker = c.get(minilm_stack.url + "/v1/no-such-route",
                       headers={"x-request-id": "marker-after-secret"})
        assert marker.status_code == 404
    wait_until(lambda: "marker-after-secret" in minilm_stack.log_text(), timeout=10)  # flushed to here
    log = minilm_stack.log_text()
    assert SECRET not in log and "correct-horse" not in log
    access = [json.loads(line) for line in log.splitlines() if '"logger": "embedserve.access"' in line]
    assert access and all(rec.get("request_id") for rec in access)


def _raw_request(url: str, head: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
            if b"\r\n\r\n" in b"".join(chunks):
                break
        return b"".join(chunks)


@pytest.mark.parametrize(
    "head",
    [
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
        + b"".join(b"X-H%d: v\r\n" % i for i in range(10_000))
        + b"\r\n",
        b"GET /v1/models?" + b"q" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
    ids=["100 KB header", "10k headers", "100 KB URL"],
)
def test_oversized_request_head_is_refused(minilm_stack: RunningStack, head: bytes) -> None:
    answer = _raw_request(minilm_stack.url, head)
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1") else None
    assert status is not None and 400 <= status < 500, answer[:200]
    assert httpx.get(minilm_stack.url + "/health/ready", timeout=10).status_code == 200


@pytest.mark.parametrize("server", ["url", "engine_url"])
def test_an_endless_request_head_is_cut_off_not_buffered(minilm_stack: RunningStack, server: str) -> None:
    """The parser must stop reading an unfinished head soon after the cap (httptools alone
    buffers it whole): the connection ends long before 64 MiB have gone out. The CPU engine
    too: httptools is installed, so uvicorn's default parser would be the unbounded one."""
    host, port = getattr(minilm_stack, server).removeprefix("http://").split(":")
    chunk, sent, limit = b"a" * 65536, 0, 64 * 2**20
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            while sent < limit and not select.select([s], [], [], 0)[0]:
                s.sendall(chunk)
                sent += len(chunk)
    assert sent < limit // 4, f"{sent} bytes of one header were read without an answer"
    assert httpx.get(minilm_stack.url + "/health/ready", timeout=10).status_code == 200
