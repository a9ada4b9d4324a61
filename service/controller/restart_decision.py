"""The restart controller's pure decision: given each pod's state and ``/health/memory``
verdict, which pod to evict (or whether to wait). No I/O; ``restart_round.py`` acts on it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from embedserve.config import Settings

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


def _parse_time(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    from datetime import datetime

    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


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


def policy_from(settings: Settings) -> Policy:
    c = settings.controller
    return Policy(
        threshold_hours=c.threshold_hours or settings.health.warning_hours,
        follow_recommendation=c.follow_recommendation,
        min_pod_age_s=c.min_pod_age_s,
    )
