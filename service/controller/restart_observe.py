"""What the restart controller sees each round: the serving pods from the API server, and
each pod's ``/health/memory`` verdict and load, read over HTTP from its gateway.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from embedserve.config import ControllerSettings
from embedserve.contracts.memory import MemoryReport
from embedserve.controller.kube import KubeApi
from embedserve.controller.restart_decision import MemoryVerdict, Observation, PodState


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


HealthFetcher = Callable[[PodState], Awaitable[MemoryVerdict]]
LoadFetcher = Callable[[PodState], Awaitable["float | None"]]


def pod_client(cfg: ControllerSettings) -> httpx.AsyncClient:
    headers = {}
    if cfg.health_api_key is not None:
        headers["Authorization"] = f"Bearer {cfg.health_api_key.get_secret_value()}"
    return httpx.AsyncClient(timeout=cfg.health_timeout_s, headers=headers)


def _pod_url(cfg: ControllerSettings, pod: PodState, path: str) -> str:
    assert pod.ip
    host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
    return f"{cfg.health_scheme}://{host}:{cfg.health_port}{path}"


def http_health_fetcher(cfg: ControllerSettings, client: httpx.AsyncClient | None = None) -> HealthFetcher:
    client = client or pod_client(cfg)

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
    client = client or pod_client(cfg)

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
