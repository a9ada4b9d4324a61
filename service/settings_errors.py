"""Configuration mistakes as one sentence: the setting (its ``EMBEDSERVE_*`` variable and,
where there is one, the command-line flag), what it accepts, and what it got.

pydantic's own report is a multi-line table ending in a documentation link, and a user who
typed ``EMBEDSERVE_GATEWAY__PORT=abc`` should not need a traceback to find the variable.
``embedserve`` prints the sentence and exits 2.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, SecretStr, ValidationError
from pydantic.fields import FieldInfo

ENV_PREFIX = "EMBEDSERVE_"


class ConfigError(ValueError):
    """A configuration mistake, stated in one sentence (``embedserve`` exits 2)."""


def env_name(loc: tuple[str | int, ...]) -> str:
    """``("gateway", "port")`` -> ``EMBEDSERVE_GATEWAY__PORT``."""
    return ENV_PREFIX + "__".join(str(p).upper() for p in loc)


def setting_name(loc: tuple[str | int, ...], flags: Mapping[str, str]) -> str:
    """The variable, and the flag that sets the same field when there is one; a field of a list's
    entry is named after the variable that holds the list:
    ``EMBEDSERVE_SERVED__MODELS: served.models[0].kind``."""
    at = next((n for n, p in enumerate(loc) if isinstance(p, int)), None)
    if at is not None:
        return f"{env_name(loc[:at])}: {dotted(loc)}"
    flag = flags.get(dotted(loc))
    return f"{env_name(loc)} ({flag})" if flag else env_name(loc)


def dotted(loc: tuple[str | int, ...]) -> str:
    """``("served", "models", 0, "kind")`` -> ``served.models[0].kind``."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).removeprefix(".")


def nearest(word: str, known: Iterable[str]) -> str:
    """`` (did you mean X?)`` for the closest of ``known``, else nothing."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _field(model: type[BaseModel], loc: tuple[str | int, ...]) -> FieldInfo | None:
    info: FieldInfo | None = None
    current: Any = model
    for part in loc:
        if isinstance(part, int) and info is not None and _listed_model(info.annotation):
            current = _listed_model(info.annotation)
            continue
        fields = getattr(current, "model_fields", None)
        if not isinstance(part, str) or not fields or part not in fields:
            return None
        info = fields[part]
        current = _model_in(info.annotation)
    return info


def _model_in(annotation: Any) -> Any:
    """The pydantic model inside ``X`` or ``X | None``, else the annotation itself."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return annotation


def _listed_model(annotation: Any) -> type[BaseModel] | None:
    """``M`` of ``list[M]``, for a pydantic model ``M``."""
    if typing.get_origin(annotation) is not list:
        return None
    (item,) = typing.get_args(annotation) or (None,)
    return item if isinstance(item, type) and issubclass(item, BaseModel) else None


def accepts(info: FieldInfo) -> str | None:
    """What a field takes, in words: ``a whole number from 1 to 65535``, ``one of 'a', 'b'``,
    ``a whole number at least 1 or 'auto'``."""
    return _accepts(info.annotation, info.metadata)


def _accepts(annotation: Any, metadata: list[Any]) -> str | None:
    if typing.get_origin(annotation) is typing.Annotated:  # Annotated[int, Field(ge=1)]
        inner, *extra = typing.get_args(annotation)
        found = [m for e in extra for m in getattr(e, "metadata", [e])]
        return _accepts(inner, [*metadata, *found])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        branches = [_accepts(a, metadata) for a in typing.get_args(annotation) if a is not type(None)]
        texts = [b for b in branches if b is not None]
        if len(texts) < len(branches) or not texts:
            return None
        return " or ".join([texts[0], *(t.removeprefix("one of ") for t in texts[1:])])
    if typing.get_origin(annotation) is typing.Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(annotation))
    words = {int: "a whole number", float: "a number", bool: "true or false"}.get(annotation)
    if words is None:
        if item := _listed_model(annotation):
            required = [name for name, f in item.model_fields.items() if f.is_required()]
            return "a JSON list of objects, each with " + " and ".join(required)
        if typing.get_origin(annotation) in (list, dict):
            return "JSON, e.g. '[\"a\", \"b\"]'" if typing.get_origin(annotation) is list else "a JSON object"
        return None
    bounds = {}
    for meta in metadata:
        for key in ("ge", "gt", "le", "lt"):
            if getattr(meta, key, None) is not None:
                bounds[key] = getattr(meta, key)
    if "ge" in bounds and "le" in bounds and len(bounds) == 2:
        return f"{words} from {bounds['ge']:g} to {bounds['le']:g}"
    phrases = {"ge": "at least", "gt": "above", "le": "at most", "lt": "below"}
    limits = [f"{phrases[k]} {bounds[k]:g}" for k in ("ge", "gt", "le", "lt") if k in bounds]
    return f"{words} {' and '.join(limits)}" if limits else words


def _setting_loc(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """The part of an error's location that names settings: pydantic appends the union
    branch it tried (``constrained-int``, ``literal['auto']``), which is no setting. An index
    into a list of models (``served.models``) and the entry's fields are kept."""
    current: Any = model
    listed: type[BaseModel] | None = None
    for n, part in enumerate(loc):
        if isinstance(part, int) and listed is not None:
            current, listed = listed, None
            continue
        fields = getattr(current, "model_fields", None)
        if not isinstance(part, str) or not fields or part not in fields:
            return loc[:n]
        current = _model_in(fields[part].annotation)
        listed = _listed_model(fields[part].annotation)
    return loc


def _siblings(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The field names beside the last part of ``loc``: those of the model (a section, or an
    entry of a list of models) that holds it."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue  # the entry's model was taken at its list's field
        info = getattr(current, "model_fields", {}).get(part)
        if info is None:
            return []
        current = _listed_model(info.annotation) or _model_in(info.annotation)
    return list(getattr(current, "model_fields", {}))


def _one(error: Mapping[str, Any], model: type[BaseModel], flags: Mapping[str, str],
         at: tuple[str | int, ...]) -> str:
    full = tuple(error.get("loc", ()))
    kind = error.get("type")
    loc = full if kind == "extra_forbidden" else (_setting_loc(model, full) or full)
    msg = str(error.get("msg", "is invalid"))
    if not loc:  # a rule across fields: its message names the settings itself
        return msg.removeprefix("Value error, ")
    name = setting_name((*at, *loc), flags)
    if kind == "extra_forbidden":
        word = str(loc[-1])
        if any(isinstance(p, int) for p in (*at, *loc)):
            known = _siblings(model, loc)
            return f"{name} is not a field; one of {', '.join(known)}{nearest(word, known)}"
        known_names = [env_name((*at, *loc[:-1], k)) for k in _siblings(model, loc)]
        return f"{env_name((*at, *loc))} is not a setting{nearest(env_name((*at, *loc)), known_names)}"
    if kind == "value_error":  # a validator's own sentence about this field
        return f"{name} {msg.removeprefix('Value error, ')}"
    info = _field(model, loc)
    wanted = accepts(info) if info is not None else None
    if kind == "missing":
        return f"{name} is required: {wanted or (info and info.description) or 'a value'}"
    if wanted is None:
        wanted = msg.replace("Input should be ", "")
    got = error.get("input")
    shown = "nothing" if got is None else shown_value(info, got)
    return f"{name} must be {wanted}, got {shown}"


def shown_value(info: FieldInfo | None, value: object) -> str:
    """The value a mistake got, quoted; a secret's (an API key) never: only its length."""
    if info is not None and _holds_secret(info.annotation):
        return f"a {len(str(value))}-character value (hidden: it is a secret)"
    return repr(value)


def _holds_secret(annotation: Any) -> bool:
    """``SecretStr``, or a type made of it (``list[SecretStr]``, ``SecretStr | None``)."""
    return annotation is SecretStr or any(_holds_secret(a) for a in typing.get_args(annotation))


def describe(exc: ValidationError, model: type[BaseModel], flags: Mapping[str, str] | None = None,
             at: tuple[str | int, ...] = ()) -> str:
    """The whole report as one sentence (several mistakes are joined with ';'). ``at``: where
    ``model`` sits in the settings (``("served", "models", 0, "engine")``), for the names."""
    parts = [_one(e, model, flags or {}, at) for e in exc.errors()]
    return "; ".join(dict.fromkeys(parts)) or "the configuration is invalid"


def bad_json(section: str, model: type[BaseModel], environ: Mapping[str, str]) -> str:
    """pydantic-settings only says which section failed to parse: find the variable whose
    value is not the JSON its list or object setting needs."""
    import json

    prefix = env_name((section,)) + "__"
    for name, value in sorted(environ.items()):
        if not name.upper().startswith(prefix):
            continue
        loc = (section, *name[len(prefix):].lower().split("__"))
        info = _field(model, loc)
        if info is None or typing.get_origin(info.annotation) not in (list, dict):
            continue
        try:
            json.loads(value)
        except ValueError:
            return f"{name} must be {accepts(info)}, got {shown_value(info, value)}"
    return f"a {prefix}* variable holds a value that is not valid JSON"


def setting_variables(model: type[BaseModel], loc: tuple[str, ...] = ()) -> set[str]:
    """Every ``EMBEDSERVE_*`` name that sets something: each field, and each section (as JSON)."""
    out: set[str] = set()
    for name, info in model.model_fields.items():
        here = (*loc, name)
        out.add(env_name(here))
        inner = _model_in(info.annotation)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            out |= setting_variables(inner, here)
    return out


def check_variables(names: Iterable[str], known: set[str], where: str = "") -> None:
    """``ConfigError`` for an ``EMBEDSERVE_*`` name that sets nothing (a misspelt one would
    leave its setting at the default without a word), naming the nearest known name."""
    for name in sorted(names):
        upper = name.upper()
        if upper.startswith(ENV_PREFIX) and upper not in known:
            raise ConfigError(f"{name}{where} is not a setting{nearest(upper, known)}; "
                              "`embedserve config` lists the settings")
