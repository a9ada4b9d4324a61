"""SGLang's prefix-cache hit rate over one run, from its Prometheus counters (the engine
runs with ``--enable-metrics``). In SGLang 0.5.17 ``sglang:prompt_tokens_total`` counts the
prompt tokens of finished requests and ``sglang:cached_tokens_total`` the part of them served
from the radix cache (labelled by ``cache_source`` in newer releases: summed here). A
benchmark row is only honest when this is near zero, or labelled repeated content."""

from __future__ import annotations

import re

from procs import http_get

PROMPT_TOKENS = "sglang:prompt_tokens_total"
CACHED_TOKENS = "sglang:cached_tokens_total"
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfaINFA]+)")


def parse_counters(text: str, names: tuple[str, ...] = (PROMPT_TOKENS, CACHED_TOKENS)) -> dict[str, float]:
    """Sum of every labelled series of each named counter in a Prometheus text page."""
    out = dict.fromkeys(names, 0.0)
    seen: set[str] = set()
    for line in text.splitlines():
        m = _LINE.match(line)
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(3))
            seen.add(m.group(1))
    return {k: v for k, v in out.items() if k in seen}


def snapshot(engine_urls: list[str]) -> dict[str, float] | None:
    """Counters summed over the engines (None when no engine serves SGLang's counters)."""
    total: dict[str, float] = {}
    for url in engine_urls:
        status, text = http_get(url.rstrip("/") + "/metrics", timeout=10)
        if status != 200:
            continue
        for k, v in parse_counters(text).items():
            total[k] = total.get(k, 0.0) + v
    return total if PROMPT_TOKENS in total else None


def hit_rate(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    """Cached over prompt tokens between two snapshots; None when either is missing or no
    prompt tokens were counted in between."""
    if not before or not after:
        return None
    prompt = after.get(PROMPT_TOKENS, 0.0) - before.get(PROMPT_TOKENS, 0.0)
    cached = after.get(CACHED_TOKENS, 0.0) - before.get(CACHED_TOKENS, 0.0)
    return round(cached / prompt, 4) if prompt > 0 else None
