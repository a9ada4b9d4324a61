"""Kubernetes probe decisions, from the engine view and the last forecast only.

Readiness drains the pod: it fails when the engine cannot serve or memory runs out within
``warning_hours``. Liveness restarts it without draining: it fails only when the engine
is dead or hung, or memory runs out within ``critical_hours`` (by then readiness has long
drained the pod, so the restart costs no request). Startup passes once the engine started.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from embedserve.contracts.memory import Advice
from embedserve.health.engine_view import EngineView


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    reason: str
    checks: dict[str, Any] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"status": "ok" if self.ok else "fail", "reason": self.reason, **self.checks}


def _hours(advice: Advice | None) -> float | None:
    return None if advice is None else advice.estimated_hours_until_oom


def startup(view: EngineView) -> ProbeResult:
    if view.started:
        return ProbeResult(True, "engine started")
    return ProbeResult(False, f"engine starting: {view.detail or 'not started yet'}")


def readiness(view: EngineView, advice: Advice | None, warning_hours: float) -> ProbeResult:
    hours = _hours(advice)
    checks = {"engine_ready": view.ready, "hours_until_oom": hours, "warning_hours": warning_hours}
    if not view.ready and view.closed_for:
        return ProbeResult(
            False, f"not serving yet: {view.closed_for} ({view.detail or 'no detail'})", checks
        )
    if not view.ready:
        return ProbeResult(False, f"engine not ready: {view.detail or 'no detail'}", checks)
    if hours is not None and hours <= warning_hours:
        why = advice.reason if advice else ""
        return ProbeResult(False, f"out of memory forecast within {warning_hours:g} h: {why}", checks)
    return ProbeResult(True, "ready", checks)


def hung(view: EngineView, hang_after_s: float) -> bool:
    """Work has waited longer than ``hang_after_s`` and nothing completed meanwhile."""
    oldest = view.oldest_inflight_age_s
    if oldest is None or oldest <= hang_after_s:
        return False
    return view.last_success_age_s is None or view.last_success_age_s > hang_after_s


def liveness(
    view: EngineView, advice: Advice | None, critical_hours: float, hang_after_s: float
) -> ProbeResult:
    hours = _hours(advice)
    checks = {
        "engine_alive": view.alive,
        "oldest_inflight_age_s": view.oldest_inflight_age_s,
        "last_success_age_s": view.last_success_age_s,
        "hang_after_s": hang_after_s,
        "hours_until_oom": hours,
        "critical_hours": critical_hours,
    }
    if not view.alive:
        return ProbeResult(False, f"engine dead: {view.detail or 'no detail'}", checks)
    if hung(view, hang_after_s):
        return ProbeResult(
            False,
            f"engine hung: a request has waited {view.oldest_inflight_age_s:.0f} s "
            f"and none completed for over {hang_after_s:g} s",
            checks,
        )
    if hours is not None and hours <= critical_hours:
        return ProbeResult(False, f"out of memory forecast within {critical_hours:g} h (critical)", checks)
    return ProbeResult(True, "alive", checks)
