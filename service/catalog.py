"""The models one gateway serves, each as a ``Settings`` of its own: its ``model`` and ``engine``
sections are the entry's, everything else is shared. Without ``served.models`` there is one,
the configuration's own (the single-model configuration, unchanged).

An entry's engines listen on the ports after the entry before's (its ``engine.port`` overrides),
one engine per GPU unless it names ``engines_per_gpu``; its engine processes get its settings
whole, so an engine never knows there are others.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from embedserve.config import EngineSettings, GatewayLimits, Settings
from embedserve.config.served import ServedModel
from embedserve.model_info import MODEL_SETTINGS, ModelInfo
from embedserve.settings_errors import ConfigError, describe, setting_name

VARIABLE = "EMBEDSERVE_SERVED__MODELS"


@dataclass(frozen=True)
class CatalogEntry:
    settings: Settings  # the model's own model and engine sections
    kind: str | None = None  # "embed" / "rerank"; None: whatever the folder is (one model)
    max_tokens_in_flight: int | None = None
    index: int | None = None  # its place in served.models; None: the one model

    def setting(self, field: str) -> str:
        """How a mistake names its ``field`` (``path``, ``max_seq_len``): the model section's
        variable and flag, or ``EMBEDSERVE_SERVED__MODELS: served.models[i].path``."""
        if self.index is None:
            return MODEL_SETTINGS[field]
        return setting_name(("served", "models", self.index, field), {})

    def load_info(self) -> ModelInfo:
        return ModelInfo.load(self.settings.model, self.setting)

    @property
    def name(self) -> str:
        return self.settings.model.served_name

    def limits(self, engine_kind: str) -> GatewayLimits:
        """The gateway's limits in front of this model's engines."""
        return self.settings.gateway_limits(engine_kind, self.max_tokens_in_flight)

    def check_kind(self, info: ModelInfo) -> None:
        """The folder is what the entry says it is."""
        if self.kind is None or (self.kind == "embed") == info.embeds:
            return
        what = "an embedding model" if info.embeds else f"a reranker ({info.scoring})"
        raise ConfigError(
            f"{VARIABLE}: the model '{self.name}' has kind '{self.kind}', but {info.path} is {what}; "
            "kind is embed for embedding models and rerank for cross-encoders and Qwen3-Reranker"
        )


def _entry(settings: Settings, index: int, m: ServedModel, port: int) -> CatalogEntry:
    model = settings.model.model_copy(
        update={"path": m.path, "name": m.name, "aliases": list(m.aliases), "max_seq_len": m.max_seq_len,
                "long_inputs": m.long_inputs, "chunk_overlap_tokens": m.chunk_overlap_tokens}
    )
    engine = {**settings.engine.model_dump(), "engines_per_gpu": 1, "port": port, **m.engine}
    try:
        own = EngineSettings.model_validate(engine)
    except ValidationError as exc:
        raise ConfigError(describe(exc, EngineSettings, at=("served", "models", index, "engine"))) from None
    return CatalogEntry(
        settings.model_copy(update={"model": model, "engine": own}), m.kind, m.max_tokens_in_flight, index
    )


def served_models(settings: Settings) -> list[CatalogEntry]:
    """One entry per model; ``ConfigError`` for an engine setting it cannot take, or two models
    that answer to one name."""
    if not settings.served.models:
        return [CatalogEntry(settings)]
    entries: list[CatalogEntry] = []
    port = settings.engine.port
    for index, m in enumerate(settings.served.models):
        entry = _entry(settings, index, m, port)
        entries.append(entry)
        own = entry.settings
        port = own.engine.port + (0 if own.engine.urls else own.local_engine_count())
    ports: dict[int, str] = {}
    for entry in entries:
        own = entry.settings
        for i in range(0 if own.engine.urls else own.local_engine_count()):
            port = own.engine.port + i
            if port in ports:
                raise ConfigError(
                    f"{VARIABLE}: the models '{ports[port]}' and '{entry.name}' would both start an "
                    f"engine on port {port}; give one another engine.port (ports default to the next "
                    "after the model before)"
                )
            ports[port] = entry.name
    seen: dict[str, str] = {}
    for entry in entries:
        for name in (entry.name, *entry.settings.model.aliases):
            if name in seen:
                raise ConfigError(
                    f"{VARIABLE}: two models answer to '{name}' ({seen[name]} and "
                    f"{entry.settings.model.path}); give each a name and aliases of its own"
                )
            seen[name] = entry.settings.model.path
    return entries
