"""Configuration mistakes as one sentence: the setting (its ``EMBEDSERVE_*`` variable and,
where there is one, the command-line flag), what it accepts, and what it got.

pydantic's own report is a multi-line table ending in a documentation link, and a user who
typed ``EMBEDSERVE_GATEWAY__PORT=abc`` should not need a traceback to find the variable.
``embedserve`` prints the sentence and exits 2.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

ENV_PREFIX = "EMBEDSERVE_"


class ConfigError(ValueError):
    """A configuration mistake, stated in one sentence (``embedserve`` exits 2)."""


def env_name(loc: tuple[str | int, ...]) -> str:
    """``("gateway", "port")`` -> ``EMBEDSERVE_GATEWAY__PORT``."""
    return ENV_PREFIX + "__".join(str(p).upper() for p in loc)


def setting_name(loc: tuple[str | int, ...], flags: Mapping[str, str]) -> str:
    """The variable, and the flag that sets the same field when there is one."""
    dotted = ".".join(str(p) for p in loc)
    flag = flags.get(dotted)
    return f"{env_name(loc)} ({flag})" if flag else env_name(loc)


def _field(model: type[BaseModel], loc: tuple[str | int, ...]) -> FieldInfo | None:
    info: FieldInfo | None = None
    current: Any = model
    for part in loc:
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
    branch it tried (``constrained-int``, ``literal['auto']``), which is no setting."""
    current: Any = model
    for n, part in enumerate(loc):
        fields = getattr(current, "model_fields", None)
        if not isinstance(part, str) or not fields or part not in fields:
            return loc[:n]
        current = _model_in(fields[part].annotation)
    return loc


def _one(error: Mapping[str, Any], model: type[BaseModel], flags: Mapping[str, str]) -> str:
    loc = _setting_loc(model, tuple(error.get("loc", ()))) or tuple(error.get("loc", ()))
    msg = str(error.get("msg", "is invalid"))
    if not loc:  # a rule across fields: its message names the settings itself
        return msg.removeprefix("Value error, ")
    info = _field(model, loc)
    wanted = accepts(info) if info is not None else None
    if wanted is None:
        wanted = msg.replace("Input should be ", "").replace("Value error, ", "")
    got = error.get("input")
    shown = "nothing" if got is None else repr(got)
    if error.get("type") == "extra_forbidden":
        return f"{env_name(loc)} is not a setting"
    return f"{setting_name(loc, flags)} must be {wanted}, got {shown}"


def describe(exc: ValidationError, model: type[BaseModel], flags: Mapping[str, str] | None = None) -> str:
    """The whole report as one sentence (several mistakes are joined with ';')."""
    parts = [_one(e, model, flags or {}) for e in exc.errors()]
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
            return f"{name} must be {accepts(info)}, got {value!r}"
    return f"a {prefix}* variable holds a value that is not valid JSON"
