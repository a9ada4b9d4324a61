"""Prometheus view of the last memory state, built at scrape time (no stale label sets).

Every figure is a gauge with its unit in the name; engine counters are exported as
counters. ``embedserve_memory_used_bytes`` and ``embedserve_memory_limit_bytes`` carry the
same labels, so ``predict_linear(used[6h], 6*3600) > limit`` works (deploy/prometheus).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from embedserve.health.monitor import MemoryMonitor, MemoryState

P = "embedserve_"


def _g(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(P + name, doc, labels=labels or [])


class HealthCollector(Collector):
    def __init__(self, monitor: MemoryMonitor) -> None:
        self.monitor = monitor

    def describe(self) -> Iterator[Metric]:
        return iter(())  # names depend on the sources present; collected at scrape

    def collect(self) -> Iterator[Metric]:
        state = self.monitor.state
        if state is None:
            return
        r = state.reading
        gpu_used = _g("gpu_memory_used_bytes", "NVML device memory used", ["gpu"])
        gpu_total = _g("gpu_memory_total_bytes", "NVML device memory total", ["gpu"])
        gpu_res = _g("gpu_memory_reserved_bytes", "NVML driver-reserved memory", ["gpu"])
        gpu_proc = _g("gpu_process_memory_used_bytes", "NVML memory per process", ["gpu", "process"])
        names = {pid: n for n, p in r.processes.items() for pid in p.pids}
        for d in r.gpu.devices:
            g = str(d.index)
            gpu_used.add_metric([g], d.used_bytes)
            gpu_total.add_metric([g], d.total_bytes)
            if d.reserved_bytes is not None:
                gpu_res.add_metric([g], d.reserved_bytes)
            per: dict[str, float] = {}
            for pid, used in d.processes.items():
                key = names.get(pid, "other")
                per[key] = per.get(key, 0.0) + used
            for key, total in per.items():
                gpu_proc.add_metric([g, key], total)
        yield from (gpu_used, gpu_total, gpu_res, gpu_proc)
        yield GaugeMetricFamily(
            P + "gpu_nvml_available", "1 when NVML answers", value=1.0 if r.gpu.available else 0.0
        )

        lab = ["engine_pid", "device"]
        alloc = {
            k: _g(f"engine_allocator_{k}_bytes", f"torch allocator {k} (engine stats)", lab)
            for k in ("allocated", "reserved", "inactive_split", "max_reserved")
        }
        frag = _g("engine_allocator_fragmentation_ratio", "inactive split / reserved", lab)
        rss = _g("engine_rss_bytes", "engine-reported resident memory", lab)
        counters = {
            k: CounterMetricFamily(P + f"engine_{k}", f"engine {k}", labels=lab)
            for k in ("alloc_retries", "ooms", "cache_clears", "batches")
        }
        clear_s = CounterMetricFamily(
            P + "engine_cache_clear_seconds", "time spent emptying the cache", labels=lab
        )
        for e in r.allocator.engines:
            lv = [str(e.pid), "" if e.device is None else str(e.device)]
            alloc["allocated"].add_metric(lv, e.allocated_bytes)
            alloc["reserved"].add_metric(lv, e.reserved_bytes)
            alloc["inactive_split"].add_metric(lv, e.inactive_split_bytes)
            alloc["max_reserved"].add_metric(lv, e.max_reserved_bytes)
            f = e.fragmentation
            if f is not None:
                frag.add_metric(lv, f)
            rss.add_metric(lv, e.rss_bytes)
            counters["alloc_retries"].add_metric(lv, e.num_alloc_retries)
            counters["ooms"].add_metric(lv, e.num_ooms)
            counters["cache_clears"].add_metric(lv, e.cache_clears)
            counters["batches"].add_metric(lv, e.batches)
            clear_s.add_metric(lv, e.cache_clear_seconds_total)
        yield from (*alloc.values(), frag, rss, *counters.values(), clear_s)

        host = _g("host_memory_rss_bytes", "resident memory, process and children", ["process"])
        for name, p in r.processes.items():
            host.add_metric([name], p.rss_bytes)
        yield host
        if r.cgroup.available:
            for key in ("current", "working_set", "limit"):
                value = getattr(r.cgroup, f"{key}_bytes")
                if value is not None:
                    yield GaugeMetricFamily(
                        P + f"cgroup_memory_{key}_bytes", f"cgroup memory {key}", value=value
                    )
        yield GaugeMetricFamily(P + "machine_memory_total_bytes", "RAM", value=r.machine_total_bytes)
        yield GaugeMetricFamily(
            P + "machine_memory_used_bytes", "RAM total - available", value=r.machine_used_bytes
        )
        yield from self._forecast(state)

    def _forecast(self, state: MemoryState) -> Iterator[Metric]:
        cap = self.monitor.params.horizon_cap_hours
        used = _g("memory_used_bytes", "forecast input: used memory", ["resource"])
        limit = _g("memory_limit_bytes", "forecast input: the limit", ["resource"])
        peak = _g("memory_peak_bytes", "peak envelope, latest value", ["resource"])
        slope = _g("memory_growth_bytes_per_second", "Theil-Sen slope of the peak", ["resource", "bound"])
        hours = _g(
            "hours_until_oom",
            f"forecast hours to out-of-memory, capped at {cap:g} (= none foreseen); "
            "NaN while collecting data",
            ["resource", "bound"],
        )
        samples = _g("memory_forecast_samples", "samples in the fit", ["resource"])
        window = _g("memory_forecast_window_seconds", "span of the fit", ["resource"])
        for name, f in state.forecasts.items():
            if f.used_bytes is not None:
                used.add_metric([name], f.used_bytes)
            if f.limit_bytes is not None:
                limit.add_metric([name], f.limit_bytes)
            if f.peak_bytes is not None:
                peak.add_metric([name], f.peak_bytes)
            for bound, v in (
                ("estimate", f.slope_bytes_per_hour),
                ("lower", f.slope_low_bytes_per_hour),
                ("upper", f.slope_high_bytes_per_hour),
            ):
                if v is not None:
                    slope.add_metric([name, bound], v / 3600.0)
            known = f.status in ("growing", "not_growing", "at_limit")
            for bound, v in (
                ("estimate", f.estimated_hours_until_oom),
                ("lower", f.hours_lower),
                ("upper", f.hours_upper),
            ):
                value = cap if v is None else v
                hours.add_metric([name, bound], value if known else math.nan)
            samples.add_metric([name], f.samples)
            window.add_metric([name], f.window_s)
        yield from (used, limit, peak, slope, hours, samples, window)
        yield GaugeMetricFamily(
            P + "memory_recommends_restart",
            "1 when the forecast advises a rolling restart",
            value=1.0 if state.advice.recommends_restart else 0.0,
        )
        yield GaugeMetricFamily(
            P + "health_sample_timestamp_seconds", "time of the last sample", value=state.time
        )
        yield GaugeMetricFamily(
            P + "health_sample_duration_seconds",
            "time one sample took",
            value=state.reading.duration_s,
        )
