"""The load signal autoscalers scale on: ``embedserve_load``, 1.0 when the pod is at its
sustainable capacity. It is the largest of three parts that each read 1.0 at the pod's limit:

- **demand**: tokens offered per second (admitted or refused with 429) against the tokens
  the engines measurably embed per second. Proportional to the load, which is what an
  autoscaler's arithmetic needs (replicas = sum of the pods' load / the target), and above
  1 it says by how much the pod is short;
- **admission**: the tokens in flight, averaged over the last seconds, against the
  admission bound: requests queue for the engines until the bound is full, so this is the
  queue's wait against the longest wait the pod accepts. An average: it approaches 1.0 as
  the window fills, and stays under it;
- **refusal**: while the pod refuses work (429 for at least ``REFUSING_SHARE`` of the
  tokens offered, the last refusal within one half-life), the tokens offered over those it
  admitted: at least 1, and 2 when it turns half away. A pod that answers 429 is past its
  limit whatever the other parts say: its clients back off after ``Retry-After``, so what
  they offer falls as the refusals begin, and 429s come from bursts that the averages
  smooth away.

All are averaged with a 15 s half-life. A pod with no ready engine exports no load (a
starting pod never reports a made-up figure); until the engines' capacity is measured
(``up``'s warm-up measures it at start, ``embedserve gateway`` from its first large calls)
the demand part is left out. Why this signal: docs/DEPLOY.md ("Scaling past one pod").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from embedserve.upstream.throughput import DecayedRate

#: The averages' half-life: about one Prometheus scrape interval, so each scrape sees the
#: last few scrapes' traffic; the autoscalers smooth further (stabilisation windows).
HALF_LIFE_S = 15.0
#: The share of offered tokens refused with 429 from which the pod counts as refusing work
#: (the load then reads at least 1): one request in a hundred, not a stray burst's one.
REFUSING_SHARE = 0.01


class LoadSignal:
    """Offered over measured tokens per second, the admission window's fill, and offered
    over admitted tokens while the pod refuses work."""

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
        self.half_life_s = half_life_s
        self._clock = clock
        self._offered = DecayedRate(half_life_s, clock)
        self._refused = DecayedRate(half_life_s, clock)
        self._last_refusal: float | None = None
        # token-seconds in flight per second: the average number of tokens in flight
        self._held = DecayedRate(half_life_s, clock)

    def offered(self, tokens: int) -> None:
        """A request of ``tokens`` reached admission (admitted or refused with 429)."""
        self._offered.add(tokens)

    def refused(self, tokens: int) -> None:
        """A request of ``tokens``, already counted as offered, was refused with 429."""
        self._refused.add(tokens)
        self._last_refusal = self._clock()

    def in_flight(self, tokens: int) -> None:
        """The tokens in flight changed to ``tokens``."""
        self._held.set_level(tokens)

    def offered_per_s(self) -> float:
        return self._offered.tokens_per_s() or 0.0

    def refused_per_s(self) -> float:
        return self._refused.tokens_per_s() or 0.0

    def admission_fill(self) -> float:
        """Average tokens in flight over the admission bound."""
        return (self._held.tokens_per_s() or 0.0) / self.admission_limit

    def refusal(self) -> float:
        """Offered over admitted tokens while the pod refuses work, else 0."""
        last = self._last_refusal
        if last is None or self._clock() - last > self.half_life_s:
            return 0.0
        offered, refused = self.offered_per_s(), self.refused_per_s()
        if offered <= 0 or refused < REFUSING_SHARE * offered:
            return 0.0
        # everything refused (the window held by calls that do not end): as if 1% got in
        return offered / max(offered - refused, REFUSING_SHARE * offered)

    def value(self) -> float:
        """The load: the largest part (demand only once the capacity is measured)."""
        capacity = self.capacity()
        demand = self.offered_per_s() / capacity if capacity else 0.0
        return max(demand, self.admission_fill(), self.refusal())


class LoadCollector(Collector):
    """Exports the signal and its parts, so a dashboard shows why it moved. With several models
    (each has a signal of its own) the pod's figures are their sums (tokens per second), the
    largest fill and the largest load (the pod is at capacity once one model is), exported only
    while every model has a ready engine; ``embedserve_model_load{model}`` has each one's."""

    def __init__(self, signals: dict[str, LoadSignal]) -> None:
        self.signals = signals

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        signals = list(self.signals.values())
        yield GaugeMetricFamily(
            "embedserve_offered_tokens_per_second",
            f"Tokens of requests that reached admission, per second (half-life {HALF_LIFE_S:g} s)",
            value=sum(s.offered_per_s() for s in signals),
        )
        yield GaugeMetricFamily(
            "embedserve_refused_tokens_per_second",
            f"Tokens of requests refused with 429 at admission, per second (half-life {HALF_LIFE_S:g} s)",
            value=sum(s.refused_per_s() for s in signals),
        )
        yield GaugeMetricFamily(
            "embedserve_admission_fill",
            f"Tokens in flight over the admission bound, averaged (half-life {HALF_LIFE_S:g} s)",
            value=max(s.admission_fill() for s in signals),
        )
        capacities = [s.capacity() for s in signals]
        if all(capacities):
            yield GaugeMetricFamily(
                "embedserve_capacity_tokens_per_second",
                "Tokens the ready engines embed per second of busy time, measured",
                value=sum(c for c in capacities if c),
            )
        per_model = GaugeMetricFamily("embedserve_model_load", "Each served model's load", labels=["model"])
        for name, signal in self.signals.items():
            if signal.ready():
                per_model.add_metric([name], signal.value())
        yield per_model
        if all(s.ready() for s in signals):
            yield GaugeMetricFamily(
                "embedserve_load",
                "The pod's load, 1.0 = its sustainable capacity: the largest of offered over measured "
                "tokens per second, the admission fill, and offered over admitted tokens while it refuses",
                value=max(s.value() for s in signals),
            )
