"""Memory health: sources, bounded history, hours-to-OOM forecast, probes and metrics.

The gateway mounts it::

    components = create_health(settings, registry, engine_view, process_pids)
    app.include_router(components.router)
    # lifespan: await components.start() ... await components.stop()

See docs/HEALTH.md for the forecast rules and the probe horizons.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import APIRouter
from prometheus_client import CollectorRegistry

from embedserve.config import Settings
from embedserve.health.engine_view import EngineView
from embedserve.health.metrics import HealthCollector
from embedserve.health.monitor import MemoryMonitor, MemoryState
from embedserve.health.reading import SourceConfig
from embedserve.health.router import build_router

__all__ = ["EngineView", "HealthComponents", "MemoryState", "create_health"]


@dataclass
class HealthComponents:
    router: APIRouter
    monitor: MemoryMonitor

    async def start(self) -> None:
        """Start the background sampler (call from the app's lifespan)."""
        await self.monitor.start()

    async def stop(self) -> None:
        await self.monitor.stop()

    @property
    def state(self) -> MemoryState | None:
        return self.monitor.state


def create_health(
    settings: Settings,
    registry: CollectorRegistry,
    engine_view: Callable[[], EngineView],
    process_pids: Callable[[], dict[str, int]],
    *,
    source_config: SourceConfig | None = None,
    hang_after_s: float | None = None,
) -> HealthComponents:
    """Router, sampler and metrics for one app; nothing runs until ``start()``.

    ``engine_view`` must be cheap and non-blocking (probes call it per request);
    ``process_pids`` names the processes whose memory counts, e.g.
    ``{"gateway": os.getpid(), "engine": launcher_pid}`` (children are included).
    """
    monitor = MemoryMonitor(
        settings.health,
        source_config or SourceConfig.from_settings(settings),
        engine_view,
        process_pids,
    )
    registry.register(HealthCollector(monitor))
    hang = hang_after_s or settings.hang_after_s()
    return HealthComponents(router=build_router(monitor, engine_view, hang), monitor=monitor)
