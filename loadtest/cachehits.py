"""How much of a run the target served from its prefix cache, read from its Prometheus
``/metrics`` before and after the run.

SGLang 0.5.17 counts, per finished request, embedding requests included (its tokenizer
manager collects metrics for ``BatchEmbeddingOutput`` as for generation, when the server
runs with ``--enable-metrics``):

* ``sglang:prompt_tokens_total`` (labels: model and ``is_streaming``): prompt tokens;
* ``sglang:cached_tokens_total`` (labels: model and ``cache_source``: ``device``, ``host``,
  ``storage_*``, or ``total`` when no breakdown exists): prompt tokens served from the
  radix cache.

Counters are summed over label sets and over every URL read (engines behind a gateway);
the hit rate is delta(cached) / delta(prompt). Anything else on the target during the run
is counted too, and warm-up requests are included.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

# (cached tokens counter, prompt tokens counter), sample names as exposed
COUNTERS: tuple[tuple[str, str], ...] = (
    ("sglang:cached_tokens_total", "sglang:prompt_tokens_total"),
    # the gateway re-exports its engines' SGLang counters under its own names
    ("embedserve_engine_cached_tokens_total", "embedserve_engine_prompt_tokens_total"),
    ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
)
MAX_HIT_RATE = 0.01  # above this a run measures the cache, and its report says so


def counters(text: str) -> dict[str, float]:
    """Every counter sample of a Prometheus text page, summed over label sets."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_total"):
                out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


@dataclass
class Scrape:
    """One read of every metrics URL: counter sums, and per URL what went wrong."""

    values: dict[str, float]
    errors: dict[str, str]


async def scrape(session: aiohttp.ClientSession, urls: list[str], timeout_s: float = 10.0
                 ) -> Scrape:
    """Read every URL once; a URL that fails is noted, never fatal."""

    async def one(url: str) -> tuple[str, dict[str, float] | str]:
        try:
            async with session.get(url, allow_redirects=False,
                                   timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                if r.status != 200:
                    return url, f"HTTP {r.status}"
                return url, counters(await r.text())
        except (aiohttp.ClientError, TimeoutError, ValueError, UnicodeDecodeError) as e:
            return url, f"{type(e).__name__}: {e}"[:200]

    values: dict[str, float] = {}
    errors: dict[str, str] = {}
    for url, got in await asyncio.gather(*(one(u) for u in urls)):
        if isinstance(got, str):
            errors[url] = got
            continue
        for k, v in got.items():
            values[k] = values.get(k, 0.0) + v
    return Scrape(values, errors)


async def scrape_urls(urls: list[str], headers: dict[str, str]) -> Scrape:
    """``scrape`` on a session of its own (before and after the run's session)."""
    async with aiohttp.ClientSession(headers=headers) as session:
        return await scrape(session, urls)


def hit_rate(before: Scrape | None, after: Scrape | None, urls: list[str],
             repeated_content: bool) -> dict[str, Any]:
    """The report's ``prefix_cache`` section. ``flagged`` marks a run of unique inputs whose
    target still served more than 1% of prompt tokens from its cache."""
    out: dict[str, Any] = {"urls": urls, "status": "not exposed", "hit_rate": None,
                           "cached_tokens": None, "prompt_tokens": None, "counters": None,
                           "max_hit_rate": MAX_HIT_RATE, "flagged": False,
                           "repeated_content": repeated_content,
                           "scope": "the whole run, warm-up included, and any other traffic "
                                    "the target served meanwhile"}
    if not urls:
        out["status"] = "not read (--metrics-url none)"
        return out
    if before is None or after is None:
        return out
    errors = {**before.errors, **after.errors}
    if errors:
        out["errors"] = errors
    for cached, prompt in COUNTERS:
        if prompt not in after.values:
            continue
        out["counters"] = [cached, prompt]
        if prompt not in before.values:
            out["status"] = "unreadable (counter missing before the run)"
            return out
        d_prompt = after.values[prompt] - before.values[prompt]
        d_cached = after.values.get(cached, 0.0) - before.values.get(cached, 0.0)
        if d_prompt < 0 or d_cached < 0:
            out["status"] = "unreadable (counters went back: the target restarted)"
            return out
        out["cached_tokens"], out["prompt_tokens"] = int(d_cached), int(d_prompt)
        if d_prompt == 0:
            out["status"] = "no prompt tokens counted during the run"
            return out
        out["status"] = "measured"
        out["hit_rate"] = round(d_cached / d_prompt, 6)
        out["flagged"] = out["hit_rate"] > MAX_HIT_RATE and not repeated_content
        return out
    return out


def describe(pc: dict[str, Any]) -> str:
    """One line for the summary and the console."""
    if pc.get("status") != "measured":
        return f"prefix cache hits: {pc.get('status', 'not exposed')}"
    return (f"prefix cache hits: {pc['hit_rate']:.2%} of prompt tokens "
            f"({pc['cached_tokens']:,} of {pc['prompt_tokens']:,})")
