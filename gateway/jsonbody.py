"""Parse a request body into a JSON object, refusing what would be read ambiguously.

orjson keeps the last of duplicate keys silently, so ``{"input": "a", "input": "b"}`` would
embed "b" while a proxy or log that keeps the first sees "a". Finding duplicates costs a
regex per top-level key; the exact (slower) check runs only when the regex finds a repeat.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

from embedserve.gateway.errors import APIError


class _Pairs(dict[str, Any]):
    duplicates: list[str]


def _object_with_duplicates(pairs: list[tuple[str, Any]]) -> _Pairs:
    obj = _Pairs(pairs)
    seen: set[str] = set()
    obj.duplicates = [k for k, _ in pairs if k in seen or seen.add(k)]  # type: ignore[func-returns-value]
    return obj


def _maybe_repeated(raw: bytes, keys: list[str]) -> bool:
    """A key opens after ``{`` or ``,``; inside a string its quote would be escaped, so
    this never matches string content (nested objects can match: the exact check decides)."""
    for key in keys:
        pattern = rb'[{,]\s*"' + re.escape(key.encode()) + rb'"\s*:'
        it = re.finditer(pattern, raw)
        if next(it, None) is not None and next(it, None) is not None:
            return True
    return False


def top_level_duplicates(raw: bytes, obj: dict[str, Any]) -> list[str]:
    """Keys that appear more than once in the body's top-level object."""
    if not _maybe_repeated(raw, list(obj)):
        return []
    try:
        parsed = json.loads(raw, object_pairs_hook=_object_with_duplicates)
    except ValueError:
        return []
    return list(dict.fromkeys(parsed.duplicates)) if isinstance(parsed, _Pairs) else []


def parse_object(raw: bytes) -> dict[str, Any]:
    """The body as a dict, or an ``APIError`` 400 saying what is wrong with it."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"The body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(obj, dict):
        raise APIError(400, "The body must be a JSON object", code="invalid_json")
    dupes = top_level_duplicates(raw, obj)
    if dupes:
        raise APIError(
            400,
            f"The body repeats the key '{dupes[0]}'; send each field once",
            param=dupes[0],
            code="duplicate_key",
        )
    return obj
