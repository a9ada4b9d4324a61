"""The autoscaling signal, embedserve_load, on an injected clock: the largest of offered over
the engines' measured tokens per second, the admission window's average fill, and offered
over admitted tokens while the pod refuses work; then on the CPU stack, along a closed-loop
ramp that the load generator reads it through."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from embedserve.config import BUNDLED_MODEL
from embedserve.gateway.load import REFUSING_SHARE, LoadCollector, LoadSignal
from embedserve.upstream.throughput import DecayedRate
from tests.conftest import start_stack


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def exported(signal: LoadSignal) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(LoadCollector({"m": signal}))
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


def offer_refusing(signal: LoadSignal, clock: Clock, tokens_per_s: float, share: float, seconds: int) -> None:
    """Requests of 64 tokens, ``share`` of them refused with 429, as the pipeline reports them."""
    per_tick, refused = tokens_per_s / 10 / 64, 0.0
    sent = 0.0
    for _ in range(seconds * 10):
        clock.t += 0.1
        sent += per_tick
        while sent >= 1:
            sent -= 1
            signal.offered(64)
            refused += share
            if refused >= 1:
                refused -= 1
                signal.refused(64)


def test_a_pod_that_refuses_work_reads_at_least_one() -> None:
    """Its clients back off after Retry-After, so little is offered and the window is far
    from full on average; but it answers 429: it is past its limit. The load is then the
    tokens offered over those admitted."""
    clock = Clock()
    signal = LoadSignal(lambda: 10_000.0, 1 << 20, half_life_s=15.0, clock=clock)
    offer_refusing(signal, clock, 2000, 0.2, 120)
    got = exported(signal)
    assert got["embedserve_offered_tokens_per_second"] == pytest.approx(2000, rel=0.05)
    assert got["embedserve_refused_tokens_per_second"] == pytest.approx(400, rel=0.05)
    assert got["embedserve_load"] == pytest.approx(1 / (1 - 0.2), rel=0.02)  # demand says 0.2
    offer_refusing(signal, clock, 2000, 0.5, 120)  # half turned away: two pods' worth
    assert exported(signal)["embedserve_load"] == pytest.approx(2.0, rel=0.02)


def test_refusals_count_from_one_in_a_hundred_and_only_while_they_last() -> None:
    clock = Clock()
    signal = LoadSignal(lambda: 10_000.0, 1 << 20, half_life_s=15.0, clock=clock)
    offer_refusing(signal, clock, 2000, 0.005, 120)  # a stray refusal: the demand alone
    assert exported(signal)["embedserve_load"] == pytest.approx(0.2, rel=0.05)
    offer_refusing(signal, clock, 2000, 0.02, 120)
    assert exported(signal)["embedserve_load"] == pytest.approx(1 / 0.98, rel=0.01)
    offer(signal, clock, 2000, 16)  # no refusal for more than a half-life
    assert exported(signal)["embedserve_load"] < 0.25
    offer_refusing(signal, clock, 2000, 0.3, 60)
    offer(signal, clock, 0, 16)  # idle: the shares would stay, the refusals are over
    assert exported(signal)["embedserve_load"] < 0.25


def test_a_pod_that_admits_nothing_reads_a_bounded_load() -> None:
    clock = Clock()
    signal = LoadSignal(lambda: None, 4096, half_life_s=15.0, clock=clock)
    for _ in range(100):
        clock.t += 0.1
        signal.offered(64)
        signal.refused(64)
    assert exported(signal)["embedserve_load"] == pytest.approx(1 / REFUSING_SHARE)


def test_decayed_rate_counts_wall_time() -> None:
    clock = Clock()
    rate = DecayedRate(half_life_s=1e9, clock=clock)
    assert rate.tokens_per_s() is None
    rate.add(100)
    clock.t += 10.0  # idle time counts: this is tokens per second of wall time
    rate.add(100)
    assert rate.tokens_per_s() == pytest.approx(20.0)


# ---------------------------------------------------------------- on the CPU stack

#: The ramp's request: one input of 64 tokens, against an admission bound of 512 tokens in
#: flight, so the ninth request in flight is the first the bound refuses.
RAMP_TOKENS, RAMP_BOUND = 64, 512


def _ramp_module() -> Any:
    """bench/cpu/autoscale_ramp.py, the benchmark this test is the short version of (bench/
    is no package: loaded from its file)."""
    path = Path(__file__).resolve().parents[1] / "bench" / "cpu" / "autoscale_ramp.py"
    spec = importlib.util.spec_from_file_location("autoscale_ramp", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_gauge_rises_with_the_load_and_crosses_one_where_429s_begin(tmp_path: Path) -> None:
    """A closed-loop ramp on the CPU stack (the bundled MiniLM), the load generator reading
    the gauge from the gateway's /metrics while it runs (`--gauge`): the gauge stays under 1
    up to a full admission window with nothing refused, and rises to 1 or more at the first
    step the bound refuses; where it reaches 1.0 is within 20% of where the 429s begin
    (docs/DEPLOY.md). As bench/cpu/autoscale_ramp.py does, the stack is primed first, so that
    the engines' capacity is measured on the ramp's own requests.

    The CPU engine embeds one call at a time, so one request in flight keeps it nearly busy:
    between 1 and 8 in flight only the queue grows, and the gauge (the engine's busy share)
    is not asked to rise there."""
    ramp = _ramp_module()
    crossing, prime, step = ramp.crossing, ramp.prime, ramp.step

    onset = RAMP_BOUND // RAMP_TOKENS + 1
    env = {
        "EMBEDSERVE_GATEWAY__MAX_TOKENS_IN_FLIGHT": str(RAMP_BOUND),
        "EMBEDSERVE_GATEWAY__REQUEST_TIMEOUT_S": "120",
    }
    stack = start_stack(BUNDLED_MODEL, tmp_path, env=env)
    # A step's readings are the gauge's averages (15 s half-life): after the 15 s warm-up they
    # weigh the step itself at least as much as the one before; the median of the 5 s read after
    # it, at 17.5 s, weighs it 0.55 (the benchmark's, 6 s then 20 s: 0.52). 10 s of priming at
    # 8 in flight embed ~50 times the tokens of up's warm-up call (512), so the measured capacity
    # is the ramp's own to ~1% (15 s: ~0.7%); at 8 in flight the load reads ~0.95
    # (results/autoscale-cpu/).
    a = argparse.Namespace(tokens=RAMP_TOKENS, inputs=1, seconds=5.0, warmup=15.0, prime=10.0, idle=0.0)
    try:
        prime(stack.url, a, onset - 1, tmp_path / "prime")
        rows = [step(stack.url, c, a, tmp_path / f"c{c}") for c in (1, onset - 1, onset)]
    finally:
        stack.stop()
    table = "\n".join(
        f"{r['concurrency']} in flight: load {r['load_median']}, 429 share {r['share_429']}, "
        f"capacity {r['capacity_tokens_per_s']}, offered {r['gateway_offered_tokens_per_s']}, "
        f"refused {r['gateway_refused_tokens_per_s']}, fill {r['admission_fill_median']}"
        for r in rows
    )
    print(f"\n{table}")
    one, full, over = rows
    assert all(r["load_median"] is not None for r in rows), table
    # nothing refused up to a full admission window; refusals from the next request on
    assert [one["share_429"], full["share_429"]] == [0, 0], table
    assert over["share_429"] > 0, table
    # under 1 while nothing is refused; past it, and above every earlier step, once the pod
    # refuses work
    assert max(one["load_median"], full["load_median"]) < 1.0 <= over["load_median"], table
    c = crossing(rows)
    assert c["onset_429"]["concurrency"] == onset, table
    assert c["within_20_percent"], (c, table)
