"""Surge before evict, against a fake API server that keeps its objects: the decision and
the calls (surge, wait, evict, restore), a surge that never becomes ready, the autoscaler
changing replicas meanwhile, and who holds the count (Deployment, HPA, KEDA ScaledObject)."""

from __future__ import annotations

import asyncio
import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from embedserve.config import ControllerSettings, Settings
from embedserve.contracts.surge import SURGE_ANNOTATION, Surge
from embedserve.controller import surge as surging
from embedserve.controller.kube import KubeApi
from embedserve.controller.restart_decision import Decision, MemoryVerdict, PodState, Policy
from embedserve.controller.restart_observe import parse_health_memory, parse_load
from embedserve.controller.restart_round import ControllerMetrics, run_once
from embedserve.runtime import cli
from tests.test_restart_controller import FLAT, GPU_LEAK_WARNING

NS = "ml"
POLICY = Policy(threshold_hours=6.0, min_pod_age_s=600)
TIMEOUT = 900.0


def _pod(name: str, *, ready: bool = True, phase: str = "Running") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "creationTimestamp": "2020-01-01T00:00:00Z", "labels": {"app": "e"}},
        "status": {
            "phase": phase,
            "podIP": "10.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def _pointer_set(obj: dict[str, Any], pointer: str, value: Any, remove: bool = False) -> None:
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in pointer.strip("/").split("/")]
    for p in parents:
        obj = obj.setdefault(p, {})
    if remove:
        obj.pop(last, None)
    else:
        obj[last] = value


def _pointer_get(obj: dict[str, Any], pointer: str) -> Any:
    for p in pointer.strip("/").split("/"):
        if not isinstance(obj, dict) or p not in obj:
            return None
        obj = obj[p]
    return obj


class FakeCluster:
    """Pods, one Deployment, its HPAs and ScaledObjects; evictions mark pods terminating.
    JSON patches apply with their test ops (422 when one fails), as the API server does."""

    def __init__(self, pods: list[dict[str, Any]], replicas: int = 2, max_surge: Any = 1) -> None:
        self.pods = {p["metadata"]["name"]: p for p in pods}
        self.deployment: dict[str, Any] = {
            "metadata": {"name": "embedserve"},
            "spec": {
                "replicas": replicas,
                "strategy": {
                    "type": "RollingUpdate",
                    "rollingUpdate": {"maxUnavailable": 1, "maxSurge": max_surge},
                },
            },
        }
        self.hpas: dict[str, dict[str, Any]] = {}
        self.scaledobjects: dict[str, dict[str, Any]] = {}
        self.evicted: list[str] = []
        self.eviction_status = 201
        self.patches: list[tuple[str, Any]] = []
        self.forbidden: set[str] = set()  # kinds the controller's Role does not cover
        self.read_only: set[str] = set()  # kinds it may read but not patch

    def objects(self, kind: str) -> dict[str, dict[str, Any]]:
        return {
            "deployments": {"embedserve": self.deployment},
            "horizontalpodautoscalers": self.hpas,
            "scaledobjects": self.scaledobjects,
        }[kind]

    def handler(self, request: httpx.Request) -> httpx.Response:
        parts = request.url.path.strip("/").split("/")
        if request.url.path == f"/api/v1/namespaces/{NS}/pods":
            return httpx.Response(200, json={"items": list(self.pods.values())})
        if parts[-1] == "eviction":
            if self.eviction_status != 201:
                return httpx.Response(
                    self.eviction_status, json={"message": "would violate the disruption budget"}
                )
            pod = parts[-2]
            self.evicted.append(pod)
            self.pods[pod]["metadata"]["deletionTimestamp"] = "2020-01-02T00:00:00Z"
            return httpx.Response(201, json={})
        listing = parts[-1] == "horizontalpodautoscalers"
        kind, name = (parts[-1], None) if listing else (parts[-2], parts[-1])
        if kind in self.forbidden:
            return httpx.Response(403, json={"message": "forbidden"})
        objects = self.objects(kind)
        if request.method == "GET" and name is None:
            return httpx.Response(200, json={"items": list(objects.values())})
        if name not in objects:
            return httpx.Response(404, json={"message": "not found"})
        obj = objects[name]
        if request.method == "GET":
            return httpx.Response(200, json=obj)
        if kind in self.read_only:
            return httpx.Response(403, json={"message": "forbidden"})
        body = json.loads(request.content)
        if request.url.params.get("dryRun") == "All":
            return httpx.Response(200, json=obj)
        self.patches.append((f"{kind}/{name}", body))
        if request.headers["content-type"] == "application/merge-patch+json":
            annotations = obj["metadata"].setdefault("annotations", {})
            for k, v in body["metadata"]["annotations"].items():
                if v is None:
                    annotations.pop(k, None)
                else:
                    annotations[k] = v
            return httpx.Response(200, json=obj)
        trial = copy.deepcopy(obj)
        for op in body:
            if op["op"] == "test":
                if _pointer_get(trial, op["path"]) != op["value"]:
                    return httpx.Response(422, json={"message": "the test operation failed"})
            else:
                _pointer_set(trial, op["path"], op.get("value"), remove=op["op"] == "remove")
        obj.clear()
        obj.update(trial)
        return httpx.Response(200, json=obj)

    # -- what the test plays: the Deployment controller, the kubelet, the autoscaler
    def add_pod(self, name: str, ready: bool = False, phase: str = "Pending") -> None:
        self.pods[name] = _pod(name, ready=ready, phase=phase)

    def set_ready(self, name: str) -> None:
        self.pods[name] = _pod(name)

    @property
    def surge(self) -> Surge | None:
        return surging.read_surge(self.deployment)


def hpa(name: str, low: int, high: int, keda: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if keda:
        meta["ownerReferences"] = [{"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "name": keda}]
    return {
        "metadata": meta,
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "embedserve"},
            "minReplicas": low,
            "maxReplicas": high,
        },
    }


class Round:
    """Rounds of the controller on one fake cluster, at times the test sets."""

    def __init__(self, cluster: FakeCluster, answers: dict[str, bytes], **cfg: Any) -> None:
        self.cluster = cluster
        self.answers = answers  # pod name -> its /health/memory
        self.loads: dict[str, float] = {}
        self.cfg = ControllerSettings(**cfg)
        self.metrics = ControllerMetrics()
        self.now = 1_700_000_000.0

    def __call__(self, advance_s: float = 0.0) -> Decision:
        self.now += advance_s

        async def fetch(p: PodState) -> MemoryVerdict:
            return parse_health_memory(self.answers.get(p.name, FLAT))

        async def load(p: PodState) -> float | None:
            return self.loads.get(p.name)

        async def go() -> Decision:
            api = KubeApi("https://k8s.test", NS, None, transport=httpx.MockTransport(self.cluster.handler))
            try:
                return await run_once(
                    api, fetch, self.cfg, POLICY, load, self.metrics, clock=lambda: self.now
                )
            finally:
                await api.aclose()

        return asyncio.run(go())

    def steps(self) -> dict[str, float]:
        return {
            s.labels["step"]: s.value
            for m in self.metrics.registry.collect()
            if m.name == "embedserve_restart_controller_steps"
            for s in m.samples
            if s.name.endswith("_total") and s.value
        }


def leaking_pair(**kw: Any) -> tuple[FakeCluster, Round]:
    cluster = FakeCluster([_pod("a"), _pod("b")], **kw)
    return cluster, Round(cluster, {"a": GPU_LEAK_WARNING})


# ---------------------------------------------------------------- without an autoscaler


def test_surge_wait_evict_restore_on_the_deployment() -> None:
    cluster, rnd = leaking_pair()
    d = rnd()
    assert d.action == "surge" and d.pod == "a"
    assert cluster.deployment["spec"]["replicas"] == 3 and cluster.evicted == []
    surge = cluster.surge
    assert surge is not None and (surge.owner, surge.before, surge.surged, surge.ready_before) == (
        "deployment",
        2,
        3,
        2,
    )
    cluster.add_pod("c")  # the Deployment's new pod: scheduled, pulling, starting
    assert rnd(60).action == "surge" and cluster.evicted == []  # waits while it starts
    cluster.set_ready("c")
    d = rnd(60)
    assert d.action == "evict" and cluster.evicted == ["a"]
    assert cluster.deployment["spec"]["replicas"] == 2 and cluster.surge is None
    assert rnd.steps() == {"surge": 1, "surge_wait": 1, "surge_ready": 1, "evict": 1, "restore": 1}
    # the next round sees a pod terminating: nothing else happens
    assert rnd(60).action == "wait" and cluster.evicted == ["a"]


def test_evict_happens_before_the_count_comes_back() -> None:
    """Scaling down first would let the ReplicaSet pick the victim: the newest pod, the surge."""
    cluster, rnd = leaking_pair()
    rnd()
    cluster.add_pod("c", ready=True, phase="Running")
    order: list[str] = []
    real = cluster.handler

    def spy(request: httpx.Request) -> httpx.Response:
        if request.method != "GET":
            order.append(
                "evict" if request.url.path.endswith("eviction") else request.headers["content-type"]
            )
        return real(request)

    cluster.handler = spy  # type: ignore[method-assign]
    rnd(30)
    assert order == ["evict", "application/json-patch+json", "application/merge-patch+json"]


def test_a_surge_that_never_becomes_ready_falls_back_and_restores() -> None:
    cluster, rnd = leaking_pair()
    rnd()
    cluster.add_pod("c")  # Pending forever: no spare GPU after all
    for _ in range(3):
        assert rnd(TIMEOUT / 4).action == "surge"
    assert cluster.evicted == []
    d = rnd(TIMEOUT / 4)
    assert d.action == "evict" and cluster.evicted == ["a"]
    assert cluster.deployment["spec"]["replicas"] == 2 and cluster.surge is None
    steps = rnd.steps()
    assert steps["surge_timeout"] == 1 and steps["restore"] == 1 and steps["evict"] == 1


def test_after_a_timeout_a_blocked_eviction_is_retried_without_a_new_surge() -> None:
    cluster, rnd = leaking_pair()
    rnd()
    cluster.eviction_status = 429
    d = rnd(TIMEOUT)
    assert d.action == "wait" and "eviction blocked" in d.reason
    surge = cluster.surge
    assert surge is not None and surge.phase == "fallback"
    assert cluster.deployment["spec"]["replicas"] == 2  # restored at the timeout
    cluster.eviction_status = 201
    assert rnd(60).action == "evict" and cluster.evicted == ["a"]
    assert cluster.surge is None and cluster.deployment["spec"]["replicas"] == 2
    assert rnd.steps()["surge"] == 1 and rnd.steps()["restore"] == 1


def test_an_operator_who_scales_meanwhile_keeps_the_count() -> None:
    cluster, rnd = leaking_pair()
    rnd()
    cluster.deployment["spec"]["replicas"] = 5  # kubectl scale, during the surge
    for name in "cdef":
        cluster.add_pod(name, ready=True, phase="Running")
    assert rnd(60).action == "evict"
    assert cluster.deployment["spec"]["replicas"] == 5 and cluster.surge is None
    assert rnd.steps()["restore_left"] == 1 and "restore" not in rnd.steps()


def test_the_pod_gone_meanwhile_ends_the_surge() -> None:
    cluster, rnd = leaking_pair()
    rnd()
    del cluster.pods["a"]  # a node drain took it first
    d = rnd(60)
    assert d.action == "none" and cluster.evicted == []
    assert cluster.surge is None and cluster.deployment["spec"]["replicas"] == 2


# ---------------------------------------------------------------- with an autoscaler


def test_with_an_hpa_its_floor_is_raised_and_the_replicas_left_to_it() -> None:
    cluster, rnd = leaking_pair()
    cluster.hpas["embedserve"] = hpa("embedserve", 2, 6)
    assert rnd().action == "surge"
    assert cluster.hpas["embedserve"]["spec"]["minReplicas"] == 3
    assert cluster.deployment["spec"]["replicas"] == 2  # the HPA's to set, not ours
    # the HPA scales to its new floor, then further for load: two new pods
    cluster.deployment["spec"]["replicas"] = 4
    cluster.add_pod("c")
    cluster.add_pod("d", ready=True, phase="Running")
    d = rnd(30)  # one new pod ready is enough: as many ready as before without "a"
    assert d.action == "evict" and cluster.evicted == ["a"]
    assert cluster.hpas["embedserve"]["spec"]["minReplicas"] == 2
    assert cluster.deployment["spec"]["replicas"] == 4  # never touched
    assert [k for k, _ in cluster.patches if k.startswith("deployments")] == ["deployments/embedserve"] * 2


def test_with_keda_the_scaledobject_is_changed_not_its_hpa() -> None:
    cluster, rnd = leaking_pair()
    cluster.hpas["keda-hpa-embedserve"] = hpa("keda-hpa-embedserve", 2, 6, keda="embedserve")
    cluster.scaledobjects["embedserve"] = {
        "metadata": {"name": "embedserve"},
        "spec": {"minReplicaCount": 2, "maxReplicaCount": 6},
    }
    assert rnd().action == "surge"
    assert cluster.scaledobjects["embedserve"]["spec"]["minReplicaCount"] == 3
    assert cluster.hpas["keda-hpa-embedserve"]["spec"]["minReplicas"] == 2  # KEDA's, untouched
    cluster.add_pod("c", ready=True, phase="Running")
    assert rnd(30).action == "evict"
    assert cluster.scaledobjects["embedserve"]["spec"]["minReplicaCount"] == 2


def test_an_autoscaler_floor_changed_meanwhile_is_left_alone() -> None:
    cluster, rnd = leaking_pair()
    cluster.hpas["embedserve"] = hpa("embedserve", 2, 6)
    rnd()
    cluster.hpas["embedserve"]["spec"]["minReplicas"] = 4  # the operator's new floor
    cluster.add_pod("c", ready=True, phase="Running")
    assert rnd(30).action == "evict"
    assert cluster.hpas["embedserve"]["spec"]["minReplicas"] == 4
    assert rnd.steps()["restore_left"] == 1


def test_at_the_autoscalers_maximum_there_is_no_surge() -> None:
    cluster, rnd = leaking_pair()
    cluster.hpas["embedserve"] = hpa("embedserve", 2, 2)
    d = rnd()
    assert d.action == "evict" and cluster.evicted == ["a"]
    assert cluster.hpas["embedserve"]["spec"]["minReplicas"] == 2 and rnd.steps()["no_surge"] == 1


# ---------------------------------------------------------------- when not to surge


def test_no_room_declared_keeps_evict_first() -> None:
    cluster, rnd = leaking_pair(max_surge=0)  # the shipped Deployment: maxSurge 0
    d = rnd()
    assert d.action == "evict" and cluster.evicted == ["a"]
    assert cluster.deployment["spec"]["replicas"] == 2 and cluster.surge is None
    assert rnd.steps() == {"no_surge": 1, "evict": 1}
    cluster, rnd = leaking_pair(max_surge=0)
    rnd.cfg = ControllerSettings(surge="always")  # the operator knows there is a spare GPU
    assert rnd().action == "surge" and cluster.deployment["spec"]["replicas"] == 3
    cluster, rnd = leaking_pair()
    rnd.cfg = ControllerSettings(surge="never")
    assert rnd().action == "evict" and cluster.deployment["spec"]["replicas"] == 2


def test_one_replica_surges_too() -> None:
    """With replicas: 1 an eviction first would take the service down for a whole start."""
    cluster = FakeCluster([_pod("a")], replicas=1)
    rnd = Round(cluster, {"a": GPU_LEAK_WARNING})
    rnd.loads = {"a": 0.05}  # even idle: nobody else would serve
    assert rnd().action == "surge" and cluster.deployment["spec"]["replicas"] == 2
    cluster.add_pod("b", ready=True, phase="Running")
    assert rnd(60).action == "evict" and cluster.deployment["spec"]["replicas"] == 1


def test_no_surge_when_the_other_pods_carry_the_load() -> None:
    cluster, rnd = leaking_pair()
    rnd.loads = {"a": 0.3, "b": 0.4}  # 0.7 on one pod: under the 0.8 target
    d = rnd()
    assert d.action == "evict" and cluster.deployment["spec"]["replicas"] == 2
    cluster, rnd = leaking_pair()
    rnd.loads = {"a": 0.5, "b": 0.4}  # 0.9 on one pod: over it
    assert rnd().action == "surge"
    cluster, rnd = leaking_pair()
    rnd.loads = {"a": 0.1}  # b's load unread: assume it is needed
    assert rnd().action == "surge"


def test_a_drained_pod_is_evicted_without_a_surge() -> None:
    cluster = FakeCluster([_pod("a", ready=False), _pod("b")])
    rnd = Round(cluster, {"a": GPU_LEAK_WARNING})
    assert rnd().action == "evict" and cluster.deployment["spec"]["replicas"] == 2


@pytest.mark.parametrize("kinds", [{"deployments"}, {"horizontalpodautoscalers"}])
def test_a_role_from_before_surges_still_evicts(kinds: set[str]) -> None:
    """Without the rights to read the Deployment or its autoscalers: evict first, as before
    (never patch replicas an autoscaler might own)."""
    cluster, rnd = leaking_pair()
    cluster.forbidden = kinds
    assert rnd().action == "evict" and cluster.evicted == ["a"]
    assert cluster.deployment["spec"]["replicas"] == 2 and cluster.patches == []


@pytest.mark.parametrize("kinds", [{"deployments"}, {"horizontalpodautoscalers"}])
def test_a_role_that_may_read_but_not_patch_still_evicts(kinds: set[str]) -> None:
    """A Role that reads the Deployment and its HPA but may not patch one of them: the
    surge is refused before anything changed, so the pod is evicted first, as before, and
    no record is left for later rounds to wait on."""
    cluster, rnd = leaking_pair()
    cluster.hpas["embedserve"] = hpa("embedserve", 2, 6)
    cluster.read_only = kinds
    d = rnd()
    assert d.action == "evict" and cluster.evicted == ["a"]
    assert cluster.surge is None and cluster.hpas["embedserve"]["spec"]["minReplicas"] == 2
    assert rnd.steps() == {"no_surge": 1, "evict": 1}
    assert rnd(60).action == "wait"  # the pod terminating: no surge started later either


def test_dry_run_asks_the_server_to_dry_run_the_surge() -> None:
    cluster, rnd = leaking_pair()
    rnd.cfg = ControllerSettings(dry_run=True)
    d = rnd()
    assert d.action == "surge" and "dry run" in d.reason
    assert cluster.deployment["spec"]["replicas"] == 2 and cluster.surge is None and cluster.patches == []


# ---------------------------------------------------------------- pure parts


@pytest.mark.parametrize(
    ("strategy", "replicas", "expected"),
    [
        ({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0}}, 4, 0),
        ({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 2}}, 4, 2),
        ({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "10%"}}, 4, 1),  # rounded up
        ({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "0%"}}, 4, 0),
        ({}, 2, 1),  # Kubernetes' default 25%
        ({"type": "Recreate"}, 4, 0),
    ],
)
def test_max_surge(strategy: dict[str, Any], replicas: int, expected: int) -> None:
    assert surging.max_surge({"spec": {"replicas": replicas, "strategy": strategy}}) == expected


def test_owner_of_the_count() -> None:
    assert surging.owner_of("embedserve", []) == ("deployment", "embedserve")
    other = hpa("other", 1, 3)
    other["spec"]["scaleTargetRef"]["name"] = "another-app"
    assert surging.owner_of("embedserve", [other]) == ("deployment", "embedserve")
    assert surging.owner_of("embedserve", [other, hpa("h", 1, 3)]) == ("hpa", "h")
    assert surging.owner_of("embedserve", [hpa("keda-hpa-x", 1, 3, keda="x")]) == ("scaledobject", "x")


def test_an_unreadable_record_is_not_acted_on() -> None:
    assert surging.read_surge({"metadata": {"annotations": {SURGE_ANNOTATION: "{not json"}}}) is None
    assert surging.read_surge(None) is None


def test_the_load_is_read_from_the_gateways_metrics() -> None:
    page = "# TYPE embedserve_load gauge\nembedserve_load 0.75\n# TYPE x counter\nx_total 3\n"
    assert parse_load(page) == 0.75
    assert parse_load("# TYPE x counter\nx_total 3\n") is None
    assert parse_load("embedserve_load NaN\n") is None
    assert parse_load("{{{ not prometheus") is None


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("SURGE_TIMEOUT_S", "0"),
        ("SURGE_TIMEOUT_S", "-5"),
        ("SURGE_TIMEOUT_S", "inf"),  # would never fall back
        ("SURGE_POLL_S", "0"),
        ("TARGET_LOAD", "0"),
        ("TARGET_LOAD", "2.5"),
        ("TARGET_LOAD", "-1"),
        ("SURGE", "sometimes"),
    ],
)
def test_bad_settings_are_one_sentence_and_exit_2(
    var: str, value: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # no .env
    monkeypatch.setenv("EMBEDSERVE_CONTROLLER__" + var, value)
    assert cli.main(["restart-controller", "--once"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"embedserve: EMBEDSERVE_CONTROLLER__{var} must be ")
    assert lines[0].endswith(f", got '{value}'")


def test_outside_a_cluster_without_an_api_url_is_one_sentence_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("EMBEDSERVE_CONTROLLER__API_URL", raising=False)
    assert cli.main(["restart-controller", "--once"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("embedserve: EMBEDSERVE_CONTROLLER__API_URL must be set")


def test_a_bad_setting_exits_2_through_the_command(tmp_path: Path) -> None:
    env = {"EMBEDSERVE_CONTROLLER__SURGE_TIMEOUT_S": "0", "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [sys.executable, "-m", "embedserve", "restart-controller", "--once"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (
        "embedserve: EMBEDSERVE_CONTROLLER__SURGE_TIMEOUT_S must be a number above 0, got '0'")


def test_the_docs_show_the_sentence_the_command_prints(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/DEPLOY.md's example of a bad controller setting, run as it is written."""
    import re

    doc = (Path(__file__).resolve().parents[1] / "docs" / "DEPLOY.md").read_text()
    example = r"^\$ (EMBEDSERVE_CONTROLLER__\w+)=(\S+) embedserve (restart-controller .*)\n(.+)$"
    m = re.search(example, doc, re.M)
    assert m, "no example of a bad controller setting in docs/DEPLOY.md"
    var, value, command, shown = m.groups()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(var, value)
    assert cli.main(command.split()) == 2
    assert capsys.readouterr().err.strip() == shown


def test_target_load_bounds() -> None:
    assert ControllerSettings(target_load=2).target_load == 2
    assert ControllerSettings(target_load=0.01).target_load == 0.01
    for bad in (0, 2.0001):
        with pytest.raises(ValidationError):
            Settings(_env_file=None, controller={"target_load": bad})
