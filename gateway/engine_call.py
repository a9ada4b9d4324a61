"""The step every route shares once its inputs are token ids: refuse what the engines could not
finish before the deadline (413), admit within the tokens-in-flight bound (429), wait for the
coalesced engine calls under the deadline, and map the engines' failures to statuses.

``/v1/embeddings``, ``/v1/rerank`` and ``/v1/score`` all go through ``EngineCaller.run``, so a
rerank request takes its turn in the same coalescer and the same admission as embeddings.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from embedserve.contracts.hybrid import HybridOutputs, Output
from embedserve.contracts.wire import Matrix
from embedserve.core.admission import TokenAdmission
from embedserve.core.coalesce import Coalescer, StageTimes
from embedserve.gateway.errors import APIError
from embedserve.gateway.load import LoadSignal
from embedserve.gateway.metrics import GatewayMetrics
from embedserve.gateway.priority import count_waited
from embedserve.upstream.pool import EngineError, EngineTimeout

T = TypeVar("T")


class ServingGate:
    """Closed while the stack starts: requests get an immediate 503 with Retry-After
    instead of waiting behind the engines' start and warm-up."""

    def __init__(self) -> None:
        self.reason: str | None = None

    @property
    def is_open(self) -> bool:
        return self.reason is None

    def close(self, reason: str) -> None:
        self.reason = reason

    def open(self) -> None:
        self.reason = None

    def check(self) -> None:
        if self.reason is not None:
            raise APIError(
                503,
                f"The service is starting ({self.reason}); retry shortly",
                code="warming_up",
                headers={"Retry-After": "2"},
            )


class EngineCaller:
    """Admission, the capacity check, the deadline and the engines' errors for one engine pool."""

    def __init__(
        self,
        coalescer: Coalescer,
        admission: TokenAdmission,
        metrics: GatewayMetrics,
        load: LoadSignal,
        request_timeout_s: float,
    ) -> None:
        """``load``: the load signal, whose capacity (the engines' measured tokens per second)
        also bounds what one request may ask for."""
        self.coalescer = coalescer
        self.admission = admission
        self.metrics = metrics
        self.load = load
        self.request_timeout_s = request_timeout_s

    async def run(
        self, inputs: list[list[int]], param: str = "input", priority: int = 0
    ) -> tuple[Matrix, StageTimes]:
        """The engines' rows for ``inputs``, in order; ``APIError`` 413 / 429 / 503 / 504
        (``param``: the request field a 413 names; ``priority``: lower is served first)."""
        return await self._admitted(inputs, param, priority, lambda: self.coalescer.embed(inputs, priority))

    async def run_outputs(
        self, inputs: list[list[int]], outputs: tuple[Output, ...], param: str = "input", priority: int = 0
    ) -> tuple[HybridOutputs, StageTimes]:
        """``run``, for a model's ``outputs`` (sparse, ColBERT, with or without the dense vector)."""
        return await self._admitted(
            inputs, param, priority, lambda: self.coalescer.embed_outputs(inputs, outputs, priority)
        )

    async def _admitted(
        self, inputs: list[list[int]], param: str, priority: int,
        work: Callable[[], Awaitable[tuple[T, StageTimes]]],
    ) -> tuple[T, StageTimes]:
        total = sum(map(len, inputs))
        self._check_capacity(total, param)
        self.load.offered(total)
        if not self.admission.try_acquire(total):
            self.metrics.rejected.labels("tokens_in_flight").inc()
            self.load.refused(total)
            raise APIError(
                429,
                "The server is at capacity; retry shortly",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        self._in_flight_changed()
        try:
            async with asyncio.timeout(self.request_timeout_s):
                rows, times = await work()
            count_waited(self.metrics, priority, times)
            return rows, times
        except TimeoutError as exc:
            raise APIError(
                504, "The engine did not answer within the deadline", code="engine_timeout"
            ) from exc
        except EngineTimeout as exc:
            raise APIError(504, str(exc), code="engine_timeout") from exc
        except EngineError as exc:
            headers = {"Retry-After": "5"} if exc.status == 503 else None
            code = "engine_unavailable" if exc.status == 503 else "engine_rejected"
            raise APIError(exc.status, str(exc), code=code, headers=headers) from exc
        finally:
            self.admission.release(total)
            self._in_flight_changed()

    def _in_flight_changed(self) -> None:
        self.load.in_flight(self.admission.in_flight)

    def _check_capacity(self, total: int, param: str) -> None:
        """Refuse at once what the engines could not embed before the deadline, rather
        than compute it and answer 504 after the work was done. A request that fits one
        engine call is never refused here: it costs one call, whatever the estimate says."""
        rate = self.load.capacity()
        deadline = self.request_timeout_s
        one_call = self.coalescer.token_budget
        if rate is None or total <= max(rate * deadline, one_call):
            return
        self.metrics.rejected.labels("capacity").inc()
        raise APIError(
            413,
            f"This request has {total:,} tokens; the engines embed about {rate:,.0f} tokens/s "
            f"(measured over their recent work), so it would need about {total / rate:,.0f} s, "
            f"longer than the {deadline:g} s deadline. Send at most "
            f"{max(int(rate * deadline / 2), one_call):,} tokens per request.",
            param=param,
            code="request_exceeds_capacity",
        )
