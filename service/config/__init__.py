"""The one typed configuration object of the stack.

Read once by ``load_settings`` (``EMBEDSERVE_*`` environment variables, an optional ``.env``
and the command line's flags), then passed down; engine processes that ``up`` starts get
the parent's resolved settings whole, as JSON in one variable. Nested fields use ``__``:
``EMBEDSERVE_ENGINE__PORT=30001``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from embedserve.config.controller import ControllerSettings
from embedserve.config.engine import CacheClearSettings, EngineSettings
from embedserve.config.gateway import GatewaySettings
from embedserve.config.health import HealthSettings
from embedserve.config.model import ModelSettings
from embedserve.config.served import ServedSettings
from embedserve.config.tracing import URL_WORDS, TracingSettings, is_url
from embedserve.contracts.models import BUNDLED_MODEL, resolve_model_path
from embedserve.settings_errors import ConfigError, bad_json, check_variables, describe, setting_variables

__all__ = [
    "BUNDLED_MODEL",
    "CHILD_SETTINGS_ENV",
    "CacheClearSettings",
    "ControllerSettings",
    "EngineSettings",
    "GatewayLimits",
    "GatewaySettings",
    "HealthSettings",
    "ModelSettings",
    "ServedSettings",
    "Settings",
    "TracingSettings",
    "load_settings",
    "resolve_model_path",
]

#: Set by ``up`` for the engine processes it starts: the parent's settings, as JSON.
CHILD_SETTINGS_ENV = "EMBEDSERVE_SETTINGS_JSON"

#: ``EMBEDSERVE_*`` names that are no setting but are set around the stack (name -> whose), so a
#: shell or CI job that exports them can still run it: ``up`` starts with a warning naming them.
#: Any other unknown name is refused. Those ``up`` sets for its own engines
#: (``EMBEDSERVE_SETTINGS_JSON``, the leak drill's rate) pass without a word.
NOT_SETTINGS = {
    "EMBEDSERVE_REGISTRY": "compose.yaml's and the image scripts' registry",
    "EMBEDSERVE_TAG": "compose.yaml's and the image scripts' image tag",
    "EMBEDSERVE_PORT": "compose.yaml's published port (the gateway's own is EMBEDSERVE_GATEWAY__PORT)",
    "EMBEDSERVE_WARNING_HOURS": "compose.yaml's (it sets EMBEDSERVE_HEALTH__WARNING_HOURS)",
    "EMBEDSERVE_CRITICAL_HOURS": "compose.yaml's (it sets EMBEDSERVE_HEALTH__CRITICAL_HOURS)",
    "EMBEDSERVE_CI_ENGINE_PORT": "the container CI script's",
    "EMBEDSERVE_CI_GATEWAY_PORT": "the container CI script's",
    "EMBEDSERVE_E2E_URL": "the end-to-end tests'",
    "EMBEDSERVE_E2E_CONTAINERS": "the end-to-end tests'",
}
OWN_CHILD_VARIABLES = {CHILD_SETTINGS_ENV, "EMBEDSERVE_DRILL_LEAK_BYTES_PER_S"}


def _upper(value: object) -> object:
    return value.upper() if isinstance(value, str) else value


#: logging's level names, in any case (``info``); an unknown one stops the start like any mistake
LogLevel = Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], BeforeValidator(_upper)]


class GatewayLimits(BaseModel):
    """What the gateway's settings come to in front of one model's engines (their defaults follow
    the engines' kind): shown by ``embedserve config`` and exported in ``/metrics``."""

    engine_kind: str  # cpu, sglang, or external (engines elsewhere that did not say)
    engine_calls_per_engine: int
    max_tokens_per_engine_call: int
    max_tokens_in_flight: int
    inline_tokenize_chars: int


class Settings(BaseSettings):
    """Everything, read once at start."""

    model_config = SettingsConfigDict(
        env_prefix="EMBEDSERVE_", env_nested_delimiter="__", env_file=".env", extra="ignore"
    )

    model: ModelSettings = Field(default_factory=ModelSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    health: HealthSettings = Field(default_factory=HealthSettings)
    controller: ControllerSettings = Field(default_factory=ControllerSettings)
    served: ServedSettings = Field(default_factory=ServedSettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    log_level: LogLevel = "INFO"
    log_format: Literal["auto", "json", "text"] = Field(
        "auto", description="auto: readable lines on a terminal, JSON lines otherwise"
    )
    log_access: Literal["errors", "all"] = Field(
        "errors",
        description="the gateway's access lines. errors: a line per request answered 4xx or 5xx, "
        "but none for 429 at capacity, 503 while warming up, or health probes and metrics scrapes "
        "(/metrics counts the API's requests by status either way); all: a line per request, probes "
        "included",
    )

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.health.critical_hours >= self.health.warning_hours:
            raise ValueError(
                f"EMBEDSERVE_HEALTH__CRITICAL_HOURS ({self.health.critical_hours:g}) must be below "
                f"EMBEDSERVE_HEALTH__WARNING_HOURS ({self.health.warning_hours:g})"
            )
        endpoint = self.tracing.endpoint  # here, not on the field: its default (OpenTelemetry's
        if endpoint is not None and not is_url(endpoint):  # variable) is not validated there
            named = ("EMBEDSERVE_TRACING__ENDPOINT" if "endpoint" in self.tracing.model_fields_set
                     else "OTEL_EXPORTER_OTLP_ENDPOINT (EMBEDSERVE_TRACING__ENDPOINT's default)")
            raise ValueError(f"{named} must be {URL_WORDS}, got {endpoint!r}")
        if self.engine.cpu_quantization != "none" and self.engine.cpu_backend != "onnx":
            raise ValueError(
                f"EMBEDSERVE_ENGINE__CPU_QUANTIZATION={self.engine.cpu_quantization} (--cpu-quantization) "
                "needs EMBEDSERVE_ENGINE__CPU_BACKEND=onnx (--cpu-backend)"
            )
        return self

    def gateway_kind(self, engine_kind: str) -> str:
        """The engine kind whose defaults the gateway takes: engines elsewhere (``external``)
        count as what they said they are (``engine.external_kind``), once known."""
        if engine_kind == "external" and self.engine.external_kind != "ask":
            return self.engine.external_kind
        return engine_kind

    def tokens_in_flight_limit(self, engine_kind: str) -> int:
        if self.gateway.max_tokens_in_flight is not None:
            return self.gateway.max_tokens_in_flight
        return 32_768 if self.gateway_kind(engine_kind) == "cpu" else 262_144

    def inline_tokenize_limit(self, engine_kind: str) -> int:
        if self.gateway.inline_tokenize_chars is not None:
            return self.gateway.inline_tokenize_chars
        return 2048 if self.gateway_kind(engine_kind) == "cpu" else 0

    def engine_calls(self, engine_kind: str) -> int:
        if self.gateway.engine_calls_per_engine is not None:
            return self.gateway.engine_calls_per_engine
        return 1 if self.gateway_kind(engine_kind) == "cpu" else 4

    def engine_call_tokens(self, engine_kind: str) -> int:
        if self.gateway.max_tokens_per_engine_call is not None:
            return self.gateway.max_tokens_per_engine_call
        return 512 if self.gateway_kind(engine_kind) == "cpu" else self.engine.batch_token_budget

    def gateway_limits(self, engine_kind: str, tokens_in_flight: int | None = None) -> GatewayLimits:
        """The gateway's limits in front of engines of ``engine_kind``, defaults resolved;
        ``tokens_in_flight``: a served model's own admission bound."""
        return GatewayLimits(
            engine_kind=self.gateway_kind(engine_kind),
            engine_calls_per_engine=self.engine_calls(engine_kind),
            max_tokens_per_engine_call=self.engine_call_tokens(engine_kind),
            max_tokens_in_flight=tokens_in_flight or self.tokens_in_flight_limit(engine_kind),
            inline_tokenize_chars=self.inline_tokenize_limit(engine_kind),
        )

    def hang_after_s(self) -> float:
        return self.health.hang_after_s or 4 * self.gateway.request_timeout_s

    def engines_per_gpu(self) -> int:
        """As resolved at start (``auto`` counts as one until then)."""
        n = self.engine.engines_per_gpu
        return n if isinstance(n, int) else 1

    def local_engine_count(self) -> int:
        return self.engine.replicas * self.engines_per_gpu()

    def engine_gpu(self, index: int) -> int:
        """The GPU (among the visible ones) of local engine ``index``."""
        return index // self.engines_per_gpu()

    def engine_urls(self) -> list[str]:
        e = self.engine
        return e.urls or [f"http://{e.host}:{e.port + i}" for i in range(self.local_engine_count())]

    def engine_gpus(self) -> list[int | None]:
        """The GPU of each engine in ``engine_urls``; None for engines this stack did not start."""
        if self.engine.urls:
            return [None] * len(self.engine.urls)
        return [self.engine_gpu(i) for i in range(self.local_engine_count())]

    def with_engine(self, **changes: Any) -> Settings:
        return self.model_copy(update={"engine": self.engine.model_copy(update=changes)})

    def for_replica(self, index: int) -> Settings:
        """The same settings as seen by local engine ``index`` (its own port)."""
        return self.with_engine(port=self.engine.port + index, replicas=1, engines_per_gpu=1)

    def child_env(self) -> dict[str, str]:
        """What an engine process needs to see exactly these settings (secrets stay hidden:
        engines need none)."""
        return {CHILD_SETTINGS_ENV: self.model_dump_json()}

    def redacted(self) -> dict[str, object]:
        """For logging: secrets stay hidden (SecretStr dumps as '**********')."""
        return json.loads(self.model_dump_json())


def load_settings(
    overrides: dict[str, Any] | None = None, flags: Mapping[str, str] | None = None
) -> Settings:
    """The settings of this process: a parent's, when it started this one (see
    ``Settings.child_env``), else the environment and ``.env`` with ``overrides`` on top.
    A mistake raises ``ConfigError``, one sentence naming the variable and, from ``flags``
    (``"gateway.port": "--port"``), the flag."""
    inherited = os.environ.get(CHILD_SETTINGS_ENV)
    try:
        if inherited:
            return Settings.model_validate_json(inherited)
        known = setting_variables(Settings) | set(NOT_SETTINGS) | OWN_CHILD_VARIABLES
        check_variables(os.environ, known)
        check_variables(dotenv_names(), known, " (in .env)")
        return Settings(**(overrides or {}))
    except ValidationError as exc:
        raise ConfigError(describe(exc, Settings, flags)) from None
    except SettingsError as exc:  # a list or object variable that is not JSON
        section = str(exc).split('"')[1] if str(exc).count('"') >= 2 else ""
        raise ConfigError(bad_json(section, Settings, os.environ)) from None


def dotenv_names() -> list[str]:
    """The names ``.env`` in the working directory sets (pydantic-settings reads the same file)."""
    from dotenv import dotenv_values

    env_file = Settings.model_config.get("env_file")
    if not isinstance(env_file, str) or not os.path.isfile(env_file):
        return []
    return list(dotenv_values(env_file))


def tolerated_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning for each ``NOT_SETTINGS`` name in ``environ``: set, and no setting."""
    return [f"{name} is not a setting of embedserve (it is {why}); ignored"
            for name, why in NOT_SETTINGS.items() if name in {n.upper() for n in environ}]
