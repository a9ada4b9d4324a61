"""Memory-aware rolling restarts on Kubernetes: evict one pod at a time, through the
Eviction API (which respects the PodDisruptionBudget), when its hours to out-of-memory run
low. Why probes alone are not enough, and how to run it: docs/DEPLOY.md.

``decide`` is the pure decision; ``KubeApi`` the two API calls; ``run_once`` wires them.
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
from pydantic import ValidationError

from embedserve.config import ControllerSettings, Settings
from embedserve.contracts.memory import MemoryReport
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
            return parse_health_memory(r.content)
        except httpx.HTTPError as exc:
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
