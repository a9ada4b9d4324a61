"""The load signal autoscalers scale on: ``embedserve_load``, 1.0 when the pod is at its
sustainable capacity. It is the larger of two ratios that each read 1.0 at the pod's limit:

- **demand**: tokens offered per second (admitted or refused with 429) against the tokens
  the engines measurably embed per second. Proportional to the load, which is what an
  autoscaler's arithmetic needs (replicas = sum of the pods' load / the target), and above
  1 it says by how much the pod is short;
- **admission**: the tokens in flight, averaged over the last seconds, against the
  admission bound. It reaches 1.0 exactly where 429s begin, whatever the capacity estimate
  says: requests queue for the engines until the bound is full, so this is the queue's wait
  against the longest wait the pod accepts.

Both are averaged with a 15 s half-life. A pod with no ready engine exports no load (a
starting pod never reports a made-up figure); until the engines' capacity is measured
(``up``'s warm-up measures it at start, ``embedserve gateway`` from its first large calls)
the load is the admission fill alone. Why this signal: docs/DEPLOY.md ("Scaling past one
pod").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from embedserve.engines.throughput import DecayedRate

#: The averages' half-life: about one Prometheus scrape interval, so each scrape sees the
#: last few scrapes' traffic; the autoscalers smooth further (stabilisation windows).
HALF_LIFE_S = 15.0


class LoadSignal:
    """Offered over measured tokens per second, and the admission window's fill."""

    def __init__(
        self,
        capacity: Callable[[], float | None],
        admission_limit: int,
        ready: Callable[[], bool] = lambda: True,
        half_life_s: float = HALF_LIFE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``capacity``: the ready engines' measured tokens per second (None while unknown);
        ``admission_limit``: the tokens in flight past which requests get 429; ``ready``:
        whether an engine is ready to serve."""
        self.capacity = capacity
        self.admission_limit = admission_limit
        self.ready = ready
        self._offered = DecayedRate(half_life_s, clock)
        # token-seconds in flight per second: the average number of tokens in flight
        self._held = DecayedRate(half_life_s, clock)

    def offered(self, tokens: int) -> None:
        """A request of ``tokens`` reached admission (admitted or refused with 429)."""
        self._offered.add(tokens)

    def in_flight(self, tokens: int) -> None:
        """The tokens in flight changed to ``tokens``."""
        self._held.set_level(tokens)

    def offered_per_s(self) -> float:
        return self._offered.tokens_per_s() or 0.0

    def admission_fill(self) -> float:
        """Average tokens in flight over the admission bound."""
        return (self._held.tokens_per_s() or 0.0) / self.admission_limit


class LoadCollector(Collector):
    """Exports the signal and its parts, so a dashboard shows why it moved."""

    def __init__(self, signal: LoadSignal) -> None:
        self.signal = signal

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        offered, fill = self.signal.offered_per_s(), self.signal.admission_fill()
        yield GaugeMetricFamily(
            "embedserve_offered_tokens_per_second",
            f"Tokens of requests that reached admission, per second (half-life {HALF_LIFE_S:g} s)",
            value=offered,
        )
        yield GaugeMetricFamily(
            "embedserve_admission_fill",
            f"Tokens in flight over the admission bound, averaged (half-life {HALF_LIFE_S:g} s)",
            value=fill,
        )
        capacity = self.signal.capacity()
        if capacity:
            yield GaugeMetricFamily(
                "embedserve_capacity_tokens_per_second",
                "Tokens the ready engines embed per second of busy time, measured",
                value=capacity,
            )
        if self.signal.ready():
            yield GaugeMetricFamily(
                "embedserve_load",
                "The pod's load, 1.0 = its sustainable capacity: the larger of offered over measured "
                "tokens per second and the admission fill",
                value=max(offered / capacity if capacity else 0.0, fill),
            )
