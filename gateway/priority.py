"""Request priority, as vLLM and SGLang take it: an integer, lower first, default 0. Every route
accepts it; the coalescer orders waiting work by it (``service/core/coalesce.py``) and ages it, so
less urgent work is delayed, never starved. Admission is blind to it: a request past the
tokens-in-flight bound gets 429 whatever its priority."""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictInt

from embedserve.core.coalesce import StageTimes
from embedserve.gateway.metrics import GatewayMetrics

Priority = StrictInt
#: The field every request body carries.
PRIORITY: Any = Field(
    0,
    description="lower is served first (vLLM's meaning); waiting work is ordered by it, and a "
    "request that has waited gateway.priority_aging_s goes ahead of its priority",
)
#: Priorities beyond this are one label each side, so a client cannot grow /metrics without bound.
LABEL_LIMIT = 10


def priority_label(priority: int) -> str:
    """The metrics' label: the priority itself within ±``LABEL_LIMIT``, else the limit."""
    return str(max(-LABEL_LIMIT, min(LABEL_LIMIT, priority)))


def count_waited(metrics: GatewayMetrics, priority: int, times: StageTimes) -> None:
    """A request's wait for the engines, by priority (the aged ones are counted as they age)."""
    metrics.priority_queue_seconds.labels(priority_label(priority)).observe(times.queue_s)
