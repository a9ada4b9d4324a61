"""The ``GET /health/memory`` report: hours to out-of-memory per resource, the binding
one, the advice, and the raw figures behind it.

Produced by the health sampler once per sample; read by the probes, the restart
controller, ``embedserve health`` and the load generator's sampler, all through these
models (OpenAPI shows them too).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from embedserve.contracts.stats import EngineStats

#: ResourceForecast.limit_source when neither a cgroup nor a setting bounds the host: the
#: figure is the whole machine's, other processes included.
MACHINE_RAM = "machine RAM"

Status = Literal["insufficient_data", "not_growing", "growing", "at_limit", "no_limit"]
Level = Literal["ok", "unknown", "warning", "critical"]


class _Doc(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class ResourceForecast(_Doc):
    """One limited resource (``gpu:<index>`` or ``host``) and when it runs out."""

    resource: str
    status: Status
    used_bytes: float | None
    limit_bytes: float | None
    limit_source: str | None
    headroom_bytes: float | None
    peak_bytes: float | None = Field(description="the peak envelope's latest value")
    slope_bytes_per_hour: float | None
    slope_low_bytes_per_hour: float | None
    slope_high_bytes_per_hour: float | None
    window_start: float | None
    window_s: float
    samples: int
    estimated_hours_until_oom: float | None
    hours_lower: float | None = Field(description="from the steepest slope in the 95% interval")
    hours_upper: float | None = Field(description="from the shallowest; null: beyond the horizon")
    capped: bool
    reason: str
    measure: str = Field("", description="what 'used' is")


class Advice(_Doc):
    """The verdict over all resources."""

    status: Level
    recommends_restart: bool
    binding_resource: str | None
    estimated_hours_until_oom: float | None
    hours_lower: float | None
    hours_upper: float | None
    reason: str


class GpuDevice(_Doc):
    index: int
    name: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    reserved_bytes: int | None = None
    processes: dict[int, int] = Field(default_factory=dict, description="host pid -> bytes")


class ProcessMemory(_Doc):
    """Resident memory of a named process (engine, gateway) and its descendants.

    ``rss_bytes`` is the whole tree: for ``gateway`` under ``embedserve up`` that includes the
    engines it started. ``own_rss_bytes`` is the named process alone."""

    name: str
    pid: int
    rss_bytes: int = Field(description="the process and all its descendants")
    own_rss_bytes: int | None = Field(None, description="the process alone")
    pids: list[int] = Field(default_factory=list)


class GpuFigures(_Doc):
    devices: list[GpuDevice]


class CgroupMemory(_Doc):
    """The container's memory as the OOM killer sees it."""

    version: int
    current_bytes: int | None
    working_set_bytes: int | None
    limit_bytes: int | None


class EngineStatus(_Doc):
    """One engine behind the gateway."""

    url: str
    model: str = Field("", description="the model it serves (several models: each has engines of its own)")
    gpu: int | None = Field(None, description="the GPU a local engine runs on; several may share one")
    ready: bool
    outstanding_tokens: int = 0
    calls: int = 0
    last_error: str = Field(
        "", description="the last failure since the engine first became ready (kept after it recovers)"
    )
    last_error_at: float | None = Field(None, description="when last_error happened, unix time")


class Thresholds(_Doc):
    warning_hours: float
    critical_hours: float
    horizon_cap_hours: float
    warmup_s: float
    min_span_s: float
    min_samples: int
    window_s: float
    envelope_s: float


class SamplerEvent(_Doc):
    time: float
    kind: str
    detail: str = ""


class SamplerInfo(_Doc):
    interval_s: float
    history_samples: int
    sample_duration_s: float
    events: list[SamplerEvent] = Field(default_factory=list)


class MachineMemory(_Doc):
    total_bytes: int
    used_bytes: int


class MemoryReport(Advice):
    """``GET /health/memory``. Before the first sample only the advice fields are set."""

    time: float | None = None
    age_s: float | None = None
    resources: dict[str, ResourceForecast] = Field(default_factory=dict)
    gpu: GpuFigures | None = None
    gpu_reason: str | None = None
    allocator: list[EngineStats] | None = None
    allocator_reason: str | None = None
    fragmentation: float | None = None
    num_alloc_retries: int = 0
    num_ooms: int = 0
    cache_clears: int = 0
    processes: dict[str, ProcessMemory] = Field(default_factory=dict)
    processes_missing: dict[str, str] = Field(default_factory=dict)
    cgroup: CgroupMemory | None = None
    cgroup_reason: str | None = None
    machine: MachineMemory | None = None
    thresholds: Thresholds | None = None
    sampler: SamplerInfo | None = None
    engines: list[EngineStatus] = Field(default_factory=list)
    replacements: int = Field(0, description="engines `up` replaced ahead of a forecast out-of-memory")

    def resource(self, name: str) -> ResourceForecast | None:
        return self.resources.get(name)

    @classmethod
    def collecting(cls, reason: str = "no memory sample taken yet") -> MemoryReport:
        return cls(
            status="unknown",
            recommends_restart=False,
            binding_resource=None,
            estimated_hours_until_oom=None,
            hours_lower=None,
            hours_upper=None,
            reason=reason,
        )
