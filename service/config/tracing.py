"""OpenTelemetry traces: ``EMBEDSERVE_TRACING__<FIELD>``, each defaulting to OpenTelemetry's own
variable, so a collector set up for the rest of a stack (``OTEL_EXPORTER_OTLP_ENDPOINT``) gets
embedserve's spans too. Off while no endpoint is set."""

from __future__ import annotations

import os
import re
from typing import Literal

from pydantic import BaseModel, Field

_URL = re.compile(r"^https?://[^/\s]+(/\S*)?$")
URL_WORDS = "an http:// or https:// URL such as http://collector:4318"


def is_url(value: str) -> bool:
    """An endpoint ``Settings`` accepts (it checks it: the field's default, OpenTelemetry's own
    variable, would pass a validator on the field unchecked)."""
    return bool(_URL.match(value))


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


class TracingSettings(BaseModel):
    """A span per API request, exported over OTLP when ``endpoint`` is set."""

    endpoint: str | None = Field(
        default_factory=lambda: _env("OTEL_EXPORTER_OTLP_ENDPOINT"),
        description="the OTLP receiver, a URL such as http://collector:4318 (HTTP: spans go to its "
        "/v1/traces) or http://collector:4317 (gRPC). Default OTEL_EXPORTER_OTLP_ENDPOINT; unset: "
        "no tracing, and OpenTelemetry is not imported",
    )
    protocol: Literal["http/protobuf", "grpc"] = Field(
        default_factory=lambda: _env("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf",
        validate_default=True,
        description="OTLP over HTTP or gRPC. Default OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf",
    )
    service_name: str = Field(
        default_factory=lambda: _env("OTEL_SERVICE_NAME") or "embedserve",
        description="the spans' service.name. Default OTEL_SERVICE_NAME, else embedserve",
    )

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None
