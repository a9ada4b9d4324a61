"""What the gateway tells the health probes about its engine, without touching the model."""

from __future__ import annotations

from dataclasses import dataclass

from embedserve.contracts.memory import EngineStatus


@dataclass(frozen=True)
class EngineView:
    """A cheap snapshot the gateway keeps up to date; probes only read it.

    ``alive``: the engine process exists and answers (its own schedule, not the probe's).
    ``oldest_inflight_age_s``: age of the oldest request the engine holds, ``None`` if idle.
    ``last_success_age_s``: seconds since the engine last returned a result.
    ``closed_for``: why the gateway does not serve yet though engines may be ready (its
    warm-up, an engine being replaced), ``None`` while it serves.
    """

    ready: bool
    alive: bool
    started: bool
    restarts: int = 0
    last_success_age_s: float | None = None
    oldest_inflight_age_s: float | None = None
    detail: str = ""
    engines: tuple[EngineStatus, ...] = ()
    replacements: int = 0
    closed_for: str | None = None
