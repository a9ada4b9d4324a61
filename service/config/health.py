"""Memory sampling and the forecast: ``EMBEDSERVE_HEALTH__<FIELD>``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class HealthSettings(BaseModel):
    """Memory sampling and the hours-to-OOM forecast."""

    model_config = ConfigDict(extra="forbid")

    sample_interval_s: float = Field(5.0, gt=0)
    history_max_samples: int = Field(20_000, ge=10, description="bounded history; older samples are thinned")
    persist_path: str | None = None
    warmup_s: float = Field(300.0, ge=0)
    min_span_s: float = Field(1800.0, ge=0)
    min_samples: int = Field(30, ge=3)
    window_s: float = Field(6 * 3600.0, gt=0)
    horizon_cap_hours: float = Field(168.0, gt=0)
    warning_hours: float = Field(6.0, gt=0, description="readiness fails (pod drained) under this many hours")
    critical_hours: float = Field(
        1.0, gt=0, description="liveness fails (pod restarted) under this many hours"
    )
    hang_after_s: float | None = Field(
        None,
        gt=0,
        description="an engine call older than this means a hung engine: liveness "
        "fails and `up` restarts it; default 4 x gateway.request_timeout_s",
    )
    gpu_memory_limit_bytes: int | None = None
    host_memory_limit_bytes: int | None = None
    replace_engines: bool = Field(
        True,
        description="`up` replaces an engine whose memory runs out within replace_below_hours, one "
        "at a time, before it runs out. Turn it off where a Kubernetes restart controller is in "
        "charge (a pod whose `up` drains itself would race it)",
    )
    replace_below_hours: float | None = Field(
        None, gt=0, description="hours to out-of-memory that start a replacement; default warning_hours"
    )
    replace_min_age_s: float = Field(600.0, ge=0, description="never replace an engine younger than this")
    replace_cooldown_s: float = Field(600.0, ge=0, description="at least this long between two replacements")
