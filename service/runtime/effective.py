"""What ``embedserve config`` prints: the settings the stack will run with, the values it derives
(from the model, the machine, the engine kind, other settings) filled in where the settings leave
them open, and where each value came from: default, ``.env``, variable, flag or derived.

Planned as ``up`` plans (``model_plan.py``), so a mistake ``up`` would refuse is refused here too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from embedserve.catalog import served_models
from embedserve.config import ModelSettings, Settings, dotenv_names
from embedserve.engines.cores import usable_cores
from embedserve.engines.sglang import kv_pool_tokens
from embedserve.model_info import model_folder
from embedserve.runtime.model_plan import PlannedModel, plan_models, resolve_engine_kind
from embedserve.settings_errors import ENV_PREFIX, dotted, setting_variables


class ModelReport(ModelSettings):
    folder: str = Field(description="the folder model.path resolves to")


class ConfigReport(Settings):
    """The settings as the stack uses them, secrets hidden when dumped, with ``sources``: each
    value's origin by its dotted name (``gateway.port``: ``variable EMBEDSERVE_GATEWAY__PORT``)."""

    model: ModelReport
    sources: dict[str, str] = Field(default_factory=dict)
    #: each served model's gateway limits (``GatewayLimits``), and ``unresolved``: why engines
    #: elsewhere did not say what they are, where they did not
    limits: dict[str, Any] = Field(default_factory=dict)


MACHINE_KIND = "derived from machine and model (a GPU: torch for a cross-encoder, else sglang; no GPU: cpu)"
CORES = "derived from the machine (the cores this process may use: affinity, cgroup quota)"
ENTRY_ENGINE = "derived: the engine section with the entry's engine over it, ports after the model before"


def given_sources(overrides: Mapping[str, Any], flags: Mapping[str, str]) -> dict[str, str]:
    """Where the values that were set came from, by dotted name (a section set whole as JSON
    is its own entry): flags over variables over ``.env``, as ``load_settings`` reads them."""
    known = setting_variables(Settings)

    def dotted_of(name: str) -> str | None:
        upper = name.upper()
        return upper[len(ENV_PREFIX):].lower().replace("__", ".") if upper in known else None

    out: dict[str, str] = {}
    for name in dotenv_names():
        if (key := dotted_of(name)) is not None:
            out[key] = f".env ({name.upper()})"
    for name in os.environ:
        if (key := dotted_of(name)) is not None:
            out[key] = f"variable {name.upper()}"
    for section, fields in overrides.items():
        for field in fields:
            key = f"{section}.{field}"
            out[key] = f"flag {flags.get(key, key)}"
    return out


def _leaves(data: Any, loc: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    if isinstance(data, dict) and data:
        return [leaf for k, v in data.items() for leaf in _leaves(v, (*loc, k))]
    return [loc]


def _source(given: Mapping[str, str], loc: tuple[str | int, ...]) -> str:
    """The nearest given source of ``loc`` or a section around it, else ``default``."""
    for n in range(len(loc), 0, -1):
        if (found := given.get(dotted(loc[:n]))) is not None:
            return found
    return "default"


def _derive(settings: Settings, plan: PlannedModel) -> tuple[dict[str, Any], dict[str, str]]:
    """One model's derived values, as section -> field -> value, and their sources."""
    own, kind, info = plan.settings, plan.kind, plan.info
    eng, gw = own.engine, own.gateway
    values: dict[str, dict[str, Any]] = {"model": {}, "engine": {}, "gateway": {}}
    why: dict[str, str] = {}

    def put(section: str, field: str, value: Any, source: str) -> None:
        values[section][field] = value
        why[f"{section}.{field}"] = source

    if own.model.max_seq_len is None:
        put("model", "max_seq_len", info.max_seq_len,
            "derived from the model (sentence-transformers' max_seq_length, else its positions up to 8192)")
    if settings.engine.kind == "auto":
        put("engine", "kind", kind, MACHINE_KIND if not eng.urls else "derived from engine.urls (external)")
    if settings.engine.engines_per_gpu == "auto":
        how = "the model's size and the GPU's memory" if kind == "sglang" else "one for this engine kind"
        put("engine", "engines_per_gpu", eng.engines_per_gpu, f"derived ({how})")
    if kind == "cpu" and eng.cpu_threads is None:
        put("engine", "cpu_threads", usable_cores(), CORES)
    if kind == "sglang" and eng.kv_pool_tokens is None:
        put("engine", "kv_pool_tokens", kv_pool_tokens(own, info.max_seq_len),
            "derived from engine.batch_token_budget, engine.overlap_schedule and model.max_seq_len")
    for field, value in own.gateway_limits(kind).model_dump(exclude={"engine_kind"}).items():
        if getattr(gw, field) is None:
            put("gateway", field, value, f"derived from the engine kind ({kind})")
    return values, why


def config_report(
    settings: Settings, overrides: Mapping[str, Any], flags: Mapping[str, str], gpu_bytes: int | None = None,
    unresolved: str | None = None,
) -> ConfigReport:
    """The report ``embedserve config`` prints; ``ConfigError`` for what ``up`` would refuse.
    ``unresolved``: why engines elsewhere did not say what they are (the limits are then SGLang's)."""
    given = given_sources(overrides, flags)
    limits: dict[str, Any] = {"unresolved": unresolved} if unresolved else {}
    for entry in served_models(settings):
        limits[entry.name] = entry.limits(resolve_engine_kind(entry.settings)).model_dump()
    asked = settings
    settings, planned = plan_models(settings, gpu_bytes)
    data = settings.model_dump()
    derived: dict[str, str] = {}
    h = settings.health
    for section, field, value, source in (
        ("health", "hang_after_s", settings.hang_after_s(), "derived: 4 x gateway.request_timeout_s"),
        ("health", "replace_below_hours", h.warning_hours, "derived: health.warning_hours"),
        ("controller", "threshold_hours", h.warning_hours, "derived: health.warning_hours"),
    ):
        if getattr(getattr(settings, section), field) is None:
            data[section][field] = value
            derived[f"{section}.{field}"] = source
    if not settings.served.models:
        values, why = _derive(asked, planned[0])
        for section, fields in values.items():
            data[section].update(fields)
        derived.update(why)
    else:
        for index, plan in enumerate(planned):
            values, why = _derive(asked, plan)
            entry = data["served"]["models"][index]
            entry["max_seq_len"] = plan.info.max_seq_len
            entry["engine"] = plan.settings.engine.model_dump() | values["engine"]
            entry["max_tokens_in_flight"] = values["gateway"].get(
                "max_tokens_in_flight", entry["max_tokens_in_flight"])
            at, listed = f"served.models[{index}]", _source(given, ("served", "models"))
            derived[f"{at}.max_seq_len"] = why.get("model.max_seq_len", listed)
            derived[f"{at}.engine"] = ENTRY_ENGINE
            derived[f"{at}.max_tokens_in_flight"] = why.get("gateway.max_tokens_in_flight", listed)
    data["model"]["folder"] = str(model_folder(settings.model).resolve())
    sources = {dotted(loc): _source(given, loc) for loc in _leaves(data)}
    sources.update(derived)
    sources["model.folder"] = "derived from model.path"
    return ConfigReport.model_validate({**data, "sources": sources, "limits": limits})
