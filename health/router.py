"""The four health endpoints. Each reads the last state and the engine view: no I/O."""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from embedserve.contracts.memory import MemoryReport
from embedserve.health import probes
from embedserve.health.engine_view import EngineView
from embedserve.health.monitor import MemoryMonitor


def _document(report: MemoryReport) -> Response:
    """Serialised by pydantic in Rust; FastAPI's response_model would validate it again."""
    return Response(report.model_dump_json(), media_type="application/json")


def _respond(result: probes.ProbeResult) -> JSONResponse:
    return JSONResponse(result.body(), status_code=200 if result.ok else 503)


def _view(engine_view: Callable[[], EngineView]) -> EngineView:
    try:
        return engine_view()
    except Exception as exc:  # a broken view must not turn a probe into a 500
        return EngineView(ready=False, alive=True, started=False, detail=f"engine view: {exc}")


def build_router(
    monitor: MemoryMonitor, engine_view: Callable[[], EngineView], hang_after_s: float
) -> APIRouter:
    router = APIRouter(tags=["health"])
    health = monitor.health

    @router.get("/health/memory", response_model=MemoryReport)
    async def memory() -> Response:
        state = monitor.state
        if state is None:
            return _document(MemoryReport.collecting())
        view = _view(engine_view)
        report = state.report.model_copy(
            update={
                "age_s": max(time.time() - state.time, 0.0),
                "engines": list(view.engines),
                "replacements": view.replacements,
            }
        )
        return _document(report)

    @router.get("/health/live")
    async def live() -> JSONResponse:
        state = monitor.state
        return _respond(
            probes.liveness(
                _view(engine_view),
                state.advice if state else None,
                health.critical_hours,
                hang_after_s,
            )
        )

    @router.get("/health/ready")
    async def ready() -> JSONResponse:
        state = monitor.state
        return _respond(
            probes.readiness(_view(engine_view), state.advice if state else None, health.warning_hours)
        )

    @router.get("/health/startup")
    async def startup() -> JSONResponse:
        return _respond(probes.startup(_view(engine_view)))

    return router
