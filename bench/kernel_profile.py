"""The same requests through each side's forward under the torch profiler, nothing else sent meanwhile:
GPU ms per 1,000 of the answers' tokens by kernel class (``profile_engine.KERNEL_CLASSES``), idle time
between kernels, and the kernels that take most of each class (bench/README.md, "Kernels")."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import harness
from harness import Host, Side
from measure import Load, run_crosscheck, target
from procs import http_post_json
from profile_engine import KERNEL_CLASSES, load_trace, summarise_trace

CLASSES = [*(kind for kind, _ in KERNEL_CLASSES), "other"]
#: the longest input, as a share of the cap: no side refuses one (bench/README.md, "Kernels"; with
#: 8,176-word texts vLLM refused 14 of 800 requests, and its time per token left out their attention)
INPUT_CAP_SHARE = 0.5
POLL_S = 2.0  # how often a trace's folder is looked at while it is written


def profiled_servers(host: Host, side: Side) -> list[tuple[str, dict[str, Any]]]:
    """Where a side's profiler starts and stops, with the body each wants: every SGLang engine of a
    stack, to a folder of its own; else the side itself (vLLM: its folder is set at its launch)."""
    folder = harness.trace_dir(host, side)
    return [(f"http://127.0.0.1:{port}", {"output_dir": str(folder / str(port)), "activities": ["GPU"],
                                         "with_stack": False, "record_shapes": False})
            for port in side.engine_ports()] or [(f"http://127.0.0.1:{side.port}", {})]


def post(url: str, body: dict[str, Any]) -> None:
    with contextlib.suppress(ValueError):  # answered in plain text (SGLang) or with no body (vLLM)
        http_post_json(url, body, timeout=180)  # vLLM's stop returns once its trace is written


def files(folder: Path) -> set[Path]:
    return set(folder.rglob("*.json*")) if folder.exists() else set()


def new_traces(folder: Path, before: set[Path], count: int, wait_s: float = 120) -> list[Path]:
    """The traces written since ``before``, once ``count`` exist and their sizes hold still."""
    deadline, sizes = time.time() + wait_s, None
    while True:
        found = sorted(files(folder) - before)
        now = [p.stat().st_size for p in found]
        if (len(found) >= count and now == sizes) or time.time() > deadline:
            return found
        sizes = now
        time.sleep(POLL_S)


def per_thousand(summaries: Sequence[dict[str, Any]], tokens: int) -> dict[str, float]:
    """ms per 1,000 tokens of each kernel class, of all kernels, and idle between kernels (every
    engine's trace summed)."""
    ms: dict[str, float] = collections.defaultdict(float)
    for s in summaries:
        for kind, value in (s.get("kernel_ms_by_kind") or {}).items():
            ms[kind] += value
        ms["idle"] += s.get("span_ms", 0.0) - s.get("gpu_busy_ms", 0.0)
    ms["kernels"] = sum(ms[kind] for kind in CLASSES)
    return {kind: round(ms[kind] * 1000 / tokens, 3) for kind in [*CLASSES, "kernels", "idle"]}


def profile_side(host: Host, side: Side, load: Load, seed: int, requests: int) -> dict[str, Any]:
    """A warm-up of other inputs, then the profiler on, ``requests`` requests, the profiler off."""
    t, folder = target(host, side), harness.trace_dir(host, side)
    t = dataclasses.replace(t, cap=int(t.cap * INPUT_CAP_SHARE))
    run_crosscheck(t, load, seed + 1, requests=max(64, requests // 10))  # first batches' one-time work
    servers, before = profiled_servers(host, side), files(folder)
    started: list[str] = []
    try:
        for url, body in servers:
            post(url + "/start_profile", body)
            started.append(url)
        row = run_crosscheck(t, load, seed, requests=requests)
    except Exception as exc:  # no profiler there, or no answers: a finding, the other sides go on
        return {"not_run": repr(exc)[:300]}
    finally:
        for url in started:
            with contextlib.suppress(OSError):
                post(url + "/stop_profile", {})
    traces = new_traces(folder, before, len(servers))
    summaries = [summarise_trace(load_trace(p)) for p in traces]
    out = {k: row.get(k) for k in ("tokens", "requests", "errors", "tok_s", "prefix_cache_hit_rate")}
    out |= {"traces": [str(p.relative_to(folder)) for p in traces], "summaries": summaries}
    if row.get("tokens") and any(s.get("kernels") for s in summaries):
        out["per_1k_tokens"] = per_thousand(summaries, row["tokens"])
    return out


def tables(results: dict[str, dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """GPU ms per 1,000 tokens by class, a column per side and the first side's excess over `vllm tuned`
    (else the last side; positive where that one is ahead); each side's top three kernels a class."""
    done = {name: r for name, r in results.items() if r.get("per_1k_tokens")}
    per_1k = {name: r["per_1k_tokens"] for name, r in done.items()}
    if not per_1k:
        return {}
    first, last = next(iter(per_1k)), "vllm tuned" if "vllm tuned" in per_1k else list(per_1k)[-1]
    rows = []
    for kind in [*CLASSES, "kernels", "idle"]:
        row = {"kernel class": kind, **{name: figures[kind] for name, figures in per_1k.items()}}
        if first != last:
            row[f"{first} minus {last}"] = round(per_1k[first][kind] - per_1k[last][kind], 3)
        rows.append(row)
    # the work each side did: equal where every side answered every request (same requests, same texts)
    for label, key in (("tokens answered", "tokens"), ("requests not answered", "errors")):
        rows.append({"kernel class": label, **{name: done[name].get(key) or 0 for name in per_1k}})
    top = []
    for name, r in done.items():
        merged: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for s in r["summaries"]:
            for kind, names in (s.get("top_kernels_by_kind_ms") or {}).items():
                merged[kind].update(names)
        top += [{"side": name, "class": kind, "kernel": kernel,
                 "ms per 1,000 tokens": round(ms * 1000 / r["tokens"], 3)}
                for kind in CLASSES for kernel, ms in merged[kind].most_common(3)]
    tokens = ", ".join(f"{name} {r['tokens']:,}" for name, r in done.items())
    refused = {name: r.get("errors") or 0 for name, r in done.items()}  # over a side's limit, or failed
    equal = len({r["tokens"] for r in done.values()}) == 1 and not any(refused.values())
    unequal = "; NOT equal work: " + ", ".join(f"{n} did not answer {k}" for n, k in refused.items())
    title = ("GPU ms per 1,000 tokens by kernel class, the same requests to each side "
             f"({tokens} tokens{'' if equal else unequal})")
    return {title: rows, "The kernels that take most of each class": top}


def step_kernels(host: Host, budget_end: float, sides: Callable[[Host], Sequence[Side]] | Sequence[Side],
                 load: Load, requests: int, seed: int) -> dict[str, Any]:
    """Each running side profiled in turn on the same requests (module docstring)."""
    results = {side.name: profile_side(host, side, load, seed, requests) if harness.running(host, side)
               else {"not_run": f"{side.key} is not running"}
               for side in (sides(host) if callable(sides) else sides)}
    return {"kernel_profiles": results, "tables": tables(results),
            "not_run": {name: r["not_run"] for name, r in results.items() if "not_run" in r}}
