"""The load generator's command line: flags, their checks (bad values exit 2 before
anything is sent) and the URLs they name."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from embedserve.loadtest.verdict import Targets

# Qwen3-Embedding's instruction for web search queries (its model card's example)
PREFIX_PRESETS = {
    "qwen3-query": "Instruct: Given a web search query, retrieve relevant passages that answer "
                   "the query\nQuery:",
}


def parse_prefix(spec: str | None) -> tuple[str, list[int]]:
    """``--shared-prefix``: TEXT, ``ids:N,N,...`` or ``preset:NAME`` -> (text, token ids)."""
    if not spec:
        return "", []
    kind, _, rest = spec.partition(":")
    if kind == "preset":
        if rest not in PREFIX_PRESETS:
            raise ValueError(f"unknown --shared-prefix preset {rest!r}: "
                             f"use one of {', '.join(sorted(PREFIX_PRESETS))}")
        return PREFIX_PRESETS[rest], []
    if kind == "ids":
        try:
            ids = [int(x) for x in rest.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"bad --shared-prefix {spec!r}: ids:N,N,... wants token ids") from None
        if not ids or min(ids) < 0:
            raise ValueError(f"bad --shared-prefix {spec!r}: ids:N,N,... wants token ids >= 0")
        return "", ids
    return spec, []


def parse_seconds(text: str) -> float:
    """``90``, ``90s``, ``5m``, ``2h`` -> seconds."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    t = text.strip().lower()
    if t and t[-1] in units:
        return float(t[:-1]) * units[t[-1]]
    return float(t)


def embeddings_url(target: str) -> str:
    """Accept a base URL, ``.../v1`` or the full ``.../v1/embeddings`` URL."""
    parts = urlsplit(target)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"target must be an http(s) URL, got {target!r}")
    path = parts.path.rstrip("/")
    if not path.endswith("/embeddings"):
        path = path + ("/embeddings" if path.endswith("/v1") else "/v1/embeddings")
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def same_origin_url(target: str, path_or_url: str) -> str:
    """A URL on the target's own scheme/host/port; anything else is refused."""
    t = urlsplit(target)
    u = urlsplit(path_or_url)
    if not u.netloc:
        return urlunsplit((t.scheme, t.netloc, "/" + path_or_url.lstrip("/"), "", ""))
    if (u.scheme, u.netloc) != (t.scheme, t.netloc):
        raise ValueError(f"{path_or_url} is not on the target {t.scheme}://{t.netloc}: refused")
    return path_or_url


DESCRIPTION = """\
Drive an OpenAI-compatible /v1/embeddings endpoint with generated (or a file's) inputs, then
write results.json, summary.md and plots. Every generated input is unique in the run, so no
prefix cache can serve it, unless --repeat-rate, --shared-prefix or --query-prefix asks for
repeated content, which the report labels as such. Lengths are exact in the target model's
tokens with --tokenizer. Exit status: 0 when the verdict passes, 1 when it fails, 2 on bad
arguments."""

EPILOG = """\
examples:
  embedserve loadtest http://127.0.0.1:8000 --tokenizer MODEL_DIR --rate 20 --duration 10m \\
      --warmup 60 --max-error-rate 0.001 --max-p95-drift 0.2 --max-memory-growth-mib 256
  embedserve loadtest http://127.0.0.1:30000/v1/embeddings --input ids --tokenizer MODEL_DIR \\
      --concurrency 8 --requests 2000 --mix uniform:128-512
  embedserve loadtest http://127.0.0.1:8000 --tokenizer MODEL_DIR --requests 2000 \\
      --repeat-rate 0.3 --query-prefix      # the labelled repeated-content scenario"""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="embedserve loadtest", description=DESCRIPTION, epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", help="base URL or full /v1/embeddings URL (the only host used, "
                                   "but for --metrics-url pages named on other hosts)")
    g = ap.add_argument_group("traffic")
    loop = g.add_mutually_exclusive_group()
    loop.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    loop.add_argument("--concurrency", type=int,
                      help="closed loop: requests kept in flight (default 4)")
    g.add_argument("--duration", type=parse_seconds, help="measured time: 90, 90s, 10m, 2h")
    g.add_argument("--requests", type=int, help="measured request count")
    g.add_argument("--warmup", type=parse_seconds, default=0.0,
                   help="seconds at the start left out of results")
    g.add_argument("--warmup-requests", type=int, default=0,
                   help="requests at the start left out of results (added to --requests)")
    g.add_argument("--mix", default="seed",
                   help="seed | uniform:A-B | fixed:N | buckets:W:A-B,... | file:PATH")
    g.add_argument("--inputs", default="1", help="inputs per request: N or A-B")
    g.add_argument("--input", dest="input_kind", choices=("text", "ids"), default="text",
                   help="send texts or token ids (ids: raw SGLang --skip-tokenizer-init)")
    g.add_argument("--tokenizer", help="the target model's tokenizer.json or model folder")
    g.add_argument("--max-tokens", type=int, help="clamp every input to this many tokens")
    g.add_argument("--model", help="model id to send (default: first of GET /v1/models)")
    g.add_argument("--encoding-format", choices=("float", "base64"),
                   help="send this encoding_format (default: omit the field)")
    g.add_argument("--dimensions", type=int, help="send this dimensions value")
    g.add_argument("--outputs", help="send these outputs, comma-separated: dense, sparse, colbert "
                                     "(a model's other outputs; default: omit the field)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--build-workers", type=int, metavar="N",
                   help="processes that build requests ahead (default: none on 4 cores or "
                        "fewer, else a quarter of the cores, at most 4; 0: one thread, which "
                        "shares the client's event loop under the GIL)")
    r = ap.add_argument_group(
        "repeated content (a scenario of its own: labelled in the report, its cache benefit "
        "reported apart from the headline figures)")
    r.add_argument("--repeat-rate", type=float, default=0.0, metavar="R",
                   help="fraction 0-1 of inputs sent as exact copies of one of the last 1,024 "
                        "new inputs (default 0: every input is new)")
    r.add_argument("--shared-prefix", metavar="TEXT|ids:N,...|preset:NAME",
                   help="every generated input starts with this prefix, counted in its length "
                        "(a file: mix gets it before each text); ids: needs --input ids; "
                        f"presets: {', '.join(sorted(PREFIX_PRESETS))}")
    r.add_argument("--query-prefix", action="store_true",
                   help="same as --shared-prefix preset:qwen3-query (Qwen3-Embedding's "
                        "'Instruct: ... Query:' instruction)")
    s = ap.add_argument_group("safety")
    s.add_argument("--timeout", type=float, default=60.0, help="per-request timeout, s")
    s.add_argument("--max-connections", type=int,
                   help="default: one per request in flight (--concurrency, or --max-in-flight "
                   "in an open loop); a closed loop refuses fewer")
    s.add_argument("--max-in-flight", type=int, default=1024,
                   help="open loop: arrivals beyond this many pending are dropped and counted")
    s.add_argument("--retries-429", type=int, default=3,
                   help="resend a 429'd request after its Retry-After, at most this often")
    s.add_argument("--max-run-time", type=parse_seconds, default=7 * 24 * 3600.0,
                   help="hard stop, whatever else is set")
    s.add_argument("--header", action="append", default=[], help="'Name: value' to send")
    s.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    m = ap.add_argument_group("sampling")
    m.add_argument("--health-url", default="/health/memory",
                   help="path on the target (or 'none'); a 404 disables sampling")
    m.add_argument("--sample-interval", type=float, default=5.0)
    m.add_argument("--metrics-url", action="append", default=[], metavar="URL",
                   help="Prometheus page read before and after the run for the prefix cache "
                        "hit rate; repeatable (engines behind a gateway); a path is taken on "
                        "the target; default /metrics on the target; 'none' skips it")
    m.add_argument("--gauge", action="append", default=[], metavar="NAME",
                   help="read this gauge from the target's /metrics every --sample-interval "
                        "(e.g. embedserve_load, the autoscaling signal); the report gives its "
                        "median and range over the measured time; repeatable")
    m.add_argument("--watch-pid", type=int, action="append", default=[],
                   help="also sample this local process's RSS (and its children's)")
    o = ap.add_argument_group("output and verdict")
    o.add_argument("--out", type=Path, help="results folder (default loadtest-results/TIME)")
    o.add_argument("--window", type=parse_seconds, help="window for percentiles (default auto)")
    o.add_argument("--checkpoint-every", type=parse_seconds,
                   help="rewrite results.json and summary.md this often while running")
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--no-plots", action="store_true")
    add_target_args(o)
    return ap


def add_target_args(o: Any) -> None:
    """The verdict's options (shared with ``loadtest.rescore``)."""
    o.add_argument("--max-error-rate", type=float,
                   help="fail above this share of attempts (0.001 = 0.1%%; default 0: any error "
                        "fails, with or without other targets; 429s are throttling, not errors)")
    o.add_argument("--max-p95-drift", type=float,
                   help="fail if the last window's P95 exceeds the first's by this fraction")
    o.add_argument("--max-memory-growth-mib", type=float,
                   help="fail if any memory series grows more than this after warm-up")
    o.add_argument("--memory-series", metavar="REGEX",
                   help="judge growth only for matching series, e.g. 'engine|gateway|pid' "
                        "(default: all; 'target host' is machine-wide without a cgroup limit)")
    o.add_argument("--max-p95-ms", type=float)
    o.add_argument("--max-429-rate", type=float)
    o.add_argument("--min-rps", type=float, help="fail below this many successful req/s")


def targets_from(a: argparse.Namespace) -> Targets:
    """The verdict's targets from parsed arguments."""
    return Targets(a.max_error_rate, a.max_p95_drift, a.max_memory_growth_mib, a.max_p95_ms,
                   a.max_429_rate, a.min_rps, a.memory_series)


def request_headers(a: argparse.Namespace) -> dict[str, str]:
    h = {}
    for raw in a.header:
        name, _, value = raw.partition(":")
        if not value:
            raise ValueError(f"--header wants 'Name: value', got {raw!r}")
        h[name.strip()] = value.strip()
    if a.api_key:
        h["Authorization"] = f"Bearer {a.api_key}"
    return h


def check_numbers(a: argparse.Namespace) -> None:
    """Counts and rates that would make no run (or a silent wrong one)."""
    if not 0.0 <= a.repeat_rate <= 1.0:
        raise ValueError(f"--repeat-rate must be within 0-1, got {a.repeat_rate:g}")
    for flag, value, least in (("--requests", a.requests, 1), ("--warmup-requests",
                               a.warmup_requests, 0), ("--max-tokens", a.max_tokens, 1),
                               ("--concurrency", a.concurrency, 1),
                               ("--max-connections", a.max_connections, 1),
                               ("--max-in-flight", a.max_in_flight, 1),
                               ("--retries-429", a.retries_429, 0),
                               ("--dimensions", a.dimensions, 1),
                               ("--build-workers", a.build_workers, 0)):
        if value is not None and value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    for flag, secs in (("--duration", a.duration), ("--warmup", a.warmup),
                       ("--timeout", a.timeout), ("--sample-interval", a.sample_interval)):
        if secs is not None and (secs < 0 or (secs == 0 and flag != "--warmup")):
            raise ValueError(f"{flag} must be > 0, got {secs:g}")


def metrics_urls(url: str, given: list[str]) -> list[str]:
    """``--metrics-url`` values as URLs (paths on the target); default the target's /metrics."""
    if given == ["none"]:
        return []
    out = []
    for u in given or ["/metrics"]:
        parts = urlsplit(u)
        if parts.netloc and parts.scheme not in ("http", "https"):
            raise ValueError(f"--metrics-url must be an http(s) URL or a path, got {u!r}")
        out.append(u if parts.netloc else same_origin_url(url, u))
    return out
