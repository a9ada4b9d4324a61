"""Surge before evict: before the restart controller evicts a serving pod, it asks for one
more pod, waits until that pod is ready, evicts the old one and gives the count back, so
a memory-aware restart never costs serving capacity.

Only the decisions live here (pure, on what the API server and the pods said); the
restart controller makes the calls. Who holds the count, and why that is the one raised:
docs/DEPLOY.md ("Scaling past one pod").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from embedserve.config import ControllerSettings
from embedserve.contracts.surge import SURGE_ANNOTATION, Owner, Surge


@dataclass(frozen=True)
class PodLoad:
    """What the surge decisions need of one serving pod."""

    name: str
    ready: bool
    terminating: bool
    phase: str = "Running"
    load: float | None = None  # its embedserve_load; None when unread


def owner_of(deployment: str, hpas: Sequence[Mapping[str, Any]]) -> tuple[Owner, str]:
    """Who sets the Deployment's replicas: the HPA that targets it, or the KEDA ScaledObject
    that made that HPA (KEDA rewrites its HPA, so the ScaledObject is the one to change), or
    nobody but the Deployment itself."""
    for hpa in hpas:
        ref = hpa.get("spec", {}).get("scaleTargetRef", {})
        if ref.get("kind") == "Deployment" and ref.get("name") == deployment:
            for owner in hpa.get("metadata", {}).get("ownerReferences") or []:
                if owner.get("kind") == "ScaledObject" and str(owner.get("apiVersion", "")).startswith(
                    "keda.sh/"
                ):
                    return "scaledobject", str(owner["name"])
            return "hpa", str(hpa["metadata"]["name"])
    return "deployment", deployment


def count_of(owner: Owner, obj: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(the count a surge raises, the most replicas allowed): the Deployment's replicas
    (no ceiling), an HPA's minReplicas and maxReplicas, a ScaledObject's minReplicaCount
    and maxReplicaCount (KEDA's default maximum is 100)."""
    spec = obj.get("spec", {})
    if owner == "deployment":
        return int(spec.get("replicas", 1)), None
    if owner == "hpa":
        return int(spec.get("minReplicas", 1)), int(spec["maxReplicas"])
    low = spec.get("minReplicaCount")
    return (None if low is None else int(low)), int(spec.get("maxReplicaCount", 100))


def max_surge(deployment: Mapping[str, Any]) -> int:
    """Pods the Deployment may run above its replicas during a rollout: the operator's own
    statement of spare room (Kubernetes' default is 25%, rounded up; Recreate allows none)."""
    spec = deployment.get("spec", {})
    strategy = spec.get("strategy") or {}
    if strategy.get("type") == "Recreate":
        return 0
    value = (strategy.get("rollingUpdate") or {}).get("maxSurge", "25%")
    if isinstance(value, str) and value.endswith("%"):
        return math.ceil(float(value[:-1]) * int(spec.get("replicas", 1)) / 100)
    return int(value)


def read_surge(deployment: Mapping[str, Any] | None) -> Surge | None:
    """The surge in progress recorded on the Deployment; None when there is none (or the
    record is unreadable: then it is not ours to act on)."""
    raw = ((deployment or {}).get("metadata", {}).get("annotations") or {}).get(SURGE_ANNOTATION)
    if not raw:
        return None
    try:
        return Surge.model_validate_json(raw)
    except ValidationError:
        return None


def plan(
    cfg: ControllerSettings,
    deployment: Mapping[str, Any],
    owner: Owner,
    owner_name: str,
    owner_obj: Mapping[str, Any],
    target: str,
    pods: Sequence[PodLoad],
    now: float,
    reason: str = "",
) -> Surge | str:
    """The surge to start before evicting ``target``, or why there is none (the pod is
    then evicted first, as without surges)."""
    if cfg.surge == "never":
        return "surge is off (EMBEDSERVE_CONTROLLER__SURGE=never)"
    by_name = {p.name: p for p in pods}
    if target not in by_name or not by_name[target].ready:
        return f"{target} is not ready: evicting it costs no serving capacity"
    if cfg.surge == "auto" and max_surge(deployment) < 1:
        return "the Deployment's maxSurge is 0: no spare GPU declared (EMBEDSERVE_CONTROLLER__SURGE=always)"
    replicas = int(deployment.get("spec", {}).get("replicas", 1))
    count, ceiling = count_of(owner, owner_obj)
    surged = max(replicas, count or 0) + 1
    if ceiling is not None and surged > ceiling:
        return f"the {owner} {owner_name} is at its maximum of {ceiling} replicas"
    ready = [p for p in pods if p.ready and not p.terminating]
    loads = [p.load for p in ready]
    if len(ready) >= 2 and all(v is not None for v in loads):
        after = sum(v for v in loads if v is not None) / (len(ready) - 1)
        if after <= cfg.target_load:
            return (
                f"the other {len(ready) - 1} ready pods carry the load without {target} "
                f"({after:.2f} each, target {cfg.target_load:g})"
            )
    return Surge(
        pod=target,
        owner=owner,
        name=owner_name,
        before=count,
        surged=surged,
        ready_before=len(ready),
        started_at=now,
        reason=reason,
    )


Progress = Literal["gone", "fallback", "ready", "timeout", "wait"]


def progress(surge: Surge, pods: Sequence[PodLoad], now: float, timeout_s: float) -> tuple[Progress, str]:
    """Where a surge stands:

    - ``gone``: the pod to evict is gone or terminating (evicted, by us or a drain);
    - ``fallback``: it timed out earlier and the pod is evicted without a replacement;
    - ``ready``: as many other pods are ready as were ready, the pod included, before the
      surge (the autoscaler may have added some; any counts): evict it now;
    - ``timeout``: no such pod within the timeout (no spare GPU, a failed start);
    - ``wait``: the surge pod is still starting.
    """
    target = next((p for p in pods if p.name == surge.pod), None)
    if target is None or target.terminating:
        return "gone", f"{surge.pod} is gone"
    if surge.phase == "fallback":
        return "fallback", f"the surge timed out; evicting {surge.pod} without it"
    others = [p for p in pods if p.name != surge.pod and not p.terminating]
    ready = sum(p.ready for p in others)
    if ready >= surge.ready_before:
        return "ready", f"{ready} other pods ready (were {surge.ready_before} with {surge.pod})"
    waited = now - surge.started_at
    starting = ", ".join(f"{p.name} ({p.phase})" for p in others if not p.ready) or "none yet"
    if waited >= timeout_s:
        return "timeout", f"no pod ready after {waited:.0f} s (starting: {starting})"
    return "wait", f"{ready} of {surge.ready_before} pods ready after {waited:.0f} s; starting: {starting}"
