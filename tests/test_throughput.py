"""The measured capacity behind the 413 for requests that cannot finish in time: tokens per
second of busy time, from large calls only, on an injected clock."""

from __future__ import annotations

import math

import pytest

from embedserve.engines.throughput import Throughput


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_busy_time_not_wall_time() -> None:
    clock = Clock()
    tp = Throughput(min_tokens=100, half_life_s=1e9, clock=clock)
    assert tp.tokens_per_s() is None
    tp.started(1000)
    clock.t += 0.5
    tp.finished(1000, ok=True)
    clock.t += 100.0  # idle: no busy time
    tp.started(1000)
    tp.started(1000)  # two in flight at once: the engine pipelines them
    clock.t += 0.5
    tp.finished(1000, ok=True)
    tp.finished(1000, ok=True)
    assert tp.tokens_per_s() == pytest.approx(3000 / 1.0)


def test_small_calls_do_not_make_the_engine_look_slow() -> None:
    clock = Clock()
    tp = Throughput(min_tokens=100, half_life_s=1e9, clock=clock)
    tp.record(16_384, 0.25)  # the warm-up: one full batch
    for _ in range(50):  # light load: single short inputs, mostly fixed per-call time
        tp.started(8)
        clock.t += 0.01
        tp.finished(8, ok=True)
    assert tp.tokens_per_s() == pytest.approx(16_384 / 0.25)


def test_failed_calls_embed_nothing_and_old_figures_fade() -> None:
    clock = Clock()
    tp = Throughput(min_tokens=1, half_life_s=10.0, clock=clock)
    tp.record(1000, 1.0)
    tp.started(1000)
    clock.t += 1.0
    tp.finished(1000, ok=False)
    # the busy second just past, each instant decayed since: 10 / ln 2 x (1 - 0.5 ** 0.1)
    busy = 10 / math.log(2) * (1 - 0.5**0.1)
    assert tp.tokens_per_s() == pytest.approx(1000 * 0.5**0.1 / (1.0 * 0.5**0.1 + busy), rel=1e-6)
