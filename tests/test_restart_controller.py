"""The restart controller's decision, on recorded /health/memory answers and pod states."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import httpx
import pytest

from service.restart_controller import (
    ControllerSettings,
    Decision,
    EvictionBlocked,
    KubeApi,
    MemoryVerdict,
    Observation,
    PodState,
    Policy,
    decide,
    parse_health_memory,
    policy_from,
    run_once,
)
from service.settings import Settings

# ---------------------------------------------------------------- recorded answers
# Shapes of GET /health/memory as issue 4 specifies them: the binding estimate at the
# top level, per-resource detail, recommends_restart and a plain-language reason.

FLAT = {
    "status": "ok",
    "estimated_hours_until_oom": None,
    "binding_resource": None,
    "recommends_restart": False,
    "reason": "memory is not growing (slope interval includes zero)",
    "resources": {
        "gpu": {"estimated_hours_until_oom": None, "used_bytes": 20_000_000_000},
        "host": {"estimated_hours_until_oom": None, "used_bytes": 3_000_000_000},
    },
    "window_s": 21600,
    "samples": 4320,
}

SLOW_LEAK = {
    "estimated_hours_until_oom": 41.5,
    "binding_resource": "host",
    "recommends_restart": False,
    "reason": "host RSS grows 12 MB/h; 41.5 h of headroom",
    "resources": {
        "gpu": {"estimated_hours_until_oom": None},
        "host": {"estimated_hours_until_oom": 41.5, "lower": 30.2, "upper": 60.0},
    },
}

GPU_LEAK_WARNING = {
    "estimated_hours_until_oom": 4.2,
    "binding_resource": "gpu",
    "recommends_restart": True,
    "reason": "GPU reserved memory grows 2.1 GB/h; 4.2 h to the device limit",
    "resources": {
        "gpu": {"estimated_hours_until_oom": 4.2, "lower": 3.1, "upper": 5.6},
        "host": {"estimated_hours_until_oom": 90.0},
    },
}

# The estimate only per resource (no top-level figure): the smallest one binds.
PER_RESOURCE_ONLY = {
    "recommends_restart": False,
    "forecast": {
        "gpu": {"estimated_hours_until_oom": 2.5, "bounds": {"lower": 2.0, "upper": 3.0}},
        "host": {"estimated_hours_until_oom": 12.0},
    },
}

# Under the threshold while the probe itself does not (yet) recommend a restart.
CLOSE_NO_FLAG = {"estimated_hours_until_oom": 5.0, "recommends_restart": False, "reason": ""}

# Recommends a restart for a reason other than the forecast (e.g. OOM counters).
FLAG_ONLY = {
    "estimated_hours_until_oom": None,
    "recommends_restart": True,
    "reason": "engine reported 2 allocator OOMs",
}


def test_parse_flat_is_not_growing():
    v = parse_health_memory(FLAT)
    assert v.reachable and v.hours_until_oom is None and not v.recommends_restart
    assert not v.needs_restart(6.0, True)
    assert v.urgency == math.inf


def test_parse_binding_resource_and_bounds():
    v = parse_health_memory(GPU_LEAK_WARNING)
    assert v.hours_until_oom == pytest.approx(4.2)
    assert v.hours_lower == pytest.approx(3.1)
    assert v.resource == "gpu"
    assert v.recommends_restart
    assert "GPU" in v.reason


def test_parse_per_resource_only_takes_smallest():
    v = parse_health_memory(PER_RESOURCE_ONLY)
    assert v.hours_until_oom == pytest.approx(2.5)
    assert v.hours_lower == pytest.approx(2.0)
    assert v.resource == "gpu"


@pytest.mark.parametrize("junk", [None, [], "oops", 3, {"estimated_hours_until_oom": "soon"}])
def test_parse_junk_never_restarts(junk):
    v = parse_health_memory(junk)
    assert not v.needs_restart(6.0, True)


def test_parse_nan_and_inf_mean_unknown():
    v = parse_health_memory({"estimated_hours_until_oom": float("inf")})
    assert v.hours_until_oom is None
    v = parse_health_memory(json.loads('{"estimated_hours_until_oom": NaN}'))
    assert v.hours_until_oom is None


def test_threshold_and_recommendation():
    close = parse_health_memory(CLOSE_NO_FLAG)
    assert close.needs_restart(6.0, True)
    assert not close.needs_restart(4.0, True)
    flag = parse_health_memory(FLAG_ONLY)
    assert flag.needs_restart(6.0, True)
    assert not flag.needs_restart(6.0, False)


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
    assert "4.20 h" in d.reason and "gpu" in d.reason


def test_only_one_eviction_when_several_leak_most_urgent_first():
    d = decide(
        [
            obs(pod("a"), GPU_LEAK_WARNING),  # 4.2 h
            obs(pod("b"), PER_RESOURCE_ONLY),  # 2.5 h
            obs(pod("c"), CLOSE_NO_FLAG),  # 5.0 h
        ],
        POLICY,
    )
    assert d.action == "evict" and d.pod == "b"
    assert set(d.candidates) == {"a", "b", "c"}


def test_drained_pod_goes_before_serving_ones():
    # b was already drained by its readiness probe: evicting it costs no capacity.
    d = decide(
        [obs(pod("a"), PER_RESOURCE_ONLY), obs(pod("b", ready=False), GPU_LEAK_WARNING)],
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
    at = {"estimated_hours_until_oom": 6.0, "recommends_restart": False}
    above = {"estimated_hours_until_oom": 6.01, "recommends_restart": False}
    assert decide([obs(pod("a"), at)], POLICY).pod == "a"
    assert decide([obs(pod("a"), above)], POLICY).action == "none"
    wide = Policy(threshold_hours=8.0)
    assert decide([obs(pod("a"), above)], wide).pod == "a"


def test_recommendation_can_be_ignored():
    strict = Policy(threshold_hours=6.0, follow_recommendation=False, min_pod_age_s=0)
    assert decide([obs(pod("a"), FLAG_ONLY)], strict).action == "none"
    assert decide([obs(pod("a"), FLAG_ONLY)], POLICY).pod == "a"


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
        assert request.headers["authorization"] == "Bearer t0ken"
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


def _api(server: FakeApiServer) -> KubeApi:
    return KubeApi("https://k8s.test", "ml", "t0ken", transport=httpx.MockTransport(server.handler))


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
    from service import restart_controller as rc

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, json=GPU_LEAK_WARNING)

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


# ---------------------------------------------------------------- the real producer


def _forecast(resource: str, status: str, hours: float | None, lower: float | None) -> Any:
    from health.forecast import ResourceForecast

    return ResourceForecast(
        resource=resource,
        status=status,  # type: ignore[arg-type]
        used_bytes=50e9,
        limit_bytes=80e9,
        limit_source="nvml",
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
        reason=f"{resource} reason",
    )


@pytest.mark.parametrize(
    ("gpu_hours", "host_hours", "expect_evict"),
    [(4.2, None, True), (None, None, False), (30.0, 5.5, True), (12.0, 40.0, False)],
)
def test_documents_built_by_health_itself(gpu_hours, host_hours, expect_evict):
    """The document health/monitor.py serves, from health's own functions, parses right."""
    pytest.importorskip("health.report")
    from health.report import advice

    forecasts = {
        "gpu:0": _forecast(
            "gpu:0",
            "growing" if gpu_hours else "not_growing",
            gpu_hours,
            None if gpu_hours is None else gpu_hours * 0.8,
        ),
        "host": _forecast("host", "growing" if host_hours else "not_growing", host_hours, None),
    }
    verdict = advice(forecasts, warning_hours=6.0, critical_hours=1.0)
    document = {
        **verdict,
        "resources": {k: f.as_dict() for k, f in forecasts.items()},
        "gpu": {"devices": []},
    }
    v = parse_health_memory(json.loads(json.dumps(document)))
    assert v.reachable
    assert v.recommends_restart == verdict["recommends_restart"]
    assert v.hours_until_oom == verdict["estimated_hours_until_oom"]
    d = decide([obs(pod("a"), document)], POLICY)
    assert (d.action == "evict") == expect_evict
    assert (d.action == "evict") == verdict["recommends_restart"]
