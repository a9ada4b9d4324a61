"""The engines' allocator statistics, read from the stats channel (embedserve.contracts.stats)."""

from __future__ import annotations

from dataclasses import dataclass, field

from embedserve.contracts.stats import EngineStats, read_all_stats


@dataclass
class AllocatorReading:
    engines: list[EngineStats] = field(default_factory=list)
    reason: str | None = None

    @property
    def identity(self) -> tuple[tuple[int, float], ...]:
        """Which engine processes these are; a change means an engine restarted."""
        return tuple(sorted((e.pid, round(e.started_at, 3)) for e in self.engines))

    @property
    def cache_clears(self) -> int:
        return sum(e.cache_clears for e in self.engines)

    @property
    def last_clear_time(self) -> float | None:
        times = [e.last_clear_time for e in self.engines if e.last_clear_time is not None]
        return max(times) if times else None


def read_allocator(stats_dir: str | None, check_pid: bool = True) -> AllocatorReading:
    if stats_dir is None:
        return AllocatorReading(reason="engine.stats_dir is not set: no engine statistics")
    try:
        engines = read_all_stats(stats_dir, check_pid=check_pid)
    except OSError as exc:
        return AllocatorReading(reason=f"cannot read {stats_dir}: {exc}")
    if not engines:
        return AllocatorReading(reason=f"no live engine has published stats in {stats_dir}")
    return AllocatorReading(engines=engines)
