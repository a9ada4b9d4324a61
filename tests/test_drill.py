"""Memory-aware restarts without Kubernetes: `up` replaces an engine before it runs out of
memory, with no request lost, shown by a leak drill on the CPU stack; the decision itself on
reports; bad drill input exits 2."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from embedserve.config import BUNDLED_MODEL, Settings
from embedserve.contracts.memory import MemoryReport, ResourceForecast
from embedserve.engines.drill import LEAK_ENV, Leak, parse_rate
from embedserve.engines.launch import engine_launch
from embedserve.runtime.replace import due
from tests.conftest import start_stack, wait_until

GB = 10**9


@pytest.mark.parametrize(("text", "per_s"), [("200MiB/min", 200 * 2**20 / 60), ("25MB/s", 25e6),
                                             ("1GiB/h", 2**30 / 3600)])
def test_rates(text: str, per_s: float) -> None:
    assert parse_rate(text) == pytest.approx(per_s)


@pytest.mark.parametrize("bad", ["-5MB/s", "fast", "0MB/s", "10MB", ""])
def test_bad_drill_input_exits_2_and_starts_nothing(bad: str) -> None:
    done = subprocess.run([sys.executable, "-m", "embedserve", "up", "--drill-leak", bad],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--drill-leak" in done.stderr
    assert "embedserve is up" not in done.stdout


def test_a_drill_flag_without_a_leak_exits_2() -> None:
    done = subprocess.run([sys.executable, "-m", "embedserve", "up", "--drill-leak"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--drill-leak" in done.stderr


def test_the_leak_is_resident_and_keeps_its_rate() -> None:
    now = [100.0]
    leak = Leak(8 * 2**20, chunk_bytes=2**20, clock=lambda: now[0])
    leak.catch_up()  # starts the clock
    assert leak.leaked_bytes == 0
    now[0] += 0.5
    leak.catch_up()
    assert leak.leaked_bytes == 4 * 2**20 and leak.held[0][-1] == 1
    now[0] += 0.01  # less than a chunk due: nothing allocated
    leak.catch_up()
    assert leak.leaked_bytes == 4 * 2**20
    now[0] += 9.49
    leak.catch_up()
    assert leak.leaked_bytes == 80 * 2**20


def test_only_the_drill_flag_makes_an_sglang_engine_leak(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        '{"model_type": "qwen3", "max_position_embeddings": 8192, "hidden_size": 64}')
    settings = Settings(model={"path": str(tmp_path)})
    assert LEAK_ENV not in engine_launch(settings, "sglang", 0).env
    spec = engine_launch(settings, "sglang", 0, drill_leak=2**30 / 60)
    assert float(spec.env[LEAK_ENV]) == pytest.approx(2**30 / 60)
    assert "--drill-leak" in engine_launch(settings, "cpu", 0, drill_leak=1e6).argv


def test_a_drill_against_engines_up_does_not_start_exits_2() -> None:
    done = subprocess.run([sys.executable, "-m", "embedserve", "up", "--drill-leak", "1GiB/min",
                           "--engine-url", "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--drill-leak needs engines that up starts" in done.stderr


def report(hours: float | None, resource: str = "host") -> MemoryReport:
    return MemoryReport(status="warning", recommends_restart=hours is not None and hours <= 6,
                        binding_resource=resource, estimated_hours_until_oom=hours, hours_lower=None,
                        hours_upper=None, reason="test")


def host_forecast(limit_source: str) -> ResourceForecast:
    return ResourceForecast(
        resource="host", status="growing", used_bytes=1.0, limit_bytes=2.0, limit_source=limit_source,
        headroom_bytes=1.0, peak_bytes=1.0, slope_bytes_per_hour=1.0, slope_low_bytes_per_hour=1.0,
        slope_high_bytes_per_hour=1.0, window_start=0.0, window_s=1.0, samples=30,
        estimated_hours_until_oom=5.0, hours_lower=4.0, hours_upper=6.0, capped=False, reason="test",
    )


def test_the_decision() -> None:
    s = Settings(_env_file=None, health={"replace_min_age_s": 600, "replace_cooldown_s": 600})
    old, young = [3600.0, 3600.0], [60.0, 3600.0]
    host, gpu = due(report(5.0), s, [1, 2], old, 1e9), due(report(5.0, "gpu:0"), s, [1, 2], old, 1e9)
    assert host is not None and host.index == 1  # host memory: the engine holding the most
    assert gpu is not None and gpu.index == 0  # GPU i: replica i
    assert due(report(7.0), s, [1, 2], old, 1e9) is None  # above the warning horizon
    assert due(report(None), s, [1, 2], old, 1e9) is None  # not growing
    assert due(report(5.0), s, [1, 2], old, 10.0) is None  # cooling down after the last one
    assert due(report(5.0, "gpu:0"), s, [1, 2], young, 1e9) is None  # too young
    assert due(None, s, [1], [3600.0], 1e9) is None
    machine = report(5.0).model_copy(update={"resources": {"host": host_forecast("machine RAM")}})
    assert due(machine, s, [1], [3600.0], 1e9) is None  # another process's growth: no replacement
    ours = report(5.0).model_copy(update={"resources": {"host": host_forecast("cgroup v2 limit")}})
    assert due(ours, s, [1], [3600.0], 1e9) is not None


def test_a_leaking_engine_is_replaced_before_the_limit_with_no_request_lost(tmp_path: Path) -> None:
    # The stack starts at ~0.3 GB (the ONNX engine); at 30 MB/s a limit of 3 GB is ~90 s away,
    # so the forecast (ready ~8 s in) reaches the 75 s horizon ~15 s in. Replacing with 75 s to
    # go leaves room for the new engine beside the old one while it starts on a busy machine.
    limit = 3 * GB
    env = {
        "EMBEDSERVE_HEALTH__SAMPLE_INTERVAL_S": "0.5",
        "EMBEDSERVE_HEALTH__WARMUP_S": "2",
        "EMBEDSERVE_HEALTH__MIN_SPAN_S": "6",
        "EMBEDSERVE_HEALTH__MIN_SAMPLES": "8",
        "EMBEDSERVE_HEALTH__WINDOW_S": "60",
        "EMBEDSERVE_HEALTH__HOST_MEMORY_LIMIT_BYTES": str(limit),
        "EMBEDSERVE_HEALTH__WARNING_HOURS": str(75 / 3600),  # replace with 75 s to go
        "EMBEDSERVE_HEALTH__CRITICAL_HOURS": str(10 / 3600),
        "EMBEDSERVE_HEALTH__REPLACE_MIN_AGE_S": "5",
        "EMBEDSERVE_HEALTH__REPLACE_COOLDOWN_S": "300",
    }
    stack = start_stack(BUNDLED_MODEL, tmp_path, env=env, args=("--drill-leak", "30MB/s"))
    statuses: list[int] = []
    peaks: list[float] = []
    stop = threading.Event()

    def load() -> None:  # closed loop, one request at a time, all through the drill
        with httpx.Client(timeout=30) as c:
            i = 0
            while not stop.is_set():
                r = c.post(stack.url + "/v1/embeddings", json={"model": stack.model_name, "input": f"q {i}"})
                statuses.append(r.status_code)
                i += 1

    def replaced() -> bool:
        doc = MemoryReport.model_validate_json(httpx.get(stack.url + "/health/memory", timeout=5).content)
        host = doc.resource("host")
        if host and host.used_bytes:
            peaks.append(host.used_bytes)
        return doc.replacements >= 1

    worker = threading.Thread(target=load)
    worker.start()
    try:
        t0 = time.monotonic()
        wait_until(replaced, timeout=150, interval=0.5)
        took = time.monotonic() - t0
        wait_until(lambda: len(statuses) > 20, timeout=30)

        def forecast_restarted() -> bool:  # the new engine gets a forecast of its own
            doc = MemoryReport.model_validate_json(httpx.get(stack.url + "/health/memory", timeout=5).content)
            return doc.sampler is not None and any(e.kind == "restart" for e in doc.sampler.events)

        wait_until(forecast_restarted, timeout=20, interval=0.5)
    finally:
        stop.set()
        worker.join(60)
        log = stack.log_text()
        assert stack.stop() == 0
    lost = [s for s in statuses if s not in (200, 429, 503)]
    print(f"replaced {took:.0f} s into the drill; {len(statuses)} requests, {statuses.count(200)} ok, "
          f"{len(statuses) - statuses.count(200) - len(lost)} 429/503, peak host {max(peaks) / GB:.2f} GB "
          f"of {limit / GB:.0f} GB, {min(peaks) / GB:.2f} GB at the start")
    assert lost == []
    assert statuses.count(200) > 0
    assert max(peaks) < limit  # replaced before the leak reached the limit
    assert "engine replaced" in log
