"""Results: the JSON document and its Markdown summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from embedserve.loadtest.cachehits import describe as describe_cache
from embedserve.loadtest.runner import RunOutcome
from embedserve.loadtest.stats import aggregate, auto_window, columns, embedded_per_s, windows
from embedserve.loadtest.verdict import Targets, evaluate, growth, growth_caveats, verdict_label


def memory_series(memory: dict[str, Any] | None, processes: dict[str, Any]
                  ) -> dict[str, tuple[list[float], list[float]]]:
    """Every memory series worth a growth figure: name -> (times, bytes)."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    for key, label in (("gpu_bytes", "target GPU"), ("host_bytes", "target host"),
                       ("engine_rss_bytes", "target engine RSS"),
                       ("gateway_rss_bytes", "target gateway tree RSS (incl. engine)")):
        pts = [(s["t"], s[key]) for s in (memory or {}).get("samples", [])
               if s.get(key) is not None]
        if pts:
            out[label] = ([p[0] for p in pts], [p[1] for p in pts])
    for pid, samples in processes.get("watched_pids", {}).items():
        if samples:
            out[f"pid {pid} tree RSS"] = ([s["t"] for s in samples],
                                          [s["tree_rss_bytes"] for s in samples])
    return out


def build_results(outcome: RunOutcome, meta: dict[str, Any], targets: Targets,
                  memory: dict[str, Any] | None, processes: dict[str, Any],
                  window_s: float | None = None,
                  prefix_cache: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole results document (see docs/LOADTEST.md for the fields). ``meta.content``
    labels the inputs (unique, or the repeated-content scenario with its rates);
    ``prefix_cache`` is the target's prefix cache hit rate over the run and whether it is
    ``flagged`` (above 1% on unique inputs)."""
    c = columns(outcome.rec)
    start, end = outcome.measured_start, outcome.measured_end
    every = np.ones(len(c["t"]), dtype=bool)
    warm = c["warm"]
    first_t = float(c["t"].min()) if len(c["t"]) else 0.0
    last_done = float((c["t"] + c["latency"]).max()) if len(c["t"]) else 0.0
    win = window_s or auto_window(end - start)
    wins = windows(c, start, end, win)
    measured = aggregate(c, ~warm, end - start)
    series = memory_series(memory, processes)
    growths = {name: growth(ts, vs, start) for name, (ts, vs) in series.items()}
    return {
        "meta": {**meta, "window_s": win, "stop_reason": outcome.stop_reason,
                 "wall_s": round(outcome.wall_s, 3)},
        "totals": aggregate(c, every, max(last_done - first_t, 1e-9)),
        "warmup": aggregate(c, warm, max(start - first_t, 1e-9)),
        "measured": {"start_s": round(start, 3), "end_s": round(end, 3),
                     "duration_s": round(end - start, 3), **measured},
        "client": {"dropped_arrivals": outcome.dropped_arrivals,
                   "dispatch_lag_ms_max": outcome.dispatch_lag_ms_max},
        "error_samples": outcome.error_samples,
        "windows": wins,
        "memory": {"health_memory": memory, "growth_after_warmup": growths, **processes},
        "verdict": evaluate(targets, measured, wins, growths),
        "prefix_cache": prefix_cache or {"status": "not exposed", "hit_rate": None,
                                         "flagged": False},
    }


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def _content_lines(res: dict[str, Any]) -> list[str]:
    """What the inputs repeat and what the target's prefix cache served: a labelled
    repeated-content run says so above its figures; a unique-input run whose target still
    served more than 1% from its cache gets a warning."""
    content = res["meta"].get("content") or {}
    pc = res.get("prefix_cache") or {"status": "not exposed"}
    lines = []
    if content.get("scenario") == "repeated content":
        lines += [f"**Repeated content (a scenario of its own)**: {content['detail']}. The "
                  "figures below include whatever the target's caches gave; they are not "
                  "headline figures and compare only with runs of the same scenario.",
                  f"Cache benefit of the repeated content: {describe_cache(pc)}.", ""]
    else:
        if content:
            lines.append(f"Inputs: {content.get('scenario', 'unique inputs')} "
                         f"({content.get('detail', '')}).")
        lines += [f"Target {describe_cache(pc)}.", ""]
    if pc.get("flagged"):
        lines += [f"> **WARNING: the target served {pc['hit_rate']:.2%} of prompt tokens from "
                  f"its prefix cache (over {pc.get('max_hit_rate', 0.01):.0%}) on inputs meant "
                  "to be unique: these figures measure the cache as much as the engine.**", ""]
    return lines


def markdown(res: dict[str, Any], plots: list[str]) -> str:
    """A one-page summary an operator can read at a glance."""
    m, meta, v = res["measured"], res["meta"], res["verdict"]
    lat = m["latency_ms"]
    verdict = verdict_label(v)
    if str(meta.get("stop_reason", "")).startswith("running"):
        verdict = f"running, {meta['wall_s'] / 60:.0f} min in (checkpoint; so far: {verdict})"
    lines = [
        f"# Load test: {verdict}",
        "",
        f"Target `{meta['url']}` · {meta['traffic']} · mix: {meta['mix']} · "
        f"inputs/request {meta['inputs_per_request']} · sent as {meta['input_kind']} · "
        f"seed {meta['seed']}",
        f"Lengths measured with: {meta['tokenizer']}. Stopped: {meta['stop_reason']}.",
        "",
        *([f"**{meta['truncation_warning']}**", ""] if meta.get("truncation_warning") else []),
        *_content_lines(res),
        "| measured (after warm-up) | value |",
        "|---|---|",
        f"| duration | {m['duration_s']:.1f} s |",
        f"| attempts / ok / errors / 429 | {m['attempts']} / {m['ok']} / {m['errors']} / "
        f"{m['throttled_429']} |",
        f"| throughput | {fmt(m['requests_per_s'])} req/s · {fmt(m['tokens_per_s'])} tokens/s "
        f"sent · {fmt(m['embedded_tokens_per_s'])} tokens/s embedded (server usage) |",
        f"| latency ms p50 / p90 / p95 / p99 / max | {fmt(lat['p50'])} / {fmt(lat['p90'])} / "
        f"{fmt(lat['p95'])} / {fmt(lat['p99'])} / {fmt(lat['max'])} |",
        f"| error rate | {m['error_rate']:.4%} |",
        f"| by status | {', '.join(f'{k}: {n}' for k, n in m['by_status'].items()) or '-'} |",
        f"| totals incl. warm-up | {res['totals']['attempts']} attempts, "
        f"{res['totals']['tokens_sent']} tokens sent |",
        "",
    ]
    lines += ["## Verdict", ""]
    if not v.get("targets_given", True):
        lines += ["No targets were given (`--max-p95-ms`, `--min-rps`, ...): the run fails on "
                  "errors (`--max-error-rate` allows a share; 429s are throttling, not errors) "
                  "or when nothing was sent, and never passes.", ""]
    lines += ["| check | value | target | result | detail |", "|---|---|---|---|---|"]
    lines += [f"| {c['check']} | {fmt(c['value'])} | {fmt(c['target'])} | "
              f"{c['status'].upper()} | {c['detail']} |" for c in v["checks"]]
    lines.append("")
    growths = res["memory"]["growth_after_warmup"]
    hm = res["memory"].get("health_memory") or {}
    lines += ["## Memory", "", f"`/health/memory`: {hm.get('status', 'not requested')}.", ""]
    if any(growths.values()):
        lines += ["| series | after warm-up | last | growth | per hour | samples |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {k} | {g['first_mib']} MiB | {g['last_mib']} MiB | {g['growth_mib']} MiB | "
                  + (f"{g['growth_mib_per_hour']} MiB/h" if g.get("growth_mib_per_hour") is not None
                     else "-") + f" | {g['samples']} |"
                  for k, g in growths.items() if g]
        lines.append("")
        for caveat in growth_caveats(growths):
            lines += [f"> **WARNING (memory growth): {caveat}.**", ""]
    fc = [s for s in hm.get("samples", []) if s.get("hours_to_oom") is not None]
    if fc:
        hrs = [s["hours_to_oom"] for s in fc]
        lines += [f"Forecast hours to OOM along the run: first {fmt(hrs[0])}, min "
                  f"{fmt(min(hrs))}, last {fmt(hrs[-1])}; restart advised in "
                  f"{sum(1 for s in fc if s.get('recommends_restart'))} of {len(fc)} samples.",
                  ""]
    elif hm.get("samples"):
        last = hm.get("last_answer") if isinstance(hm.get("last_answer"), dict) else {}
        lines += [f"No hours-to-OOM estimate in any sample; the target's last reason: "
                  f"{(last or {}).get('reason', '-')!s}", ""]
    for kind in ("host", "gpu"):
        worst = [s[f"{kind}_hours_low"] for s in hm.get("samples", [])
                 if s.get(f"{kind}_hours_low")]
        if worst:
            lines += [f"{kind.upper()} worst case (steepest slope in its interval) in "
                      f"{len(worst)} samples: min {fmt(min(worst))} h, last {fmt(worst[-1])} h.",
                      ""]
    for name, g in (res.get("gauges") or {}).get("measured", {}).items():
        lines += [f"Gauge `{name}` on the target's /metrics over the measured time: median "
                  f"{fmt(g['median'])}, min {fmt(g['min'])}, max {fmt(g['max'])} "
                  f"({g['samples']} samples).", ""]
    wins = res["windows"]
    if wins:
        lines += [f"## Windows ({meta['window_s']:g} s)", "",
                  "Tokens/s embedded: the server's `usage` (what it embedded, after its "
                  "truncation); tokens/s sent: what the successful requests carried.", "",
                  "| start s | req/s | tokens/s embedded | tokens/s sent | errors | 429 | "
                  "p50 ms | p95 ms | p99 ms |",
                  "|---|---|---|---|---|---|---|---|---|"]
        shown = wins if len(wins) <= 24 else [*wins[:12], None, *wins[-12:]]
        for w in shown:
            if w is None:
                lines.append("| ... | | | | | | | | |")
                continue
            lw = w["latency_ms"]
            lines.append(f"| {w['t_start']:.0f} | {fmt(w['requests_per_s'])} | "
                         f"{fmt(embedded_per_s(w))} | {fmt(w['tokens_per_s'])} | "
                         f"{w['errors']} | {w['throttled_429']} | "
                         f"{fmt(lw['p50'])} | {fmt(lw['p95'])} | {fmt(lw['p99'])} |")
        lines.append("")
    if res["error_samples"]:
        lines += ["## First error of each kind", ""]
        lines += [f"- `{k}`: {s[:200]!r}" for k, s in res["error_samples"].items()]
        lines.append("")
    cl = res["memory"].get("client") or []
    if cl:
        cpu = [s["cpu_percent"] for s in cl]
        lines += [f"Load generator: CPU mean {np.mean(cpu):.0f}% (max {max(cpu):.0f}%), RSS "
                  f"{cl[-1]['rss_bytes'] / 2**20:.0f} MiB; dropped arrivals "
                  f"{res['client']['dropped_arrivals']}; worst dispatch lag "
                  f"{res['client']['dispatch_lag_ms_max']} ms.", ""]
    lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def write(res: dict[str, Any], out: Path, plots: list[str]) -> tuple[Path, Path]:
    """Write results.json and summary.md into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    jp, mp = out / "results.json", out / "summary.md"
    jp.write_text(json.dumps(res, indent=1, default=str))
    mp.write_text(markdown(res, plots))
    return jp, mp
