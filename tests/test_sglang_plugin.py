"""Cache-clearing policy and the plugin's monitor, on CPU with a fake allocator."""

from __future__ import annotations

import json
import os
import sys
import tomllib
import types
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

from embedserve.config import CacheClearSettings
from embedserve.contracts.stats import read_all_stats
from embedserve.engines import sglang_plugin
from embedserve.engines.cache_policy import AllocatorSnapshot, CachePolicy
from embedserve.engines.sglang_plugin import Monitor

GB = 1 << 30
ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


def snap(alloc: float, reserved: float, split: float = 0) -> AllocatorSnapshot:
    return AllocatorSnapshot(int(alloc * GB), int(reserved * GB), int(split * GB))


# --- policy --------------------------------------------------------------------------------
def test_every_n_batches() -> None:
    p = CachePolicy(every_n_batches=4, fragmentation_ratio=None, unused_reserve_bytes=None)
    due = [b for b in range(1, 17) if p.decide(b, float(b), None)]
    assert due == [4, 8, 12, 16]
    assert not p.needs_snapshot


def test_every_batch_and_never() -> None:
    every = CachePolicy(every_n_batches=1, fragmentation_ratio=None, unused_reserve_bytes=None)
    assert all(every.decide(b, 0.0, None) == "every_n_batches" for b in range(1, 10))
    never = CachePolicy(every_n_batches=0, fragmentation_ratio=None, unused_reserve_bytes=None)
    assert not never.enabled
    assert all(never.decide(b, 0.0, snap(1, 100, 90)) is None for b in range(1, 10))


def test_fragmentation_threshold() -> None:
    p = CachePolicy(every_n_batches=0, fragmentation_ratio=0.25, unused_reserve_bytes=None)
    assert p.decide(1, 10.0, snap(10, 20, 4)) is None  # 0.2
    assert p.decide(1, 10.0, snap(10, 20, 6)) == "fragmentation"  # 0.3


def test_unused_reserve_counts_only_reclaimable() -> None:
    p = CachePolicy(every_n_batches=0, fragmentation_ratio=None, unused_reserve_bytes=4 * GB)
    assert p.decide(1, 0.0, snap(10, 20, 0)) == "unused_reserve"  # 10 GB free segments
    # 10 GB unused but 7 GB of it inside split segments: empty_cache can return only 3
    assert p.decide(1, 0.0, snap(10, 20, 7)) is None


def test_min_interval_throttles_thresholds_not_every_n() -> None:
    p = CachePolicy(every_n_batches=5, fragmentation_ratio=0.1, unused_reserve_bytes=None,
                    min_interval_s=2.0)
    bad = snap(1, 10, 5)
    assert p.decide(1, 100.0, bad) == "fragmentation"
    p.record_clear(100.0, "fragmentation", 2 * GB)
    assert p.decide(2, 101.0, bad) is None
    assert not p.thresholds_due(101.0)
    assert p.decide(5, 101.5, bad) == "every_n_batches"  # rhythm is not throttled
    p.record_clear(101.5, "every_n_batches", 0)
    assert p.decide(6, 103.6, bad) == "fragmentation"


def test_ineffective_clears_back_off_and_recover() -> None:
    p = CachePolicy(every_n_batches=0, fragmentation_ratio=0.1, unused_reserve_bytes=None,
                    min_interval_s=1.0, max_backoff=8)
    t = 0.0
    intervals = []
    for _ in range(6):
        p.record_clear(t, "fragmentation", 0)  # freed nothing
        intervals.append(p.threshold_interval_s())
    assert intervals == [2.0, 4.0, 8.0, 8.0, 8.0, 8.0]
    p.record_clear(t, "fragmentation", GB)
    assert p.threshold_interval_s() == 1.0


def test_from_settings() -> None:
    cs = CacheClearSettings(every_n_batches=3, fragmentation_ratio=None,
                            unused_reserve_bytes=GB, min_interval_s=0.5)
    p = CachePolicy.from_settings(cs)
    assert (p.every_n_batches, p.fragmentation_ratio, p.unused_reserve_bytes,
            p.min_interval_s) == (3, None, GB, 0.5)
    off = CachePolicy.from_settings(
        CacheClearSettings(every_n_batches=0, fragmentation_ratio=None, unused_reserve_bytes=None)
    )
    assert not off.enabled


def test_snapshot_properties() -> None:
    s = snap(2, 10, 3)
    assert s.unused == 8 * GB and s.reclaimable == 5 * GB
    assert s.fragmentation == pytest.approx(0.3)
    assert AllocatorSnapshot(0, 0, 0).fragmentation == 0.0


# --- monitor with a fake allocator ------------------------------------------------------
class FakeCuda:
    """reserved grows with each batch; empty_cache returns the free whole segments."""

    device = 0

    def __init__(self) -> None:
        self.allocated = 10 * GB
        self.reserved = 12 * GB
        self.split = 1 * GB
        self.calls: list[str] = []
        self.stats_calls = 0

    def memory_stats(self) -> dict[str, Any]:
        self.stats_calls += 1
        return {
            "allocated_bytes": {"all": {"current": self.allocated}},
            "reserved_bytes": {"all": {"current": self.reserved, "peak": 20 * GB}},
            "inactive_split_bytes": {"all": {"current": self.split}},
            "num_alloc_retries": 2,
            "num_ooms": 0,
        }

    def synchronize(self) -> None:
        self.calls.append("sync")

    def empty_cache(self) -> None:
        self.calls.append("empty")
        self.reserved = self.allocated + self.split

    def alloc(self, nbytes: int) -> bytes:
        self.allocated += nbytes
        self.reserved += nbytes
        return b""


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_monitor(tmp_path: Path, policy: CachePolicy, interval: float = 1.0):
    fake, clock = FakeCuda(), Clock()
    mon = Monitor(fake, policy, str(tmp_path), interval, clock=clock, wall=lambda: 5.0)
    return mon, fake, clock


def test_monitor_clears_every_n_and_publishes(tmp_path: Path) -> None:
    policy = CachePolicy(every_n_batches=3, fragmentation_ratio=None, unused_reserve_bytes=None)
    mon, fake, clock = make_monitor(tmp_path, policy, interval=10.0)
    for _ in range(7):
        fake.reserved += GB
        clock.t += 0.01
        mon.on_batch()
    assert mon.stats.batches == 7
    assert mon.stats.cache_clears == 2
    assert fake.calls == ["sync", "empty", "sync"] * 2  # synchronised both sides
    assert mon.stats.last_clear_freed_bytes == 3 * GB  # grew 3 GB since the first clear
    assert mon.stats.cache_clear_seconds_total >= 0
    (st,) = read_all_stats(tmp_path)
    assert st.pid == os.getpid() and st.source == "torch.cuda"
    assert st.cache_clears == 2 and st.batches == 6  # written at the forced clear
    assert st.allocated_bytes == 10 * GB and st.inactive_split_bytes == GB
    assert st.max_reserved_bytes == 20 * GB and st.num_alloc_retries == 2
    assert st.last_clear_time == 5.0


def test_monitor_rate_limits_stats(tmp_path: Path) -> None:
    policy = CachePolicy(every_n_batches=0, fragmentation_ratio=None, unused_reserve_bytes=None)
    mon, fake, clock = make_monitor(tmp_path, policy, interval=1.0)
    writes = 0
    for _ in range(100):
        clock.t += 0.05
        mon.on_batch()
    for _ in range(100):
        clock.t += 0.05
        writes += mon.maybe_publish()
    assert writes == 5  # 5 s of idle at 1 write/s
    assert fake.stats_calls <= 12  # no allocator query per batch when no threshold rule
    assert json.loads((tmp_path / f"engine-{os.getpid()}.json").read_text())["batches"] == 100


def test_monitor_threshold_rule_reads_stats(tmp_path: Path) -> None:
    policy = CachePolicy(every_n_batches=0, fragmentation_ratio=None,
                         unused_reserve_bytes=4 * GB, min_interval_s=1.0)
    mon, fake, clock = make_monitor(tmp_path, policy)
    mon.on_batch()
    assert mon.stats.cache_clears == 0
    fake.reserved = 20 * GB  # 9 GB reclaimable
    clock.t += 0.1
    mon.on_batch()
    assert mon.stats.cache_clears == 1 and mon.last_clear_reason == "unused_reserve"
    assert fake.reserved == 11 * GB


# --- hooks and registration -----------------------------------------------------------------
def test_hooks_never_raise(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    class Boom(FakeCuda):
        def memory_stats(self) -> dict[str, Any]:
            raise RuntimeError("allocator exploded")

    policy = CachePolicy(every_n_batches=1, fragmentation_ratio=None, unused_reserve_bytes=None)
    mon = Monitor(Boom(), policy, str(tmp_path), 1.0)
    monkeypatch.setattr(sglang_plugin, "_monitor", mon)
    sglang_plugin.after_batch("result", object(), "batch", "res")  # must not raise
    sglang_plugin.after_idle(None, object())


def test_no_cuda_is_a_clean_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sglang_plugin, "_monitor", None)
    monkeypatch.setattr(sglang_plugin, "_disabled", False)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sglang_plugin._get_monitor() is None
    assert sglang_plugin._disabled
    sglang_plugin.after_batch(None, object(), "batch", "res")


def _fake_sglang(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any, Any]]:
    registered: list[tuple[str, Any, Any]] = []

    class HookType:
        AFTER, AROUND = "after", "around"

    class HookRegistry:
        @classmethod
        def register(cls, target: str, hook: Any, hook_type: Any = "after") -> None:
            registered.append((target, hook, hook_type))

    mod = types.ModuleType("sglang.srt.plugins.hook_registry")
    mod.HookRegistry = HookRegistry  # type: ignore[attr-defined]
    mod.HookType = HookType  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt", "sglang.srt.plugins"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", mod)
    return registered


def test_register_hooks_only_for_embedserve_engines(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    registered = _fake_sglang(monkeypatch)
    monkeypatch.delenv("EMBEDSERVE_ENGINE__KIND", raising=False)
    sglang_plugin.register()
    assert registered == []
    monkeypatch.setenv("EMBEDSERVE_ENGINE__KIND", "sglang")
    sglang_plugin.register()
    assert [(t, h) for t, h, _ in registered] == [
        (sglang_plugin.BATCH_HOOK_TARGET, sglang_plugin.after_batch_release),
        (sglang_plugin.BATCH_HOOK_TARGET, sglang_plugin.after_batch),
        (sglang_plugin.IDLE_HOOK_TARGET, sglang_plugin.after_idle),
    ]
    assert all(ht == "after" for _, _, ht in registered)


def test_the_pooled_last_layer_adds_its_model_hooks_with_room_for_twice_the_batch(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from embedserve.engines import pooled_layer

    monkeypatch.chdir(tmp_path)
    registered = _fake_sglang(monkeypatch)
    monkeypatch.setenv("EMBEDSERVE_ENGINE__KIND", "sglang")
    monkeypatch.setenv("EMBEDSERVE_ENGINE__POOLED_LAST_LAYER", "true")
    monkeypatch.setenv("EMBEDSERVE_ENGINE__OVERLAP_SCHEDULE", "true")  # two batches in the engine
    sglang_plugin.register()
    model_hooks = [(t, h, k) for t, h, k in registered if ".models." in t]
    assert [t for t, _, _ in model_hooks] == [f"{c}.{m}" for c in pooled_layer.MODEL_CLASSES
                                              for m in ("__init__", "forward")]
    assert model_hooks[0][1].keywords == {"slots": 2 * 128 * 2} and model_hooks[1][2] == "around"


def test_the_vectorised_cross_encoder_adds_its_model_hook_only_when_asked(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from embedserve.engines import cross_encoder

    monkeypatch.chdir(tmp_path)
    registered = _fake_sglang(monkeypatch)
    monkeypatch.setenv("EMBEDSERVE_ENGINE__KIND", "sglang")
    sglang_plugin.register()
    assert not [t for t, _, _ in registered if ".models." in t]
    monkeypatch.setenv("EMBEDSERVE_ENGINE__VECTORISED_CROSS_ENCODER", "true")
    sglang_plugin.register()
    assert [(t, h, k) for t, h, k in registered if ".models." in t] == [
        (f"{cross_encoder.MODEL_CLASS}.__init__", cross_encoder.after_init, "after")]


def test_a_qwen3_reranker_engine_gets_its_score_head(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     tiny_reranker_dir: Path) -> None:
    """With its "yes" and "no" ids read from the model's tokenizer; other models get none."""
    from embedserve.core.pairs import label_ids
    from embedserve.engines import label_head

    monkeypatch.chdir(tmp_path)
    registered = _fake_sglang(monkeypatch)
    monkeypatch.setenv("EMBEDSERVE_ENGINE__KIND", "sglang")
    sglang_plugin.register()
    assert not [t for t, _, _ in registered if ".models." in t]
    monkeypatch.setenv("EMBEDSERVE_MODEL__PATH", str(tiny_reranker_dir))
    sglang_plugin.register()
    heads = [(t, h, k) for t, h, k in registered if ".models." in t]
    assert [(t, k) for t, _, k in heads] == [(f"{label_head.MODEL_CLASS}.__init__", "after")]
    no, yes = label_ids(tiny_reranker_dir)
    assert heads[0][1].func is label_head.after_init and heads[0][1].keywords == {"yes_id": yes, "no_id": no}


def test_hook_targets_exist_in_sglang_0_5_17() -> None:
    """The targets are methods that SGLang 0.5.17 defines, read from its wheel
    (tests/fixtures/extract_sglang_hooks.py), and the registry API the plugin calls exists."""
    sglang = json.loads((FIXTURES / "sglang_0.5.17_hooks.json").read_text())
    assert sglang["sglang"] == "0.5.17"
    targets = {sglang_plugin.BATCH_HOOK_TARGET, sglang_plugin.IDLE_HOOK_TARGET}
    assert targets <= sglang["methods"].keys(), targets - sglang["methods"].keys()
    assert "register" in sglang["hook_registry"]["HookRegistry"]
    assert "AFTER" in sglang["hook_registry"]["HookType"]


def test_sglang_pin_matches_the_fixture() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "sglang==0.5.17" in deps["gpu"]


def test_entry_point_is_registered() -> None:
    """SGLang's load_plugins() finds the plugin through this entry point group."""
    found = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert found.get("embedserve") == "embedserve.engines.sglang_plugin:register"
    (ep,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "embedserve"]
    assert ep.load() is sglang_plugin.register


def test_a_drill_grows_gpu_memory_at_its_rate_from_both_hooks(tmp_path: Path) -> None:
    fake, clock = FakeCuda(), Clock()
    policy = CachePolicy(every_n_batches=2, fragmentation_ratio=None, unused_reserve_bytes=None)
    mon = Monitor(fake, policy, str(tmp_path), 1.0, clock=clock, leak_bytes_per_s=GB / 60)
    start = fake.allocated
    mon.on_idle()  # the leak starts with the first hook call
    for _ in range(60):
        clock.t += 1.0
        if int(clock.t) % 2:
            mon.on_batch()
        else:
            mon.on_idle()
    assert fake.allocated - start == pytest.approx(GB, abs=16 * 2**20)
    assert mon.stats.cache_clears > 0  # clearing the cache frees nothing the leak holds
    assert fake.allocated - start >= GB - 16 * 2**20


def test_no_leak_without_the_drill(tmp_path: Path) -> None:
    policy = CachePolicy(every_n_batches=3, fragmentation_ratio=None, unused_reserve_bytes=None)
    mon, fake, clock = make_monitor(tmp_path, policy)
    start = fake.allocated
    for _ in range(10):
        clock.t += 60.0
        mon.on_idle()
    assert mon.leak is None and fake.allocated == start


# --- the overlap scheduler's full running batch (sglang#22518) ---------------------------------
class _Req:
    def __init__(self, done: bool) -> None:
        self.done = done

    def finished(self) -> bool:
        return self.done


class _Batch:
    def __init__(self, reqs: list[_Req], full: bool = True, prefill_only: bool = True) -> None:
        self.reqs, self.batch_is_full, self.is_prefill_only = reqs, full, prefill_only


class _Scheduler:
    def __init__(self, batch: _Batch | None) -> None:
        self.running_batch = batch


@pytest.mark.parametrize(("batch", "released"), [
    (_Batch([_Req(True), _Req(False)]), True),   # the last batch done, the current one running
    (_Batch([_Req(False), _Req(False)]), False),  # nothing finished: the batch really is full
    (_Batch([_Req(True)], full=False), False),    # not full: nothing to clear
    (_Batch([_Req(True)], prefill_only=False), False),  # a generation batch: SGLang's own rules
    (None, False),
])
def test_a_full_prefill_only_running_batch_is_released_once_it_holds_finished_requests(
    batch: _Batch | None, released: bool
) -> None:
    was_full = batch.batch_is_full if batch else None
    assert sglang_plugin.release_full_running_batch(_Scheduler(batch)) is released
    if batch is not None:
        assert batch.batch_is_full is (False if released else was_full)


def _batch_hooks(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The AFTER hooks ``register()`` puts on the batch target, in the order SGLang chains them."""
    registered = _fake_sglang(monkeypatch)
    monkeypatch.setenv("EMBEDSERVE_ENGINE__KIND", "sglang")
    sglang_plugin.register()
    return [h for t, h, _ in registered if t == sglang_plugin.BATCH_HOOK_TARGET]


def test_the_batch_hooks_release_the_running_batch_and_still_count_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    policy = CachePolicy(every_n_batches=0, fragmentation_ratio=None, unused_reserve_bytes=None)
    mon = Monitor(FakeCuda(), policy, str(tmp_path), 1.0)
    monkeypatch.setattr(sglang_plugin, "_monitor", mon)
    hooks = _batch_hooks(monkeypatch)

    def process(*args: Any) -> None:
        for hook in hooks:
            hook(None, *args)

    batch = _Batch([_Req(True), _Req(False)])
    process(_Scheduler(batch), "batch", "result")
    assert batch.batch_is_full is False and mon.stats.batches == 1
    process(object(), "batch", "result")  # no running batch: no error
    process()  # no scheduler at all
    assert mon.stats.batches == 3


class _BrokenReq:
    def finished(self) -> bool:
        raise AttributeError("'Req' object has no attribute 'finished_reason'")


def test_a_failed_release_is_raised_and_logged_every_time_whatever_the_statistics_did(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Statistics give up logging after a few errors and never stop the engine; the release is
    correctness-critical, so each failure is logged and stops the scheduler (SGLang then stops
    its server, and the engine is restarted), even after the statistics' errors went quiet."""
    monkeypatch.chdir(tmp_path)

    class Boom(FakeCuda):
        def memory_stats(self) -> dict[str, Any]:
            raise RuntimeError("allocator exploded")

    policy = CachePolicy(every_n_batches=1, fragmentation_ratio=None, unused_reserve_bytes=None)
    monkeypatch.setattr(sglang_plugin, "_monitor", Monitor(Boom(), policy, str(tmp_path), 0.0))
    monkeypatch.setattr(sglang_plugin, "_errors", 0)
    hooks = _batch_hooks(monkeypatch)
    healthy = _Scheduler(_Batch([_Req(False)]))
    for _ in range(10):  # the statistics fail past their logging budget, quietly
        for hook in hooks:
            hook(None, healthy, "batch", "result")
    assert sglang_plugin._errors == 10
    broken = _Scheduler(_Batch([_BrokenReq()]))  # type: ignore[list-item]
    for attempt in (1, 2):
        caplog.clear()
        with pytest.raises(AttributeError):
            for hook in hooks:
                hook(None, broken, "batch", "result")
        assert [r.levelname for r in caplog.records if "22518" in r.getMessage()] == ["CRITICAL"], attempt
