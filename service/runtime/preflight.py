"""What ``up`` and ``gateway`` check before they start anything: each mistake one sentence
naming the setting (exit 2), never a stack that starts and then fails, or quietly serves
from whatever answers on a default address."""

from __future__ import annotations

import importlib.util

from embedserve.config import Settings
from embedserve.config.gateway import api_keys
from embedserve.nvml import gpu_count
from embedserve.runtime.ports import check_free
from embedserve.settings_errors import ConfigError

KIND = "EMBEDSERVE_ENGINE__KIND (--engine-kind)"
URLS = "EMBEDSERVE_ENGINE__URLS (--engine-url)"
PORT = "EMBEDSERVE_GATEWAY__PORT (--port)"
ENGINE_PORT = "EMBEDSERVE_ENGINE__PORT (--engine-port)"


def check_engine_kind(settings: Settings, kind: str) -> None:
    """The engines the resolved ``kind`` needs are there to start, or named."""
    if kind == "external" and not settings.engine.urls:
        raise ConfigError(
            f"{URLS} must name at least one engine when the engines run elsewhere "
            f"({KIND} 'external', and `embedserve gateway`), got none"
        )
    if kind == "sglang" and importlib.util.find_spec("sglang") is None:
        raise ConfigError(
            f"{KIND} is 'sglang', but SGLang is not installed: install the gpu extra "
            "(pip install 'embedserve[gpu]'), or use 'auto' or 'cpu'"
        )
    if kind in ("sglang", "torch") and gpu_count() == 0:
        raise ConfigError(f"{KIND} is {kind!r}, but no NVIDIA GPU is visible here: use 'auto' or 'cpu'")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def check_tracing(settings: Settings) -> None:
    """Tracing asked for, and the OpenTelemetry SDK and exporter it needs are installed."""
    t = settings.tracing
    exporter = "grpc" if t.protocol == "grpc" else "http"
    needed = ("opentelemetry.sdk", f"opentelemetry.exporter.otlp.proto.{exporter}")
    if t.enabled and not all(map(_installed, needed)):
        raise ConfigError(
            f"EMBEDSERVE_TRACING__ENDPOINT (or OTEL_EXPORTER_OTLP_ENDPOINT) is {t.endpoint!r}, but "
            f"OpenTelemetry's SDK and OTLP/{t.protocol} exporter are not installed: install the otel "
            "extra (pip install 'embedserve[otel]'), or unset it"
        )


def check_ports(settings: Settings, local_engines: bool) -> None:
    """Every port this stack listens on is its own, valid and free."""
    g, e = settings.gateway, settings.engine
    engine_ports = range(e.port, e.port + settings.local_engine_count()) if local_engines else range(0)
    if engine_ports and engine_ports[-1] > 65535:
        raise ConfigError(
            f"{ENGINE_PORT} must leave room for {len(engine_ports)} engines below 65536 (they take "
            f"one port each from it), got {e.port}"
        )
    if g.port in engine_ports:
        span = f"{e.port}" if len(engine_ports) == 1 else f"{e.port}-{engine_ports[-1]}"
        raise ConfigError(f"{PORT} and {ENGINE_PORT} must differ: the gateway's port {g.port} is "
                          f"also an engine's (engines listen on {span})")
    check_free(g.host, g.port, "gateway", "--port", "EMBEDSERVE_GATEWAY__PORT")
    for port in engine_ports:
        check_free(e.host, port, "engine", "--engine-port", "EMBEDSERVE_ENGINE__PORT")


def check_api_keys(settings: Settings) -> None:
    """The keys file, when one is named, is there and holds a key: read now, before engines
    start, rather than when the gateway is built after them."""
    api_keys(settings.gateway)
