"""One round of the restart controller: observe the pods, ``decide``, and act through the
Kubernetes API (evict; where the Deployment can run one more pod, surge a replacement
first, surge.py), each step logged and counted (``ControllerMetrics``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from embedserve.config import ControllerSettings
from embedserve.contracts.surge import SURGE_ANNOTATION, Surge
from embedserve.controller import surge as surging
from embedserve.controller.kube import EvictionBlocked, KubeApi
from embedserve.controller.restart_decision import Decision, Observation, Policy, decide
from embedserve.controller.restart_observe import HealthFetcher, LoadFetcher, observe

log = logging.getLogger("embedserve.restart_controller")

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
