"""The autoscaling signal, embedserve_load, on an injected clock: the larger of offered over
the engines' measured tokens per second and the admission window's average fill."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from embedserve.engines.throughput import DecayedRate
from embedserve.gateway.load import LoadCollector, LoadSignal


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def exported(signal: LoadSignal) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(LoadCollector(signal))
    text = generate_latest(registry).decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def offer(signal: LoadSignal, clock: Clock, tokens_per_s: float, seconds: int) -> None:
    for _ in range(seconds * 10):
        clock.t += 0.1
        signal.offered(int(tokens_per_s / 10))


def test_reads_one_at_capacity_and_follows_the_offered_rate() -> None:
    clock = Clock()
    signal = LoadSignal(lambda: 2000.0, 1 << 20, half_life_s=15.0, clock=clock)
    offer(signal, clock, 1000, 120)
    assert exported(signal)["embedserve_load"] == pytest.approx(0.5, rel=0.02)
    offer(signal, clock, 2000, 120)  # as much as the engines embed: sustainable capacity
    assert exported(signal)["embedserve_load"] == pytest.approx(1.0, rel=0.02)
    offer(signal, clock, 5000, 120)  # 2.5 x capacity: 429s count, so the excess shows
    got = exported(signal)
    assert got["embedserve_load"] == pytest.approx(2.5, rel=0.02)
    assert got["embedserve_offered_tokens_per_second"] == pytest.approx(5000, rel=0.02)
    assert got["embedserve_capacity_tokens_per_second"] == 2000


def test_forgets_a_burst_within_a_minute() -> None:
    clock = Clock()
    signal = LoadSignal(lambda: 1000.0, 1 << 20, half_life_s=15.0, clock=clock)
    offer(signal, clock, 3000, 60)
    offer(signal, clock, 0, 60)  # four half-lives of silence
    assert exported(signal)["embedserve_load"] < 3.0 / 2**3


def test_nothing_made_up_before_an_engine_is_ready_or_the_capacity_measured() -> None:
    clock = Clock()
    capacity: list[float | None] = [None]
    ready = [False]
    signal = LoadSignal(lambda: capacity[0], 1000, lambda: ready[0], clock=clock)
    signal.in_flight(300)
    offer(signal, clock, 500, 10)
    got = exported(signal)
    assert "embedserve_load" not in got and "embedserve_capacity_tokens_per_second" not in got
    assert got["embedserve_offered_tokens_per_second"] == pytest.approx(500, rel=0.05)
    ready[0] = True  # ready, capacity unknown: the admission fill alone
    assert exported(signal)["embedserve_load"] == pytest.approx(0.3, rel=0.01)
    capacity[0] = 1000.0
    assert exported(signal)["embedserve_load"] == pytest.approx(0.5, rel=0.05)


def test_a_full_admission_window_reads_one_whatever_the_capacity_says() -> None:
    """The engines look fast (the capacity is stale or wrong), but requests queue until the
    bound: the pod is at its limit, and 429s begin there."""
    clock = Clock()
    signal = LoadSignal(lambda: 1e6, 4096, half_life_s=15.0, clock=clock)
    signal.in_flight(2048)
    clock.t += 120
    got = exported(signal)
    assert got["embedserve_admission_fill"] == pytest.approx(0.5, rel=0.01)
    assert got["embedserve_load"] == pytest.approx(0.5, rel=0.01)
    for _ in range(600):  # the window full, half the time over by one request's worth
        signal.in_flight(4096)
        clock.t += 0.1
        signal.in_flight(4096 - 64)
        clock.t += 0.1
    assert exported(signal)["embedserve_load"] == pytest.approx(1.0, abs=0.01)
    signal.in_flight(0)
    clock.t += 60  # four half-lives empty
    assert exported(signal)["embedserve_admission_fill"] < 1 / 2**3


def test_the_larger_part_is_the_load() -> None:
    clock = Clock()
    signal = LoadSignal(lambda: 1000.0, 10_000, half_life_s=15.0, clock=clock)
    signal.in_flight(3000)
    offer(signal, clock, 500, 120)
    got = exported(signal)
    assert got["embedserve_load"] == pytest.approx(0.5, rel=0.02)  # demand 0.5 > fill 0.3
    signal.in_flight(9000)
    offer(signal, clock, 500, 120)
    assert exported(signal)["embedserve_load"] == pytest.approx(0.9, rel=0.02)  # fill 0.9


def test_decayed_rate_counts_wall_time() -> None:
    clock = Clock()
    rate = DecayedRate(half_life_s=1e9, clock=clock)
    assert rate.tokens_per_s() is None
    rate.add(100)
    clock.t += 10.0  # idle time counts: this is tokens per second of wall time
    rate.add(100)
    assert rate.tokens_per_s() == pytest.approx(20.0)
