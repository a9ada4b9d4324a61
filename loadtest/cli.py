"""``embedserve loadtest``: drive an OpenAI-compatible /v1/embeddings URL and report.

Examples::

    embedserve loadtest http://127.0.0.1:8000 --tokenizer MODEL_DIR --rate 20 --duration 10m \\
        --warmup 60 --max-error-rate 0.001 --max-p95-drift 0.2 --max-memory-growth-mib 256
    embedserve loadtest http://127.0.0.1:30000/v1/embeddings --input ids --tokenizer MODEL_DIR \\
        --concurrency 8 --requests 2000 --mix uniform:128-512
    embedserve loadtest http://127.0.0.1:8000 --tokenizer MODEL_DIR --requests 2000 \\
        --repeat-rate 0.3 --query-prefix      # the labelled repeated-content scenario

Inputs: every generated input opens with a marker unique in the run, so no two share more
than a few leading tokens and a server's prefix cache serves next to nothing; lengths are
exact in the target model's tokens. Repeated content (exact repeats, a shared prefix) is a
scenario of its own, asked for with --repeat-rate / --shared-prefix / --query-prefix and
labelled as such in the report. A file: mix sends the file's texts as they are; a text sent
twice counts as repeated content.

Prefix cache: the report states the fraction of prompt tokens the target served from its
prefix cache (SGLang's sglang:cached_tokens_total / sglang:prompt_tokens_total, read from
--metrics-url before and after the run), or "not exposed". A run of unique inputs above 1%
is flagged: its throughput measures the cache as much as the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from embedserve.loadtest import cachehits, plots, report
from embedserve.loadtest.args import (
    build_parser,
    check_numbers,
    embeddings_url,
    metrics_urls,
    parse_prefix,
    request_headers,
    same_origin_url,
    targets_from,
)
from embedserve.loadtest.mixes import BucketMix, FileMix, parse_count, parse_mix
from embedserve.loadtest.runner import RunConfig, Runner, RunOutcome
from embedserve.loadtest.sampling import GaugeSampler, MemorySampler, ProcessSampler
from embedserve.loadtest.textbuild import TextBuilder, WordBuilder, load_tokenizer
from embedserve.loadtest.traffic import RequestFactory, auto_build_workers
from embedserve.loadtest.verdict import growth_caveats, verdict_label


async def discover_model(url: str, headers: dict[str, str]) -> dict[str, Any] | None:
    """The first entry of GET /v1/models on the target (``id``, and ``max_seq_len`` from
    embedserve), or None."""
    models_url = url.rsplit("/embeddings", 1)[0] + "/models"
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError,
                             IndexError, TypeError):
        async with aiohttp.ClientSession(headers=headers) as s, s.get(
            models_url, allow_redirects=False, timeout=aiohttp.ClientTimeout(total=10)
        ) as r:
            if r.status == 200:
                entry = (await r.json(content_type=None))["data"][0]
                return entry if isinstance(entry, dict) and "id" in entry else None
    return None


def truncation_warning(longest: int | None, max_seq_len: object) -> str | None:
    """When the mix sends inputs longer than the server embeds: tokens sent then overstate
    the work done (the server cuts the rest off), so say so before the run."""
    if longest is None or not isinstance(max_seq_len, int) or longest <= max_seq_len:
        return None
    return (f"WARNING: the mix sends inputs of up to {longest:,} tokens, but the server embeds at "
            f"most {max_seq_len:,} (max_seq_len in /v1/models): it truncates longer inputs, so "
            f"tokens sent overstate the work; --max-tokens {max_seq_len} sends only what it embeds")


def headline(m: dict[str, Any]) -> str:
    """Throughput as the server counted it (usage), then what was sent, and the share cut off."""
    sent, embedded = m["tokens_per_s"], m["embedded_tokens_per_s"]
    if not m.get("usage_reported"):
        return f"{sent:.0f} tokens/s sent (the server reported no usage)"
    line = f"{embedded:.0f} tokens/s embedded ({sent:.0f} sent"
    if m["tokens_ok"] and m["usage_prompt_tokens"] < 0.99 * m["tokens_ok"]:
        cut = 1 - m["usage_prompt_tokens"] / m["tokens_ok"]
        line += f"; {cut:.0%} of the tokens sent were cut off by the server's truncation"
    return line + ")"


class Progress:
    """tqdm bar: requests (count runs) or seconds (duration runs), rate, errors, P95."""

    def __init__(self, runner: Runner, enabled: bool) -> None:
        self.bar: Any = None
        if not enabled:
            return
        from tqdm import tqdm

        total = runner.total_requests
        if total is not None:
            self.bar = tqdm(total=total, unit="req", dynamic_ncols=True)
            self.by_time = False
        else:
            self.bar = tqdm(total=round(runner.end_time), unit="s", dynamic_ncols=True)
            self.by_time = True

    def __call__(self, r: Runner) -> None:
        if self.bar is None:
            return
        now = r.now()
        recent = [(lat, code) for done, lat, code in r.rec.recent if done >= now - 5.0]
        ok = [lat for lat, code in recent if 200 <= code < 300]
        p95 = f"{np.percentile(ok, 95) * 1000:.0f}ms" if ok else "-"
        self.bar.n = min(int(now), self.bar.total) if self.by_time else len(r.rec)
        self.bar.set_postfix(rps=f"{len(ok) / 5.0:.1f}", err=r.errors, r429=r.throttled, p95=p95,
                             inflight=r.in_flight, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def prepare(a: argparse.Namespace) -> tuple[RunConfig, RequestFactory, dict[str, Any]]:
    """Everything checkable before sending anything (ValueError on bad arguments)."""
    check_numbers(a)
    url = embeddings_url(a.target)
    headers = request_headers(a)
    health_url = None if a.health_url == "none" else same_origin_url(url, a.health_url)
    mix = parse_mix(a.mix)
    if a.query_prefix and a.shared_prefix:
        raise ValueError("--query-prefix is --shared-prefix preset:qwen3-query: give one of them")
    prefix, prefix_ids = parse_prefix("preset:qwen3-query" if a.query_prefix else a.shared_prefix)
    if prefix_ids and (a.input_kind != "ids" or isinstance(mix, FileMix)):
        raise ValueError("a token-id --shared-prefix needs --input ids and a generated mix")
    tokenizer_desc = "no tokenizer: 1 word counted as 1 token (approximate)"
    builder: Any
    if a.tokenizer:
        builder = TextBuilder(load_tokenizer(a.tokenizer), seed=a.seed, prefix=prefix,
                              prefix_ids=prefix_ids)
        tokenizer_desc = f"{a.tokenizer} (special tokens included)"
    else:
        builder = WordBuilder(a.seed, prefix=prefix)
    if a.max_tokens is not None and a.max_tokens < builder.min_len and not isinstance(mix, FileMix):
        raise ValueError(f"--max-tokens {a.max_tokens} leaves no room: an input needs "
                         f"{builder.min_len} tokens (special tokens, shared prefix, one more)")
    if a.duration is None and a.requests is None:
        a.duration = 60.0
    extra: dict[str, Any] = {}
    if a.encoding_format:
        extra["encoding_format"] = a.encoding_format
    if a.dimensions:
        extra["dimensions"] = a.dimensions
    if a.outputs:
        extra["outputs"] = a.outputs.split(",")
    factory = RequestFactory(mix, builder, a.input_kind, parse_count(a.inputs), a.model or "",
                             a.seed, a.max_tokens, extra, a.repeat_rate)
    closed = a.rate is None
    cfg = RunConfig(url=url, mode="closed" if closed else "open", rate=a.rate or 0.0,
                    concurrency=a.concurrency or 4, duration_s=a.duration,
                    requests=a.requests, warmup_s=a.warmup,
                    warmup_requests=a.warmup_requests, timeout_s=a.timeout,
                    max_connections=a.max_connections, max_in_flight=a.max_in_flight,
                    retries_429=a.retries_429, max_run_s=a.max_run_time, headers=headers,
                    seed=a.seed, build_workers=auto_build_workers()
                    if a.build_workers is None else a.build_workers)
    shared = None
    if prefix or prefix_ids:
        n = len(builder.prefix_ids) if a.tokenizer else len(prefix.split())
        shared = {"text": prefix or None, "ids": prefix_ids or None, "tokens": n}
    info = {"health_url": health_url, "tokenizer": tokenizer_desc,
            "mix": mix.describe(), "metrics_urls": metrics_urls(url, a.metrics_url),
            "shared_prefix": shared, "file_mix": isinstance(mix, FileMix)}
    return cfg, factory, info


def content_meta(a: argparse.Namespace, factory: RequestFactory, info: dict[str, Any]
                 ) -> dict[str, Any]:
    """The report's label for what the inputs repeat: ``unique inputs`` or ``repeated
    content`` (asked for, or a file: mix that sent a text twice), with its rates."""
    stats = factory.stats.to_json()
    repeated = bool(a.repeat_rate or info["shared_prefix"] or stats["repeated_inputs"])
    if not repeated:
        how = "texts of the file, none sent twice" if info["file_mix"] else \
            "each input opens with a marker unique in the run"
    else:
        parts = []
        if a.repeat_rate:
            parts.append(f"{a.repeat_rate:.0%} of inputs asked to be exact repeats")
        elif stats["repeated_inputs"]:
            parts.append("the file's texts recur")
        parts.append(f"{stats['repeated_input_fraction']:.1%} of inputs "
                     f"({stats['repeated_token_fraction']:.1%} of tokens) repeated")
        if info["shared_prefix"]:
            parts.append(f"a {info['shared_prefix']['tokens']}-token shared prefix "
                         f"({stats['shared_prefix_token_fraction']:.1%} of tokens)")
        how = "; ".join(parts)
    return {"scenario": "repeated content" if repeated else "unique inputs", "detail": how,
            "repeat_rate": a.repeat_rate, "shared_prefix": info["shared_prefix"], **stats}


async def run_async(a: argparse.Namespace, cfg: RunConfig, factory: RequestFactory,
                    info: dict[str, Any]) -> int:
    """Run, then write results.json, summary.md and the plots; 0 when nothing failed (PASS,
    or no targets and no errors), 1 on FAIL."""
    url, health_url = cfg.url, info["health_url"]
    card = await discover_model(url, cfg.headers) or {}
    if not factory.model:
        factory.model = str(card.get("id") or "default")
    model = factory.model
    longest = factory.mix.max_len if isinstance(factory.mix, BucketMix) else None
    if a.max_tokens is not None and longest is not None:
        longest = min(longest, a.max_tokens)
    warning = truncation_warning(longest, card.get("max_seq_len"))
    if warning:
        print(warning, file=sys.stderr)
    runner = Runner(cfg)
    progress = Progress(runner, not a.no_progress)
    runner.on_tick = progress
    t0_wall = time.time()
    out = a.out or Path("loadtest-results") / time.strftime("%Y%m%d-%H%M%S")
    mem: MemorySampler | None = None
    procs: ProcessSampler | None = None
    gauges: GaugeSampler | None = None

    def side(session: aiohttp.ClientSession, stop: asyncio.Event) -> list[Any]:
        nonlocal mem, procs, gauges
        tasks: list[Any] = []
        procs = ProcessSampler(a.sample_interval, runner.t0, a.watch_pid)
        tasks.append(procs.run(stop))
        if health_url:
            mem = MemorySampler(health_url, a.sample_interval, runner.t0)
            tasks.append(mem.run(session, stop))
        if a.gauge:
            gauges = GaugeSampler(same_origin_url(url, "/metrics"), a.gauge, a.sample_interval,
                                  runner.t0)
            tasks.append(gauges.run(session, stop))
        if a.checkpoint_every:
            tasks.append(checkpoints(stop))
        return tasks

    urls: list[str] = info["metrics_urls"]
    before = await cachehits.scrape_urls(urls, cfg.headers) if urls else None
    after: cachehits.Scrape | None = None

    def results(outcome: RunOutcome) -> dict[str, Any]:
        traffic = (f"closed loop, concurrency {cfg.concurrency}" if cfg.mode == "closed"
                   else f"open loop, Poisson {cfg.rate:g} req/s")
        content = content_meta(a, factory, info)
        meta = {"url": url, "model": model, "traffic": traffic, "mix": info["mix"],
                "inputs_per_request": a.inputs, "input_kind": a.input_kind, "seed": a.seed,
                "tokenizer": info["tokenizer"], "max_tokens": a.max_tokens,
                "server_max_seq_len": card.get("max_seq_len"), "truncation_warning": warning,
                "content": content, "started_at": t0_wall, "argv": sys.argv[1:],
                "build_workers": cfg.build_workers if factory.chunkable else 0}
        cache = cachehits.hit_rate(before, after, urls,
                                   content["scenario"] == "repeated content")
        if after is None and urls:
            cache["status"] = "read when the run ends"
        targets = targets_from(a)
        res = report.build_results(outcome, meta, targets, mem.to_json() if mem else None,
                                   procs.to_json() if procs else {}, a.window, cache)
        if gauges:
            res["gauges"] = gauges.to_json(outcome.measured_start, outcome.measured_end)
        return res

    async def checkpoints(stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), a.checkpoint_every)
            if not stop.is_set():
                report.write(results(runner.snapshot()), out, [])

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, runner.stop, "interrupted")
    try:
        outcome = await runner.run(factory, side)
    finally:
        progress.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
    if urls:
        after = await cachehits.scrape_urls(urls, cfg.headers)
    res = results(outcome)
    names = [] if a.no_plots else plots.write_all(res, out)
    jp, mp = report.write(res, out, names)
    m, pc = res["measured"], res["prefix_cache"]
    label = "repeated content: " if res["meta"]["content"]["scenario"] != "unique inputs" else ""
    print(f"{label}{verdict_label(res['verdict'])}: {m['ok']}/{m['attempts']} ok, "
          f"{m['requests_per_s']:.2f} req/s, {headline(m)}, "
          f"p95 {m['latency_ms']['p95']} ms, errors {m['errors']}, 429 {m['throttled_429']}; "
          f"{cachehits.describe(pc)}{' (WARNING: above 1%)' if pc['flagged'] else ''}"
          f"\nreport: {mp}\nresults: {jp}", file=sys.stderr)
    for caveat in growth_caveats(res["memory"]["growth_after_warmup"]):
        print(f"WARNING: memory growth: {caveat}", file=sys.stderr)
    return 0 if res["verdict"]["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point: 0 when the verdict passes, 1 when it fails (errors fail a run without
    targets too), 2 on bad arguments."""
    ap = build_parser()
    try:
        a = ap.parse_args(argv)
    except SystemExit as e:  # argparse has said why on stderr (2), or printed --help (0)
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    try:
        cfg, factory, info = prepare(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"embedserve loadtest: {e}", file=sys.stderr)
        return 2
    return asyncio.run(run_async(a, cfg, factory, info))


if __name__ == "__main__":
    raise SystemExit(main())
