"""The restart controller's decision, on recorded /health/memory answers and pod states."""

from __future__ import annotations

import asyncio
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from embedserve.config import ControllerSettings, Settings
from embedserve.contracts.memory import MemoryReport, ResourceForecast
from embedserve.controller.kube import EvictionBlocked, KubeApi, ServiceAccountToken
from embedserve.controller.restart_decision import (
    Decision,
    MemoryVerdict,
    Observation,
    PodState,
    Policy,
    decide,
    policy_from,
)
from embedserve.controller.restart_observe import parse_health_memory
from embedserve.controller.restart_round import run_once
from embedserve.health.report import advice

# ---------------------------------------------------------------- reports
# Every /health/memory answer below is built by health's own producer (forecasts ->
# advice -> MemoryReport), serialised as the gateway serves it.


def _forecast(resource: str, hours: float | None, lower: float | None = None) -> ResourceForecast:
    return ResourceForecast(
        resource=resource,
        status="not_growing" if hours is None else "growing",
        used_bytes=50e9,
        limit_bytes=80e9,
        limit_source="device total",
        headroom_bytes=30e9,
        peak_bytes=50e9,
        slope_bytes_per_hour=None if hours is None else 30e9 / hours,
        slope_low_bytes_per_hour=None,
        slope_high_bytes_per_hour=None,
        window_start=0.0,
        window_s=21600.0,
        samples=4000,
        estimated_hours_until_oom=hours,
        hours_lower=lower,
        hours_upper=None,
        capped=False,
        reason=f"{resource}: {'not growing' if hours is None else f'out of memory in {hours} h'}",
    )


def report(gpu: float | None, host: float | None, lower: float | None = None, warning: float = 6.0) -> bytes:
    forecasts = {"gpu:0": _forecast("gpu:0", gpu, lower), "host": _forecast("host", host, lower)}
    verdict = advice(forecasts, warning_hours=warning, critical_hours=1.0)
    return MemoryReport(**verdict.model_dump(), resources=forecasts).model_dump_json().encode()


FLAT = report(None, None)
SLOW_LEAK = report(None, 41.5, lower=30.2)
GPU_LEAK_WARNING = report(4.2, 90.0, lower=3.1)
TWO_AND_A_HALF_HOURS = report(2.5, 12.0, lower=2.0)
# 5 h left on a pod whose own warning horizon is 4 h: it does not ask for a restart itself.
CLOSE_NO_FLAG = report(5.0, None, warning=4.0)


def test_parse_flat_is_not_growing():
    v = parse_health_memory(FLAT)
    assert v.reachable and v.hours_until_oom is None and not v.recommends_restart
    assert not v.needs_restart(6.0, True)
    assert v.urgency == math.inf


def test_parse_binding_resource_and_bounds():
    v = parse_health_memory(GPU_LEAK_WARNING)
    assert v.hours_until_oom == pytest.approx(4.2)
    assert v.hours_lower == pytest.approx(3.1)
    assert v.resource == "gpu:0"
    assert v.recommends_restart
    assert "4.2 h" in v.reason


def test_parse_smallest_resource_binds():
    v = parse_health_memory(TWO_AND_A_HALF_HOURS)
    assert v.hours_until_oom == pytest.approx(2.5)
    assert v.hours_lower == pytest.approx(2.0)
    assert v.resource == "gpu:0"


@pytest.mark.parametrize(
    "junk", [b"null", b"[]", b'"oops"', b"3", b"{", b'{"estimated_hours_until_oom": "soon"}']
)
def test_parse_junk_never_restarts(junk):
    v = parse_health_memory(junk)
    assert not v.reachable and "not a /health/memory report" in v.reason
    assert not v.needs_restart(6.0, True)


@pytest.mark.parametrize("hours", ["NaN", "Infinity"])
def test_parse_nan_and_inf_never_restart(hours):
    key = '"estimated_hours_until_oom": '
    text = json.dumps(json.loads(FLAT)).replace(key + "null", key + hours, 1)
    v = parse_health_memory(text)
    assert not v.needs_restart(6.0, True)


def test_threshold_and_recommendation():
    close = parse_health_memory(CLOSE_NO_FLAG)
    assert not close.recommends_restart
    assert close.needs_restart(6.0, True)
    assert not close.needs_restart(4.0, True)
    assert parse_health_memory(GPU_LEAK_WARNING).needs_restart(1.0, True)
    assert not parse_health_memory(GPU_LEAK_WARNING).needs_restart(1.0, False)


# ---------------------------------------------------------------- decisions

POLICY = Policy(threshold_hours=6.0, follow_recommendation=True, min_pod_age_s=600)


def pod(name, *, ready=True, phase="Running", terminating=False, age_s=86_400.0):
    return PodState(name, "10.0.0.1", phase, ready, terminating, age_s)


def obs(p: PodState, answer) -> Observation:
    return Observation(p, parse_health_memory(answer))


def unreachable(p: PodState) -> Observation:
    return Observation(p, MemoryVerdict(reachable=False, reason="ConnectError"))


def test_all_flat_does_nothing():
    d = decide([obs(pod("a"), FLAT), obs(pod("b"), SLOW_LEAK)], POLICY)
    assert d.action == "none" and d.pod is None


def test_no_pods():
    assert decide([], POLICY).action == "none"


def test_one_leaking_pod_is_evicted():
    d = decide([obs(pod("a"), FLAT), obs(pod("b"), GPU_LEAK_WARNING)], POLICY)
    assert d.action == "evict" and d.pod == "b"
    assert "4.20 h" in d.reason and "gpu:0" in d.reason


def test_only_one_eviction_when_several_leak_most_urgent_first():
    d = decide(
        [
            obs(pod("a"), GPU_LEAK_WARNING),  # 4.2 h
            obs(pod("b"), TWO_AND_A_HALF_HOURS),  # 2.5 h
            obs(pod("c"), CLOSE_NO_FLAG),  # 5.0 h
        ],
        POLICY,
    )
    assert d.action == "evict" and d.pod == "b"
    assert set(d.candidates) == {"a", "b", "c"}


def test_drained_pod_goes_before_serving_ones():
    # b was already drained by its readiness probe: evicting it costs no capacity.
    d = decide(
        [obs(pod("a"), TWO_AND_A_HALF_HOURS), obs(pod("b", ready=False), GPU_LEAK_WARNING)],
        POLICY,
    )
    assert d.action == "evict" and d.pod == "b"


def test_waits_while_a_pod_terminates():
    d = decide([obs(pod("a"), GPU_LEAK_WARNING), obs(pod("b", terminating=True), FLAT)], POLICY)
    assert d.action == "wait" and "b is terminating" in d.reason and d.candidates == ("a",)


def test_waits_while_replacement_is_pending_or_starting():
    pending = decide(
        [obs(pod("a"), GPU_LEAK_WARNING), obs(pod("new", phase="Pending", ready=False), FLAT)],
        POLICY,
    )
    assert pending.action == "wait" and "Pending" in pending.reason
    starting = decide(
        [obs(pod("a"), GPU_LEAK_WARNING), obs(pod("new", ready=False, age_s=30), FLAT)],
        POLICY,
    )
    assert starting.action == "wait" and "starting" in starting.reason


def test_unready_and_unreachable_pod_blocks():
    d = decide([obs(pod("a"), GPU_LEAK_WARNING), unreachable(pod("b", ready=False))], POLICY)
    assert d.action == "wait" and "health unreachable" in d.reason


def test_ready_but_unreachable_pod_is_left_to_liveness():
    d = decide([obs(pod("a"), GPU_LEAK_WARNING), unreachable(pod("b"))], POLICY)
    assert d.action == "evict" and d.pod == "a"


def test_young_pod_is_not_evicted():
    d = decide([obs(pod("a", age_s=120), GPU_LEAK_WARNING), obs(pod("b"), FLAT)], POLICY)
    assert d.action == "wait" and "younger" in d.reason


def test_threshold_matches_the_readiness_probe_and_is_configurable():
    # health/probes.py drains at hours <= warning_hours: the controller agrees at the edge.
    at = report(6.0, None, warning=1.5)
    above = report(6.01, None, warning=1.5)
    assert decide([obs(pod("a"), at)], POLICY).pod == "a"
    assert decide([obs(pod("a"), above)], POLICY).action == "none"
    wide = Policy(threshold_hours=8.0)
    assert decide([obs(pod("a"), above)], wide).pod == "a"


def test_recommendation_can_be_ignored():
    # The pod's own horizon (8 h) asks for a restart at 7 h; the controller's is 6 h.
    flagged = report(7.0, None, warning=8.0)
    strict = Policy(threshold_hours=6.0, follow_recommendation=False, min_pod_age_s=0)
    assert decide([obs(pod("a"), flagged)], strict).action == "none"
    assert decide([obs(pod("a"), flagged)], POLICY).pod == "a"


def test_threshold_defaults_to_readiness_horizon(monkeypatch):
    monkeypatch.setenv("EMBEDSERVE_HEALTH__WARNING_HOURS", "9")
    monkeypatch.setenv("EMBEDSERVE_HEALTH__CRITICAL_HOURS", "2")
    assert policy_from(Settings()).threshold_hours == 9.0
    monkeypatch.setenv("EMBEDSERVE_CONTROLLER__THRESHOLD_HOURS", "7.5")
    monkeypatch.setenv("EMBEDSERVE_CONTROLLER__MIN_POD_AGE_S", "60")
    p = policy_from(Settings())
    assert p.threshold_hours == 7.5 and p.min_pod_age_s == 60


def test_pod_state_from_api():
    now = 1_700_000_000.0
    raw: dict[str, Any] = {
        "metadata": {"name": "embedserve-abc", "creationTimestamp": "2023-11-14T22:13:20Z"},
        "status": {
            "phase": "Running",
            "podIP": "10.1.2.3",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    p = PodState.from_api(raw, now)
    assert p == PodState("embedserve-abc", "10.1.2.3", "Running", True, False, 0.0)
    raw["metadata"]["deletionTimestamp"] = "2023-11-14T22:14:00Z"
    raw["status"]["conditions"][0]["status"] = "False"
    p = PodState.from_api(raw, now + 3600)
    assert p.terminating and not p.ready and p.age_s == 3600


# ---------------------------------------------------------------- the API calls


def _pod_json(name, ip, ready=True, created="2020-01-01T00:00:00Z"):
    return {
        "metadata": {"name": name, "creationTimestamp": created},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


class FakeApiServer:
    def __init__(self, pods, eviction_status=201):
        self.pods = pods
        self.eviction_status = eviction_status
        self.requests: list[httpx.Request] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        assert request.headers["authorization"] == f"Bearer {TOKEN_FILE.read_text().strip()}"
        if request.method == "GET" and request.url.path == "/api/v1/namespaces/ml/pods":
            assert request.url.params["labelSelector"] == "app.kubernetes.io/name=embedserve"
            return httpx.Response(200, json={"kind": "PodList", "items": self.pods})
        if request.method == "POST" and request.url.path.endswith("/eviction"):
            if self.eviction_status == 429:
                return httpx.Response(
                    429,
                    json={"message": "Cannot evict pod as it would violate the pod's disruption budget."},
                )
            return httpx.Response(self.eviction_status, json={"kind": "Status"})
        return httpx.Response(404, json={"message": "not found"})


TOKEN_FILE = Path(tempfile.mkdtemp()) / "token"
TOKEN_FILE.write_text("t0ken\n")
TOKEN = ServiceAccountToken(TOKEN_FILE)


def _api(server: FakeApiServer) -> KubeApi:
    return KubeApi("https://k8s.test", "ml", TOKEN, transport=httpx.MockTransport(server.handler))


def _fetcher(answers):
    async def fetch(p: PodState) -> MemoryVerdict:
        return parse_health_memory(answers[p.ip])

    return fetch


def test_run_once_evicts_through_the_eviction_api():
    server = FakeApiServer([_pod_json("p1", "10.0.0.1"), _pod_json("p2", "10.0.0.2")])
    answers = {"10.0.0.1": FLAT, "10.0.0.2": GPU_LEAK_WARNING}
    cfg = ControllerSettings()

    async def go() -> Decision:
        api = _api(server)
        try:
            return await run_once(api, _fetcher(answers), cfg, POLICY)
        finally:
            await api.aclose()

    d = asyncio.run(go())
    assert d.action == "evict" and d.pod == "p2"
    post = [r for r in server.requests if r.method == "POST"]
    assert len(post) == 1
    assert post[0].url.path == "/api/v1/namespaces/ml/pods/p2/eviction"
    body = json.loads(post[0].content)
    assert body["apiVersion"] == "policy/v1" and body["kind"] == "Eviction"
    assert body["metadata"] == {"name": "p2", "namespace": "ml"}
    assert "deleteOptions" not in body


def test_run_once_dry_run_asks_the_server_to_dry_run():
    server = FakeApiServer([_pod_json("p1", "10.0.0.1")])
    cfg = ControllerSettings(dry_run=True)

    async def go() -> None:
        api = _api(server)
        await run_once(api, _fetcher({"10.0.0.1": GPU_LEAK_WARNING}), cfg, POLICY)
        await api.aclose()

    asyncio.run(go())
    post = [r for r in server.requests if r.method == "POST"]
    assert json.loads(post[0].content)["deleteOptions"] == {"dryRun": ["All"]}


def test_pdb_refusal_is_a_wait_not_a_crash():
    server = FakeApiServer([_pod_json("p1", "10.0.0.1")], eviction_status=429)

    async def go() -> Decision:
        api = _api(server)
        try:
            return await run_once(api, _fetcher({"10.0.0.1": GPU_LEAK_WARNING}), ControllerSettings(), POLICY)
        finally:
            await api.aclose()

    d = asyncio.run(go())
    assert d.action == "wait" and "disruption budget" in d.reason and d.pod == "p1"


def test_evict_raises_blocked_on_429():
    server = FakeApiServer([], eviction_status=429)

    async def go() -> None:
        api = _api(server)
        try:
            await api.evict("p1")
        finally:
            await api.aclose()

    with pytest.raises(EvictionBlocked):
        asyncio.run(go())


def test_http_fetcher_reads_the_gateway(monkeypatch):
    from embedserve.controller import restart_observe as rc

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, content=GPU_LEAK_WARNING)

    real = httpx.AsyncClient
    monkeypatch.setattr(
        rc.httpx,
        "AsyncClient",
        lambda **kw: real(transport=httpx.MockTransport(handler), **kw),
    )
    fetch = rc.http_health_fetcher(ControllerSettings(health_port=8000))

    async def get(p: PodState) -> MemoryVerdict:
        return await fetch(p)

    v = asyncio.run(get(pod("a")))
    assert seen == ["http://10.0.0.1:8000/health/memory"]
    assert v.recommends_restart and v.hours_until_oom == pytest.approx(4.2)
    v = asyncio.run(get(PodState("x", None, "Running", True, False, 1e6)))
    assert not v.reachable


def test_a_rotated_token_is_used_on_the_next_request():
    server = FakeApiServer([_pod_json("p1", "10.0.0.1")])

    async def go() -> None:
        api = _api(server)
        try:
            await api.list_pods("app.kubernetes.io/name=embedserve")
            TOKEN_FILE.write_text("rotated\n")
            await api.list_pods("app.kubernetes.io/name=embedserve")
        finally:
            TOKEN_FILE.write_text("t0ken\n")
            await api.aclose()

    asyncio.run(go())
    sent = [r.headers["authorization"] for r in server.requests]
    assert sent == ["Bearer t0ken", "Bearer rotated"]
