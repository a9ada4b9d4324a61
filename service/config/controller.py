"""The restart controller: ``EMBEDSERVE_CONTROLLER__<FIELD>``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr


class ControllerSettings(BaseModel):
    """The restart controller (``EMBEDSERVE_CONTROLLER__<FIELD>``): evicts pods running out of memory."""

    model_config = ConfigDict(extra="forbid")

    namespace: str | None = Field(
        None, description="namespace of the pods; default: the service account's own"
    )
    label_selector: str = Field("app.kubernetes.io/name=embedserve", description="selects the serving pods")
    health_port: int = Field(8000, ge=1, le=65535, description="the gateway port that serves /health/memory")
    health_path: str = "/health/memory"
    health_scheme: Literal["http", "https"] = "http"
    health_timeout_s: float = Field(2.0, gt=0)
    health_api_key: SecretStr | None = Field(
        None, description="bearer token when gateway.protect_health is on"
    )
    threshold_hours: float | None = Field(
        None,
        gt=0,
        description="evict at or under this many hours to OOM; default health.warning_hours",
    )
    follow_recommendation: bool = Field(
        True, description="also evict when /health/memory says recommends_restart"
    )
    min_pod_age_s: float = Field(
        600.0, ge=0, description="never evict a pod younger than this (fresh forecasts)"
    )
    api_url: str | None = Field(None, description="API server; default: in-cluster")
    api_timeout_s: float = Field(10.0, gt=0)
    dry_run: bool = False
    # Surge before evict: a replacement first, so a restart never costs serving capacity.
    deployment: str = Field("embedserve", description="the Deployment that runs the serving pods")
    surge: Literal["auto", "always", "never"] = Field(
        "auto",
        description="ask for one more pod and wait until it is ready before evicting: auto when "
        "the Deployment's rollingUpdate.maxSurge allows one (the operator's word that the cluster "
        "has a spare GPU), always, or never (evict first)",
    )
    surge_timeout_s: float = Field(
        900.0,
        gt=0,
        allow_inf_nan=False,  # an endless wait would never fall back to the eviction
        description="seconds a surge pod may take to become ready (a cold start takes up to 290 s); "
        "past it the count is restored and the pod evicted without a replacement",
    )
    surge_poll_s: float = Field(
        10.0, gt=0, allow_inf_nan=False, description="seconds between checks while a surge starts"
    )
    metrics_port: int | None = Field(
        None, description="serve the controller's own /metrics (its steps) on this port; none: no endpoint"
    )
    target_load: float = Field(
        0.8,
        gt=0,
        le=2,
        description="the embedserve_load the autoscaler holds each pod at (the autoscaling "
        "manifests' target); no surge when the other ready pods stay at or under it without the "
        "pod being restarted",
    )
