"""Sources degrade instead of failing; history stays bounded; the Theil-Sen fit is exact."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedserve.config import HealthSettings
from embedserve.contracts.stats import EngineStats, write_stats
from embedserve.health.engine_view import EngineView
from embedserve.health.history import Event, History, Sample
from embedserve.health.monitor import MemoryMonitor
from embedserve.health.reading import SourceConfig
from embedserve.health.sources.cgroup import read_cgroup
from embedserve.health.sources.nvml import NvmlSource
from embedserve.health.sources.processes import read_processes
from embedserve.health.trend import peak_envelope, theil_sen


def test_nvml_absent_degrades(monkeypatch: pytest.MonkeyPatch) -> None:
    import pynvml

    def no_lib() -> None:
        raise pynvml.NVMLError_LibraryNotFound()

    monkeypatch.setattr(pynvml, "nvmlInit", no_lib)
    reading = NvmlSource().read()
    assert reading.available is False and reading.devices == []
    assert reading.reason is not None and "LibraryNotFound" in reading.reason


def test_cgroup_v2(tmp_path: Path) -> None:
    (tmp_path / "memory.current").write_text("3000\n")
    (tmp_path / "memory.max").write_text("10000\n")
    (tmp_path / "memory.stat").write_text("anon 2000\ninactive_file 500\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/\n")
    r = read_cgroup(tmp_path, proc)
    assert (r.version, r.current_bytes, r.working_set_bytes, r.limit_bytes) == (
        2,
        3000,
        2500,
        10000,
    )
    (tmp_path / "memory.max").write_text("max\n")
    assert read_cgroup(tmp_path, proc).limit_bytes is None


def test_cgroup_v1_and_absent(tmp_path: Path) -> None:
    mem = tmp_path / "memory"
    mem.mkdir()
    (mem / "memory.usage_in_bytes").write_text("4000")
    (mem / "memory.limit_in_bytes").write_text("9223372036854771712")  # v1 "unlimited"
    (mem / "memory.stat").write_text("total_inactive_file 1000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/\n")
    r = read_cgroup(tmp_path, proc)
    assert (r.version, r.working_set_bytes, r.limit_bytes) == (1, 3000, None)
    empty = tmp_path / "none"
    empty.mkdir()
    gone = read_cgroup(empty, proc)
    assert gone.available is False and gone.reason


def test_processes_missing_pid_is_named() -> None:
    found, missing = read_processes({"me": os.getpid(), "ghost": 2**22 + 12345})
    assert found["me"].rss_bytes > 0
    assert "ghost" in missing


def test_history_stays_bounded_for_a_week() -> None:
    h = History(max_samples=20_000)
    week = np.arange(0.0, 7 * 86400, 5.0)
    for t in week:
        h.append(Sample(float(t), {"host": 1.0}))
    assert len(h) <= 20_000
    t, _ = h.series("host")
    recent = t[t >= week[-1] - 6 * 3600]
    assert len(recent) == 6 * 3600 / 5 + 1  # the fitting window keeps full resolution
    assert t[0] < 86400  # old days survive, thinned


def test_history_persistence_roundtrip(tmp_path: Path) -> None:
    h = History(100)
    for i in range(30):
        h.append(Sample(float(i), {"gpu:0": float(i * 2)}))
    h.add_event(Event(3.0, "restart", "x"))
    h.save(tmp_path / "h.json")
    back = History.load(tmp_path / "h.json", 100)
    assert back.samples == h.samples
    assert list(back.events) == list(h.events)
    (tmp_path / "bad.json").write_text("{not json")
    assert len(History.load(tmp_path / "bad.json", 100)) == 0


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-1e9, 1e9, allow_nan=False), min_size=3, max_size=60),
    st.floats(0.8, 0.99),
)
def test_theil_sen_matches_scipy(ys: list[float], conf: float) -> None:
    from scipy import stats  # a dev dependency: this comparison never skips

    t = np.arange(len(ys), dtype=float) * 5.0
    y = np.asarray(ys)
    ours = theil_sen(t, y, conf)
    ref = stats.theilslopes(y, t, conf)
    assert ours.slope == pytest.approx(ref.slope, rel=1e-9, abs=1e-9)
    assert ours.low == pytest.approx(ref.low_slope, rel=1e-9, abs=1e-9)
    assert ours.high == pytest.approx(ref.high_slope, rel=1e-9, abs=1e-9)


def test_peak_envelope_trails_and_forgets() -> None:
    t = np.arange(0.0, 100.0)
    y = np.zeros(100)
    y[10] = 5.0  # a lone spike
    te, ye = peak_envelope(t, y, width_s=20.0, max_points=100)
    assert ye[te == 15.0][0] == 5.0
    assert ye[te == 40.0][0] == 0.0


def _monitor(tmp_path: Path) -> MemoryMonitor:
    health = HealthSettings(sample_interval_s=0.1)
    return MemoryMonitor(
        health,
        SourceConfig(stats_dir=str(tmp_path)),
        lambda: EngineView(ready=True, alive=True, started=True),
        lambda: {"engine": os.getpid()},
    )


def test_monitor_sees_restart_and_cache_clear(tmp_path: Path) -> None:
    stats = EngineStats(pid=os.getpid(), started_at=time.time() - 100, source="torch.cuda")
    stats.device, stats.reserved_bytes, stats.allocated_bytes = 0, 8 << 30, 6 << 30
    stats.inactive_split_bytes = 1 << 30
    write_stats(tmp_path, stats)
    m = _monitor(tmp_path)
    m.tick()
    assert m.history.events[-1].kind == "probe_start"
    assert m.history.events[-1].time == pytest.approx(stats.started_at)
    stats.cache_clears, stats.last_clear_time = 1, time.time()
    write_stats(tmp_path, stats)
    m.tick()
    assert m.history.events[-1].kind == "cache_clear"
    stats.started_at = time.time()  # same pid, new process start: a restart
    write_stats(tmp_path, stats)
    state = m.tick()
    assert m.history.events[-1].kind == "restart"
    doc = state.report
    assert doc.fragmentation == pytest.approx(1 / 8)
    assert doc.allocator is not None and doc.allocator[0].reserved_bytes == 8 << 30
    # no NVML here: the GPU forecast falls back to allocator reserved, without a limit
    if doc.gpu is None:
        assert doc.resources["gpu:0"].status == "no_limit"


def test_engines_from_stats_files_count_in_host_memory(tmp_path: Path) -> None:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        write_stats(tmp_path, EngineStats(pid=child.pid, source="cpu"))
        m = _monitor(tmp_path)
        m.process_pids = dict  # the gateway did not start this engine
        state = m.tick()
        assert state.reading.processes[f"engine[{child.pid}]"].rss_bytes > 0
        # an engine that is a child of a named process is not counted twice
        m.process_pids = lambda: {"gateway": os.getpid()}
        assert list(m.tick().reading.processes) == ["gateway"]
    finally:
        child.kill()
        child.wait()


def test_host_memory_counts_an_engine_under_the_gateway_once() -> None:
    from embedserve.contracts.memory import ProcessMemory
    from embedserve.health.reading import outermost

    procs = {  # under `up` the gateway's family holds its engine's
        "gateway": ProcessMemory(name="gateway", pid=10, rss_bytes=1_100, pids=[10, 11, 12]),
        "engine": ProcessMemory(name="engine", pid=11, rss_bytes=1_000, pids=[11, 12]),
        "other": ProcessMemory(name="other", pid=20, rss_bytes=50, pids=[20]),
        "again": ProcessMemory(name="again", pid=20, rss_bytes=50, pids=[20]),
    }
    assert sum(p.rss_bytes for p in outermost(procs)) == 1_150
