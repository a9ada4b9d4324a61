"""Memory-aware rolling restarts: evict one pod at a time when its hours-to-OOM run low.

Why this exists (the long answer is in docs/DEPLOY.md): readiness drains a pod whose
forecast falls under the warning horizon, and liveness restarts it under the critical
horizon, but neither respects the PodDisruptionBudget, neither restarts a *drained* pod
whose growth stopped because its traffic stopped, and both can hit every replica at once
when they all grew together. This controller turns the forecast into a paced rolling
restart through the Eviction API, which the API server refuses (HTTP 429) whenever the
PDB would be violated.

Pieces, each small:
- :func:`parse_health_memory` reads one pod's ``GET /health/memory`` answer.
- :func:`decide` is the pure decision: given every pod's Kubernetes state and health
  verdict, evict at most one pod, and only when no other restart is under way.
- :class:`KubeApi` is plain HTTPS to the API server with the service account's token
  (httpx; no kubernetes client dependency: two calls do not justify 40 MB of client).
- :func:`run_once` wires them; ``python -m service.restart_controller --once`` runs it
  as a CronJob, ``--interval 60`` as a long-running sidecar or Deployment.

Configuration is ``EMBEDSERVE_CONTROLLER__*`` plus the shared ``EMBEDSERVE_HEALTH__*``
(the threshold defaults to ``health.warning_hours``, the horizon at which the readiness
probe drains a pod, so the probe, the alert and the controller agree).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from service.settings import ControllerSettings, Settings

log = logging.getLogger("embedserve.restart_controller")

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


# --------------------------------------------------------------------------- config


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class MemoryVerdict:
    """What one pod's /health/memory said, reduced to what the decision needs."""

    reachable: bool
    hours_until_oom: float | None = None  # None: not growing / unknown
    hours_lower: float | None = None  # lower bound of the estimate, when given
    recommends_restart: bool = False
    resource: str | None = None
    reason: str = ""

    def needs_restart(self, threshold_hours: float, follow_recommendation: bool) -> bool:
        if not self.reachable:
            return False
        if follow_recommendation and self.recommends_restart:
            return True
        # <=, as the readiness probe (health/probes.py) and the PrometheusRule compare.
        return self.hours_until_oom is not None and self.hours_until_oom <= threshold_hours

    @property
    def urgency(self) -> float:
        """Smaller is more urgent."""
        if self.hours_until_oom is not None:
            return self.hours_until_oom
        return 0.0 if self.recommends_restart else math.inf


@dataclass(frozen=True)
class PodState:
    """A pod as the API server reports it."""

    name: str
    ip: str | None
    phase: str
    ready: bool
    terminating: bool
    age_s: float

    @classmethod
    def from_api(cls, obj: Mapping[str, Any], now: float) -> PodState:
        meta = obj.get("metadata", {})
        status = obj.get("status", {})
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
        )
        created = _parse_time(meta.get("creationTimestamp"))
        return cls(
            name=meta.get("name", "?"),
            ip=status.get("podIP"),
            phase=status.get("phase", "Unknown"),
            ready=ready,
            terminating=meta.get("deletionTimestamp") is not None,
            age_s=max(0.0, now - created) if created is not None else math.inf,
        )


@dataclass(frozen=True)
class Observation:
    pod: PodState
    memory: MemoryVerdict


@dataclass(frozen=True)
class Policy:
    threshold_hours: float
    follow_recommendation: bool = True
    min_pod_age_s: float = 600.0


@dataclass(frozen=True)
class Decision:
    action: Literal["evict", "wait", "none"]
    reason: str
    pod: str | None = None
    candidates: tuple[str, ...] = field(default=())


# --------------------------------------------------------------------------- parsing


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    f = float(value)
    return None if math.isnan(f) or math.isinf(f) else f


def _parse_time(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    from datetime import datetime

    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _resource_entries(body: Mapping[str, Any]) -> Iterable[tuple[str, Mapping[str, Any]]]:
    """Per-resource forecasts, wherever the answer keeps them."""
    for key in ("resources", "forecasts", "forecast"):
        block = body.get(key)
        if isinstance(block, Mapping):
            for name, entry in block.items():
                if isinstance(entry, Mapping):
                    yield str(name), entry
    for name in ("gpu", "host"):
        entry = body.get(name)
        if isinstance(entry, Mapping):
            yield name, entry


def _hours_of(entry: Mapping[str, Any]) -> tuple[float | None, float | None]:
    hours = _num(entry.get("estimated_hours_until_oom", entry.get("hours_until_oom")))
    lower: float | None = None
    for key in ("estimated_hours_until_oom_lower", "hours_lower", "lower_hours", "lower"):
        lower = _num(entry.get(key))
        if lower is not None:
            break
    bounds = entry.get("bounds") or entry.get("interval")
    if lower is None and isinstance(bounds, Mapping):
        lower = _num(bounds.get("lower"))
    elif lower is None and isinstance(bounds, list | tuple) and bounds:
        lower = _num(bounds[0])
    return hours, lower


def parse_health_memory(body: Any) -> MemoryVerdict:
    """Reduce a /health/memory answer to a verdict.

    Reads the fields issue 4 defines: ``estimated_hours_until_oom`` (top level: the
    binding resource; or per resource under ``resources``/``forecast``), its lower bound,
    ``recommends_restart``, the binding resource's name and ``reason``. The binding
    (smallest) estimate wins. A missing or null estimate means "not growing".
    """
    if not isinstance(body, Mapping):
        return MemoryVerdict(reachable=False, reason="answer is not a JSON object")
    hours, lower = _hours_of(body)
    resource = body.get("binding_resource") or body.get("resource")
    for name, entry in _resource_entries(body):
        h, lo = _hours_of(entry)
        if h is None:
            continue
        if hours is None or h < hours:
            hours, lower, resource = h, lo, name
        elif h == hours and lower is None:
            lower, resource = lo, resource or name
    recommends = body.get("recommends_restart")
    if not isinstance(recommends, bool):
        forecast = body.get("forecast")
        recommends = bool(isinstance(forecast, Mapping) and forecast.get("recommends_restart") is True)
    reason = body.get("reason")
    return MemoryVerdict(
        reachable=True,
        hours_until_oom=hours,
        hours_lower=lower,
        recommends_restart=recommends,
        resource=str(resource) if resource else None,
        reason=reason if isinstance(reason, str) else "",
    )


# --------------------------------------------------------------------------- decision


def decide(observations: list[Observation], policy: Policy) -> Decision:
    """At most one eviction, and only when nothing else is restarting.

    - A pod that is terminating, not yet running, or unready for a reason other than
      its memory forecast means a restart (ours or anyone's) is under way: wait.
    - A pod whose health endpoint cannot be read is left alone (liveness owns hung
      pods); if it is also unready we wait, since capacity is already reduced.
    - Otherwise evict the most urgent pod whose forecast is under the threshold (or
      that recommends a restart), skipping pods younger than ``min_pod_age_s``.
    """
    if not observations:
        return Decision("none", "no pods match the selector")

    candidates = [
        o
        for o in observations
        if not o.pod.terminating
        and o.pod.phase == "Running"
        and o.memory.needs_restart(policy.threshold_hours, policy.follow_recommendation)
    ]
    candidate_names = {o.pod.name for o in candidates}

    busy: list[str] = []
    for o in observations:
        if o.pod.terminating:
            busy.append(f"{o.pod.name} is terminating")
        elif o.pod.phase != "Running":
            busy.append(f"{o.pod.name} is {o.pod.phase}")
        elif not o.pod.ready and o.pod.name not in candidate_names:
            why = "health unreachable" if not o.memory.reachable else "starting or unhealthy"
            busy.append(f"{o.pod.name} is not ready ({why})")
    if busy:
        return Decision(
            "wait",
            "restart under way or capacity reduced: " + "; ".join(busy),
            candidates=tuple(sorted(candidate_names)),
        )

    if not candidates:
        return Decision("none", f"all {len(observations)} pods above the threshold")

    old_enough = [o for o in candidates if o.pod.age_s >= policy.min_pod_age_s]
    if not old_enough:
        return Decision(
            "wait",
            "candidates are younger than min_pod_age_s: " + ", ".join(o.pod.name for o in candidates),
            candidates=tuple(sorted(candidate_names)),
        )
    # Unready (already drained) pods first: evicting them costs no serving capacity.
    target = min(old_enough, key=lambda o: (o.pod.ready, o.memory.urgency, -o.pod.age_s))
    m = target.memory
    hours = "unknown" if m.hours_until_oom is None else f"{m.hours_until_oom:.2f} h"
    why = f"hours to OOM {hours} (threshold {policy.threshold_hours:g} h)"
    if m.resource:
        why += f" on {m.resource}"
    if m.recommends_restart:
        why += ", restart recommended"
    if m.reason:
        why += f": {m.reason}"
    return Decision("evict", why, pod=target.pod.name, candidates=tuple(sorted(candidate_names)))


# --------------------------------------------------------------------------- Kubernetes


class EvictionBlocked(Exception):
    """The API server refused the eviction (PDB would be violated): try next round."""


class KubeApi:
    """The two calls the controller needs, as plain HTTPS with a bearer token."""

    def __init__(
        self,
        base_url: str,
        namespace: str,
        token: str | None,
        verify: str | bool = True,
        timeout_s: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.namespace = namespace
        self._client = httpx.AsyncClient(
            base_url=base_url,
            headers=headers,
            verify=verify,
            timeout=timeout_s,
            transport=transport,
        )

    @classmethod
    def in_cluster(cls, cfg: ControllerSettings) -> KubeApi:
        """Service-account token, CA and namespace from the pod's mounted secret."""
        token = (SA_DIR / "token").read_text().strip() if (SA_DIR / "token").exists() else None
        namespace = cfg.namespace
        if namespace is None and (SA_DIR / "namespace").exists():
            namespace = (SA_DIR / "namespace").read_text().strip()
        base = cfg.api_url
        if base is None:
            host = os.environ.get("KUBERNETES_SERVICE_HOST")  # set by the kubelet
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise RuntimeError("not in a cluster: set EMBEDSERVE_CONTROLLER__API_URL")
            base = f"https://{host}:{port}"
        ca = SA_DIR / "ca.crt"
        return cls(
            base,
            namespace or "default",
            token,
            verify=str(ca) if ca.exists() else True,
            timeout_s=cfg.api_timeout_s,
        )

    async def list_pods(self, label_selector: str) -> list[dict[str, Any]]:
        r = await self._client.get(
            f"/api/v1/namespaces/{self.namespace}/pods",
            params={"labelSelector": label_selector},
        )
        r.raise_for_status()
        items = r.json().get("items", [])
        return [i for i in items if isinstance(i, dict)]

    async def evict(self, pod: str, dry_run: bool = False) -> None:
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": pod, "namespace": self.namespace},
        }
        if dry_run:
            body["deleteOptions"] = {"dryRun": ["All"]}
        r = await self._client.post(f"/api/v1/namespaces/{self.namespace}/pods/{pod}/eviction", json=body)
        if r.status_code == 429:
            raise EvictionBlocked(_message(r))
        if r.status_code == 404:
            log.info("pod %s is already gone", pod)
            return
        r.raise_for_status()

    async def aclose(self) -> None:
        await self._client.aclose()


def _message(r: httpx.Response) -> str:
    try:
        return str(r.json().get("message", r.text))
    except ValueError:
        return r.text


# --------------------------------------------------------------------------- loop

HealthFetcher = Callable[[PodState], Awaitable[MemoryVerdict]]


def http_health_fetcher(cfg: ControllerSettings) -> HealthFetcher:
    headers = {}
    if cfg.health_api_key is not None:
        headers["Authorization"] = f"Bearer {cfg.health_api_key.get_secret_value()}"
    client = httpx.AsyncClient(timeout=cfg.health_timeout_s, headers=headers)

    async def fetch(pod: PodState) -> MemoryVerdict:
        if not pod.ip:
            return MemoryVerdict(reachable=False, reason="pod has no IP")
        host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
        url = f"{cfg.health_scheme}://{host}:{cfg.health_port}{cfg.health_path}"
        try:
            r = await client.get(url)
            return parse_health_memory(r.json())
        except (httpx.HTTPError, ValueError) as exc:
            return MemoryVerdict(reachable=False, reason=f"{type(exc).__name__}: {exc}")

    return fetch


async def observe(
    api: KubeApi, fetch: HealthFetcher, label_selector: str, now: float | None = None
) -> list[Observation]:
    now = time.time() if now is None else now
    pods = [PodState.from_api(p, now) for p in await api.list_pods(label_selector)]

    async def one(p: PodState) -> Observation:
        if p.terminating or p.phase != "Running":
            return Observation(p, MemoryVerdict(reachable=False, reason=p.phase))
        return Observation(p, await fetch(p))

    return list(await asyncio.gather(*(one(p) for p in pods)))


async def run_once(api: KubeApi, fetch: HealthFetcher, cfg: ControllerSettings, policy: Policy) -> Decision:
    observations = await observe(api, fetch, cfg.label_selector)
    for o in observations:
        m = o.memory
        log.info(
            "pod=%s ready=%s hours=%s lower=%s recommends_restart=%s reachable=%s %s",
            o.pod.name,
            o.pod.ready,
            m.hours_until_oom,
            m.hours_lower,
            m.recommends_restart,
            m.reachable,
            m.reason,
        )
    decision = decide(observations, policy)
    if decision.action == "evict" and decision.pod is not None:
        try:
            await api.evict(decision.pod, dry_run=cfg.dry_run)
            log.warning(
                "evicted %s%s: %s",
                decision.pod,
                " (dry run)" if cfg.dry_run else "",
                decision.reason,
            )
        except EvictionBlocked as exc:
            log.warning("eviction of %s blocked by the PDB: %s", decision.pod, exc)
            return Decision("wait", f"eviction blocked: {exc}", decision.pod, decision.candidates)
    else:
        log.info("%s: %s", decision.action, decision.reason)
    return decision


def policy_from(settings: Settings) -> Policy:
    c = settings.controller
    return Policy(
        threshold_hours=c.threshold_hours or settings.health.warning_hours,
        follow_recommendation=c.follow_recommendation,
        min_pod_age_s=c.min_pod_age_s,
    )


async def _amain(once: bool, interval_s: float) -> int:
    settings = Settings()
    cfg = settings.controller
    policy = policy_from(settings)
    api = KubeApi.in_cluster(cfg)
    fetch = http_health_fetcher(cfg)
    log.info(
        "restart controller: selector=%r threshold=%.2f h dry_run=%s",
        cfg.label_selector,
        policy.threshold_hours,
        cfg.dry_run,
    )
    try:
        while True:
            try:
                await run_once(api, fetch, cfg, policy)
            except httpx.HTTPError as exc:
                log.error("round failed: %s", exc)
                if once:
                    return 1
            if once:
                return 0
            await asyncio.sleep(interval_s)
    finally:
        await api.aclose()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="embedserve restart-controller",
        description="Evict one embedserve pod at a time when its hours-to-OOM run low.",
    )
    p.add_argument("--once", action="store_true", help="one round, then exit (CronJob)")
    p.add_argument("--interval", type=float, default=60.0, help="seconds between rounds")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    return asyncio.run(_amain(args.once, args.interval))


if __name__ == "__main__":
    raise SystemExit(main())
