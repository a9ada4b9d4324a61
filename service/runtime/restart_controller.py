"""Memory-aware rolling restarts on Kubernetes: evict one pod at a time, through the
Eviction API (which respects the PodDisruptionBudget), when its hours to out-of-memory run
low; where the Deployment can run one more pod, surge a replacement first (surge.py). Why
probes alone are not enough, and how to run it: docs/DEPLOY.md.

``decide`` is the pure decision; ``KubeApi`` the API calls; ``run_once`` wires them, one
round at a time, each step logged and counted (``ControllerMetrics``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from embedserve.config import ControllerSettings, Settings, load_settings
from embedserve.contracts.memory import MemoryReport
from embedserve.contracts.surge import SURGE_ANNOTATION, Surge
from embedserve.logs import setup_logging
from embedserve.runtime import surge as surging
from embedserve.runtime.kube import EvictionBlocked, KubeApi

log = logging.getLogger("embedserve.restart_controller")

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
    load: float | None = None  # the pod's embedserve_load, when read


@dataclass(frozen=True)
class Policy:
    threshold_hours: float
    follow_recommendation: bool = True
    min_pod_age_s: float = 600.0


@dataclass(frozen=True)
class Decision:
    action: Literal["evict", "wait", "none", "surge"]  # surge: one started or under way
    reason: str
    pod: str | None = None
    candidates: tuple[str, ...] = field(default=())


# --------------------------------------------------------------------------- parsing


def _parse_time(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    from datetime import datetime

    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def parse_health_memory(body: bytes | str) -> MemoryVerdict:
    """One pod's ``/health/memory`` answer, read with the model its producer writes. The
    top-level estimate is the binding (earliest) resource's."""
    try:
        report = MemoryReport.model_validate_json(body)
    except ValidationError as exc:
        return MemoryVerdict(reachable=False, reason=f"not a /health/memory report: {exc.errors()[0]['msg']}")
    return MemoryVerdict(
        reachable=True,
        hours_until_oom=report.estimated_hours_until_oom,
        hours_lower=report.hours_lower,
        recommends_restart=report.recommends_restart,
        resource=report.binding_resource,
        reason=report.reason,
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


# --------------------------------------------------------------------------- loop

HealthFetcher = Callable[[PodState], Awaitable[MemoryVerdict]]
LoadFetcher = Callable[[PodState], Awaitable["float | None"]]


def _pod_client(cfg: ControllerSettings) -> httpx.AsyncClient:
    headers = {}
    if cfg.health_api_key is not None:
        headers["Authorization"] = f"Bearer {cfg.health_api_key.get_secret_value()}"
    return httpx.AsyncClient(timeout=cfg.health_timeout_s, headers=headers)


def _pod_url(cfg: ControllerSettings, pod: PodState, path: str) -> str:
    assert pod.ip
    host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
    return f"{cfg.health_scheme}://{host}:{cfg.health_port}{path}"


def http_health_fetcher(cfg: ControllerSettings, client: httpx.AsyncClient | None = None) -> HealthFetcher:
    client = client or _pod_client(cfg)

    async def fetch(pod: PodState) -> MemoryVerdict:
        if not pod.ip:
            return MemoryVerdict(reachable=False, reason="pod has no IP")
        try:
            r = await client.get(_pod_url(cfg, pod, cfg.health_path))
            return parse_health_memory(r.content)
        except httpx.HTTPError as exc:
            return MemoryVerdict(reachable=False, reason=f"{type(exc).__name__}: {exc}")

    return fetch


def parse_load(text: str) -> float | None:
    """``embedserve_load`` of a gateway's /metrics page; None when absent (capacity not
    measured yet) or unreadable."""
    try:
        for family in text_string_to_metric_families(text):
            if family.name == "embedserve_load" and family.samples:
                value = float(family.samples[0].value)
                return value if math.isfinite(value) else None
    except ValueError:
        return None
    return None


def http_load_fetcher(cfg: ControllerSettings, client: httpx.AsyncClient | None = None) -> LoadFetcher:
    """Reads each pod's load (the gateway's /metrics), so that no surge is started when the
    other pods carry the load without the one being restarted."""
    client = client or _pod_client(cfg)

    async def fetch(pod: PodState) -> float | None:
        if not pod.ip or not pod.ready:
            return None
        try:
            r = await client.get(_pod_url(cfg, pod, "/metrics"))
        except httpx.HTTPError:
            return None
        return parse_load(r.text) if r.status_code == 200 else None

    return fetch


async def observe(
    api: KubeApi,
    fetch: HealthFetcher,
    label_selector: str,
    now: float | None = None,
    load: LoadFetcher | None = None,
) -> list[Observation]:
    now = time.time() if now is None else now
    pods = [PodState.from_api(p, now) for p in await api.list_pods(label_selector)]

    async def one(p: PodState) -> Observation:
        if p.terminating or p.phase != "Running":
            return Observation(p, MemoryVerdict(reachable=False, reason=p.phase))
        memory, value = await asyncio.gather(fetch(p), load(p) if load else _none())
        return Observation(p, memory, value)

    return list(await asyncio.gather(*(one(p) for p in pods)))


async def _none() -> None:
    return None


# --------------------------------------------------------------------------- metrics

#: Every step a round can take, each logged and counted under this label.
STEPS = (
    "evict",  # a pod evicted through the Eviction API
    "evict_blocked",  # the PodDisruptionBudget refused it: next round
    "no_surge",  # evicting without a replacement first (no room, not needed, or off)
    "surge",  # one more pod asked for
    "surge_wait",  # a round found the surge pod still starting
    "surge_ready",  # enough pods ready: the old one can go
    "surge_timeout",  # none ready within surge_timeout_s: evict without it
    "restore",  # the count given back
    "restore_left",  # someone else changed the count meanwhile: left as it is
)


class ControllerMetrics:
    """The controller's own /metrics (``controller.metrics_port``), in a registry of its own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.steps = Counter(
            "embedserve_restart_controller_steps",
            "Restart controller steps, by step",
            ["step"],
            registry=self.registry,
        )
        for step in STEPS:
            self.steps.labels(step)
        self.surging = Gauge(
            "embedserve_restart_controller_surge_in_progress",
            "1 while a surge pod is asked for and the old pod not yet evicted",
            registry=self.registry,
        )
        self.rounds = Counter(
            "embedserve_restart_controller_rounds", "Rounds, by outcome", ["action"], registry=self.registry
        )

    def step(self, step: str, message: str, level: int = logging.WARNING, **fields: Any) -> None:
        self.steps.labels(step).inc()
        log.log(level, message, extra={"step": step, **fields})


# --------------------------------------------------------------------------- a round


def _pod_loads(observations: list[Observation]) -> list[surging.PodLoad]:
    return [
        surging.PodLoad(o.pod.name, o.pod.ready, o.pod.terminating, o.pod.phase, o.load) for o in observations
    ]


async def _evict(
    api: KubeApi, cfg: ControllerSettings, decision: Decision, metrics: ControllerMetrics
) -> Decision:
    """Evict ``decision.pod``; a PDB refusal is a wait, not an error."""
    assert decision.pod is not None
    try:
        await api.evict(decision.pod, dry_run=cfg.dry_run)
    except EvictionBlocked as exc:
        metrics.step(
            "evict_blocked", f"eviction of {decision.pod} blocked by the PDB: {exc}", pod=decision.pod
        )
        return Decision("wait", f"eviction blocked: {exc}", decision.pod, decision.candidates)
    dry = " (dry run)" if cfg.dry_run else ""
    metrics.step("evict", f"evicted {decision.pod}{dry}: {decision.reason}", pod=decision.pod)
    return decision


async def _record(api: KubeApi, cfg: ControllerSettings, surge: Surge | None) -> None:
    value = None if surge is None else surge.model_dump_json()
    await api.annotate("deployment", cfg.deployment, SURGE_ANNOTATION, value)


async def _restore(api: KubeApi, surge: Surge, metrics: ControllerMetrics) -> None:
    """Give the count back, unless someone else (the operator, the autoscaler's owner) set
    it meanwhile: then theirs stands."""
    if await api.set_count(surge.owner, surge.name, expect=surge.surged, value=surge.before):
        metrics.step(
            "restore",
            f"{surge.owner}/{surge.name}: count back from {surge.surged} to {surge.before}",
            pod=surge.pod,
        )
    else:
        metrics.step(
            "restore_left",
            f"{surge.owner}/{surge.name}: count changed by someone else since the surge; left as it is",
            pod=surge.pod,
        )


async def _start_surge(
    api: KubeApi,
    cfg: ControllerSettings,
    decision: Decision,
    deployment: dict[str, Any],
    observations: list[Observation],
    now: float,
    metrics: ControllerMetrics,
) -> Decision | str:
    """Ask for one more pod before ``decision.pod`` goes, or say why not."""
    assert decision.pod is not None
    try:
        hpas = await api.list_hpas()
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code != 403:
            raise
        return "no right to list HorizontalPodAutoscalers, so whether one owns the replicas is unknown"
    owner, name = surging.owner_of(cfg.deployment, hpas)
    obj = deployment if owner == "deployment" else await api.get(owner, name)
    if obj is None:
        return f"the {owner} {name} that scales the Deployment cannot be read"
    plan = surging.plan(
        cfg, deployment, owner, name, obj, decision.pod, _pod_loads(observations), now, decision.reason
    )
    if isinstance(plan, str):
        return plan
    if cfg.dry_run:
        await api.set_count(owner, name, plan.before, plan.surged, dry_run=True)
        log.warning(
            "dry run: would surge %s/%s from %s to %s before evicting %s",
            owner,
            name,
            plan.before,
            plan.surged,
            plan.pod,
        )
        return Decision(
            "surge", f"dry run: surge {owner}/{name} to {plan.surged}", decision.pod, decision.candidates
        )
    try:
        await _record(api, cfg, plan)  # first, so a crash between the two calls leaves a trace
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code != 403:
            raise
        return f"no right to patch deployments/{cfg.deployment}, where a surge is recorded"
    why = f"the {owner} {name} changed while the surge was being asked for"
    try:
        raised = await api.set_count(owner, name, plan.before, plan.surged)
    except httpx.HTTPStatusError as exc:
        # Refused before anything changed: no surge. Any other failure leaves the record,
        # and the next rounds restore the count if it was set (the restore tests it first).
        if exc.response.status_code != 403:
            raise
        raised, why = False, f"no right to patch the {owner} {name} that holds the replica count"
    if not raised:
        await _record(api, cfg, None)
        return why
    metrics.step(
        "surge",
        f"surge: {owner}/{name} {plan.before} -> {plan.surged} before evicting {plan.pod}: {plan.reason}",
        pod=plan.pod,
        owner=owner,
    )
    return Decision(
        "surge", f"surge started: {owner}/{name} to {plan.surged}", decision.pod, decision.candidates
    )


async def _advance(
    api: KubeApi,
    cfg: ControllerSettings,
    surge: Surge,
    observations: list[Observation],
    now: float,
    metrics: ControllerMetrics,
) -> Decision:
    """One step of the surge in progress."""
    where, detail = surging.progress(surge, _pod_loads(observations), now, cfg.surge_timeout_s)
    evict = Decision("evict", surge.reason or "restart", pod=surge.pod)
    if where == "gone":
        if surge.phase == "surge":
            await _restore(api, surge, metrics)
        await _record(api, cfg, None)
        log.info("surge over: %s", detail, extra={"pod": surge.pod})
        return Decision("none", f"surge over: {detail}", surge.pod)
    if where == "wait":
        metrics.step("surge_wait", f"surge: waiting, {detail}", logging.INFO, pod=surge.pod)
        return Decision("surge", detail, surge.pod)
    if where == "ready":
        metrics.step("surge_ready", f"surge ready: {detail}", pod=surge.pod)
        done = await _evict(api, cfg, evict, metrics)
        if done.action == "evict":
            await _restore(api, surge, metrics)
            await _record(api, cfg, None)
        return done
    if where == "timeout":
        metrics.step("surge_timeout", f"surge timed out: {detail}", pod=surge.pod)
        await _restore(api, surge, metrics)
        surge = surge.model_copy(update={"phase": "fallback"})
        await _record(api, cfg, surge)
    done = await _evict(api, cfg, evict, metrics)  # fallback: as without surges
    if done.action == "evict":
        await _record(api, cfg, None)
    return done


async def _read_deployment(api: KubeApi, cfg: ControllerSettings) -> dict[str, Any] | None:
    """None when it is absent or not ours to read (a Role without deployments get/patch,
    from before surges): the controller then evicts first, as it always did."""
    try:
        return await api.get("deployment", cfg.deployment)
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code != 403:
            raise
        log.warning(
            "no right to read deployments/%s: no surges (see deploy/k8s/restart-controller.yaml)",
            cfg.deployment,
        )
        return None


async def run_once(
    api: KubeApi,
    fetch: HealthFetcher,
    cfg: ControllerSettings,
    policy: Policy,
    load: LoadFetcher | None = None,
    metrics: ControllerMetrics | None = None,
    clock: Callable[[], float] = time.time,
) -> Decision:
    metrics = metrics or ControllerMetrics()
    now = clock()
    observations = await observe(api, fetch, cfg.label_selector, now, load)
    for o in observations:
        m = o.memory
        log.info(
            "pod=%s ready=%s hours=%s lower=%s recommends_restart=%s reachable=%s load=%s %s",
            o.pod.name,
            o.pod.ready,
            m.hours_until_oom,
            m.hours_lower,
            m.recommends_restart,
            m.reachable,
            o.load,
            m.reason,
        )
    deployment = await _read_deployment(api, cfg)
    surge = surging.read_surge(deployment)
    if surge is not None:
        decision = await _advance(api, cfg, surge, observations, now, metrics)
    else:
        decision = decide(observations, policy)
        if decision.action == "evict" and decision.pod is not None:
            decision = await _restart(api, cfg, decision, deployment, observations, now, metrics)
        else:
            log.info("%s: %s", decision.action, decision.reason)
    metrics.surging.set(decision.action == "surge" and not cfg.dry_run)
    metrics.rounds.labels(decision.action).inc()
    return decision


async def _restart(
    api: KubeApi,
    cfg: ControllerSettings,
    decision: Decision,
    deployment: dict[str, Any] | None,
    observations: list[Observation],
    now: float,
    metrics: ControllerMetrics,
) -> Decision:
    """Surge before evicting ``decision.pod`` where there is room; else evict it now."""
    why = "the Deployment cannot be read"
    if deployment is not None:
        started = await _start_surge(api, cfg, decision, deployment, observations, now, metrics)
        if isinstance(started, Decision):
            return started
        why = started
    metrics.step("no_surge", f"no surge before evicting {decision.pod}: {why}", pod=decision.pod)
    return await _evict(api, cfg, decision, metrics)


def policy_from(settings: Settings) -> Policy:
    c = settings.controller
    return Policy(
        threshold_hours=c.threshold_hours or settings.health.warning_hours,
        follow_recommendation=c.follow_recommendation,
        min_pod_age_s=c.min_pod_age_s,
    )


async def _amain(settings: Settings, once: bool, interval_s: float) -> int:
    cfg = settings.controller
    policy = policy_from(settings)
    api = KubeApi.in_cluster(cfg)
    client = _pod_client(cfg)
    fetch, load = http_health_fetcher(cfg, client), http_load_fetcher(cfg, client)
    metrics = ControllerMetrics()
    if cfg.metrics_port is not None:
        start_http_server(cfg.metrics_port, registry=metrics.registry)
    log.info(
        "restart controller: selector=%r threshold=%.2f h surge=%s dry_run=%s",
        cfg.label_selector,
        policy.threshold_hours,
        cfg.surge,
        cfg.dry_run,
    )
    try:
        while True:
            action = "none"
            try:
                action = (await run_once(api, fetch, cfg, policy, load, metrics)).action
            except httpx.HTTPError as exc:
                log.error("round failed: %s", exc)
                if once:
                    return 1
            if once:
                return 0
            # While a surge pod starts, look again soon: it evicts the old pod once ready.
            await asyncio.sleep(cfg.surge_poll_s if action == "surge" else interval_s)
    finally:
        await client.aclose()
        await api.aclose()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="embedserve restart-controller",
        description="Evict one embedserve pod at a time when its hours-to-OOM run low, "
        "surging a replacement first where the Deployment has room.",
    )
    p.add_argument("--once", action="store_true", help="one round, then exit (CronJob)")
    p.add_argument("--interval", type=float, default=60.0, help="seconds between rounds")
    args = p.parse_args(argv)
    settings = load_settings()  # a mistake: one sentence and exit 2, from embedserve's main
    setup_logging(settings.log_level, settings.log_format)
    return asyncio.run(_amain(settings, args.once, args.interval))


if __name__ == "__main__":
    raise SystemExit(main())
