"""The load signal autoscalers scale on: ``embedserve_load``, the tokens this pod is offered
per second against the tokens its engines measurably embed per second.

It reads 1.0 when the pod is offered exactly what its engines can embed: its sustainable
capacity. Below that it is the engines' utilisation; above it, the demand the pod cannot
serve shows as a value over 1, because tokens refused with 429 count as offered too. That
makes it proportional to the load, which is what an autoscaler's arithmetic needs: the
replicas to run are the sum of every pod's load over the target load. Why this and not
queue wait: docs/DEPLOY.md ("Scaling past one pod").

Nothing is exported until the engines' capacity is measured (the start-up warm-up measures
it), so a starting pod never reports a made-up figure.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from embedserve.engines.throughput import DecayedRate

#: The offered rate's half-life: about one Prometheus scrape interval, so each scrape sees
#: the last few scrapes' traffic; the autoscalers smooth further (stabilisation windows).
OFFERED_HALF_LIFE_S = 15.0


class LoadSignal:
    """Offered tokens per second over the engines' measured tokens per second."""

    def __init__(
        self,
        capacity: Callable[[], float | None],
        half_life_s: float = OFFERED_HALF_LIFE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``capacity``: the ready engines' measured tokens per second (None while unknown)."""
        self.capacity = capacity
        self._offered = DecayedRate(half_life_s, clock)

    def offered(self, tokens: int) -> None:
        """A request of ``tokens`` reached admission (admitted or refused with 429)."""
        self._offered.add(tokens)

    def offered_per_s(self) -> float:
        return self._offered.tokens_per_s() or 0.0


class LoadCollector(Collector):
    """Exports the signal and both of its parts, so a dashboard shows why it moved."""

    def __init__(self, signal: LoadSignal) -> None:
        self.signal = signal

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        offered = self.signal.offered_per_s()
        yield GaugeMetricFamily(
            "embedserve_offered_tokens_per_second",
            f"Tokens of requests that reached admission, per second (half-life {OFFERED_HALF_LIFE_S:g} s)",
            value=offered,
        )
        capacity = self.signal.capacity()
        if not capacity:
            return
        yield GaugeMetricFamily(
            "embedserve_capacity_tokens_per_second",
            "Tokens the ready engines embed per second of busy time, measured",
            value=capacity,
        )
        yield GaugeMetricFamily(
            "embedserve_load",
            "Offered over measured tokens per second: 1.0 = the pod's sustainable capacity",
            value=offered / capacity,
        )
