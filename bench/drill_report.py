"""The leak drill's arithmetic and report: ``python bench/drill_report.py DRILL_JSON OUT_DIR`` writes
OUT_DIR/README.md and its plots from the drill.json that bench/drill.py recorded. ``summarize`` is pure
(bench/test_drill_report.py checks it on a recorded drill): the true time to the limit at each sample is
(limit - used) / leak rate; 429s and 503s (both with Retry-After) are counted apart from failures."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, NamedTuple

from report import table

ERROR_TARGET = 0.20  # the forecast's median |relative error| against the true time to the limit
GB = 1e9
CAPTIONS = {"memory.png": "Memory of each engine, the health monitor's figure and the limit",
            "forecast.png": "Forecast time to out-of-memory vs the true time to the limit",
            "requests.png": "Requests per 5 s window by status, and latency"}


# -- arithmetic ----------------------------------------------------------------------------
class Point(NamedTuple):
    t: float
    true_s: float  # seconds to the limit at the leak's rate
    forecast_s: float | None  # the health monitor's, for the drill's resource


def good_samples(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in doc.get("samples", []) if "error" not in s]


def forecast_points(samples: list[dict[str, Any]], rate: float) -> list[Point]:
    """One point per sample with used and limit (the forecast None when the resource has none)."""
    return [Point(s["t"], (s["limit"] - s["used"]) / rate,
                  None if s.get("res_hours") is None else 3600.0 * s["res_hours"])
            for s in samples if s.get("used") is not None and s.get("limit") is not None]


def forecast_error(points: list[Point], start: float, end: float) -> dict[str, Any]:
    """Relative error (forecast - true) / true over ``start <= t < end``; samples past the limit
    (true <= 0) are left out. ``no_forecast``: samples in the span that had none."""
    span = [p for p in points if start <= p.t < end and p.true_s > 0]
    errs = [(p.forecast_s - p.true_s) / p.true_s for p in span if p.forecast_s is not None]
    if not errs:
        return {"samples": 0, "no_forecast": len(span), "median_abs": None, "max_abs": None,
                "median": None, "within_target": None, "share_within_target": None}
    abs_errs = [abs(e) for e in errs]
    median_abs = statistics.median(abs_errs)
    return {"samples": len(errs), "no_forecast": len(span) - len(errs),
            "median_abs": round(median_abs, 4), "max_abs": round(max(abs_errs), 4),
            "median": round(statistics.median(errs), 4),
            "within_target": median_abs <= ERROR_TARGET,
            "share_within_target": round(sum(e <= ERROR_TARGET for e in abs_errs) / len(errs), 3)}


def count_requests(by_status: dict[str, int], dropped: int = 0) -> dict[str, Any]:
    """Everything but 2xx, 429 and 503 failed: other statuses, timeouts, refused or dropped connections."""
    failed = {k: n for k, n in by_status.items() if n and status_group(k) == "failed"}
    return {"sent": sum(by_status.values()),
            "ok": sum(n for k, n in by_status.items() if status_group(k) == "2xx"),
            "status_429": by_status.get("429", 0), "status_503": by_status.get("503", 0),
            "failed": sum(failed.values()), "failed_by_status": failed, "dropped_arrivals": dropped}


def status_group(code: str) -> str:
    """``2xx``, ``429``, ``503`` or ``failed`` for one status name of the load's report."""
    if code.isdigit() and 200 <= int(code) < 300:
        return "2xx"
    return code if code in ("429", "503") else "failed"


def peak(samples: list[dict[str, Any]], key: str, start: float = float("-inf"),
         end: float = float("inf")) -> float | None:
    """The highest sum over our engines of NVML (``gpu``) or RSS (``rss``) memory in one sample."""
    vals = [sum(v) for s in samples if start <= s["t"] <= end
            if (v := [e[key] for e in (s.get("engines") or {}).values() if e.get(key) is not None])]
    return float(max(vals)) if vals else None


def leak_start(doc: dict[str, Any]) -> float | None:
    """The leak's start: the engine's own log line, else the stack's ready time."""
    return doc.get("events", {}).get("leak_start") or doc.get("events", {}).get("ready")


def memory_key(doc: dict[str, Any]) -> str:
    return "rss" if doc["meta"].get("device") == "cpu" else "gpu"


def in_gb(v: float | None) -> float | None:
    return None if v is None else round(v / GB, 2)


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """The drill's figures from its series. The forecast's error counts from the leak's start plus
    ``min_span_s`` until the replacement started (from then the leak no longer fills the old engine)."""
    meta, ev, samples = doc["meta"], doc.get("events", {}), good_samples(doc)
    due_h = meta["health"].get("replace_below_hours")
    t0, rs, rd = leak_start(doc), ev.get("replace_start"), ev.get("replace_done")
    end = ev.get("stop") or (samples[-1]["t"] if samples else 0.0)
    points = forecast_points(samples, float(meta["rate_bytes_per_s"]))

    def rel(t: float | None) -> float | None:
        return None if t is None or t0 is None else round(t - t0, 1)

    out: dict[str, Any] = {
        "device": meta.get("device"), "rate": meta.get("rate"), "resource": meta.get("resource"),
        "limit_gb": in_gb(meta["limit_bytes"]), "replaced": rd is not None,
        "replacement_failed": ev.get("replace_failed") is not None,
        "ended": meta.get("ended"), "ready_s": round(ev["ready"] - ev["stack_start"], 1)
        if ev.get("ready") and ev.get("stack_start") else None,
        "replace_start_s": rel(rs), "replace_done_s": rel(rd),
        "swap_s": round(rd - rs, 1) if rs is not None and rd is not None else None,
        "replace_below_s": round(3600 * due_h) if due_h else None,
        "replacements_metric": max((s.get("replacements_metric") or 0 for s in samples), default=None),
    }
    old_end = rs if rs is not None else end  # the old engine's series ends where its replacement starts
    if t0 is not None:
        out["forecast_error"] = forecast_error(points, t0 + float(meta["health"].get("min_span_s", 0.0)),
                                               old_end)
        if before := [p for p in points if p.t <= old_end]:  # the limit, as the last such sample puts it
            last = before[-1]
            out["limit_reached_s"] = rel(last.t + last.true_s)
            out["true_s_at_replace_start"] = round(last.true_s, 1) if rs is not None else None
            out["forecast_s_at_replace_start"] = (
                round(last.forecast_s, 1) if rs is not None and last.forecast_s is not None else None)
    top_used = max((s["used"] for s in samples if s.get("used") is not None and s["t"] <= (rd or end)),
                   default=None)
    out["peak_used_gb"] = in_gb(top_used)
    out["limit_reached"] = top_used is not None and top_used >= meta["limit_bytes"]
    key = memory_key(doc)
    out["memory_measure"] = "NVML memory of the engines' processes" if key == "gpu" else "RSS of the engines"
    out["peak_engines_gb"] = in_gb(peak(samples, key))
    out["peak_engines_swap_gb"] = in_gb(peak(samples, key, rs or end, rd or end))
    if load := doc.get("load"):
        out["requests"] = count_requests(load.get("by_status", {}), int(load.get("dropped_arrivals") or 0))
        out["requests"]["req_s"] = load.get("requests_per_s")
    out["passed"] = bool(out["replaced"] and not out["limit_reached"]
                         and (out.get("forecast_error") or {}).get("within_target")
                         and load and out["requests"]["failed"] == 0)
    return out


# -- report --------------------------------------------------------------------------------
def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:,.3g}{unit}" if abs(v) < 100 else f"{v:,.0f}{unit}"
    return f"{v:,}{unit}" if isinstance(v, int) else f"{v}{unit}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def table_lines(s: dict[str, Any]) -> list[str]:
    fe = s.get("forecast_error") or {}
    rq = s.get("requests") or {}
    rows = {
        "forecast error, median abs. relative (target <= 20%)":
            f"{_pct(fe.get('median_abs'))} over {fe.get('samples', 0)} samples "
            f"({_pct(fe.get('share_within_target'))} of them within 20%; "
            f"signed median {_pct(fe.get('median'))})",
        "forecast error, max abs. relative": _pct(fe.get("max_abs")),
        "replacement started (after the leak's start)":
            f"{_fmt(s.get('replace_start_s'), ' s')}: true time to the limit then "
            f"{_fmt(s.get('true_s_at_replace_start'), ' s')}, "
            f"forecast {_fmt(s.get('forecast_s_at_replace_start'), ' s')}"
            f" (replace under {_fmt(s.get('replace_below_s'), ' s')})",
        "old engine stopped (replacement done)": _fmt(s.get("replace_done_s"), " s"),
        "the limit would have been reached at": _fmt(s.get("limit_reached_s"), " s"),
        "swap (start to old engine stopped)": _fmt(s.get("swap_s"), " s"),
        f"peak {s.get('resource')} used (health) vs limit":
            f"{_fmt(s.get('peak_used_gb'), ' GB')} of {_fmt(s.get('limit_gb'), ' GB')}"
            f"{' (REACHED)' if s.get('limit_reached') else ''}",
        f"peak {s.get('memory_measure')}: whole drill / across the swap":
            f"{_fmt(s.get('peak_engines_gb'), ' GB')} / {_fmt(s.get('peak_engines_swap_gb'), ' GB')}",
        "replacements (/metrics)": _fmt(s.get("replacements_metric")),
        "requests sent / ok / failed": f"{_fmt(rq.get('sent'))} / {_fmt(rq.get('ok'))} / "
                                       f"{_fmt(rq.get('failed'))} {rq.get('failed_by_status') or ''}",
        "429 / 503 (with Retry-After)": f"{_fmt(rq.get('status_429'))} / {_fmt(rq.get('status_503'))}",
        "dropped arrivals (client behind)": _fmt(rq.get("dropped_arrivals")),
        "verdict": "PASS" if s.get("passed") else "FAIL",
    }
    return table([{"k": k, "v": v} for k, v in rows.items()], [("k", "figure"), ("v", "value")])


def versions(v: str | dict[str, str]) -> str:
    return v if isinstance(v, str) else ", ".join(f"{k} {x}" for k, x in v.items())


def render_markdown(doc: dict[str, Any], plots: list[str]) -> str:
    meta, s = doc["meta"], doc.get("summary") or summarize(doc)
    cmds = meta.get("commands", {})
    env = " ".join(f"{k}={v}" for k, v in sorted((cmds.get("up_env") or {}).items()))
    cpu = meta.get("device") == "cpu"
    health = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                       for k, v in meta["health"].items())
    md = [f"# Leak drill: {meta.get('hardware')}, {Path(str(meta.get('model'))).name}, "
          f"`--drill-leak {meta.get('rate')}`", ""]
    if cpu:
        md += ["**Dry run on CPU**: a tiny checkpoint on the CPU engine, which leaks host memory; the "
               "figures check the drill and its report, not a GPU.", ""]
    md += ["How it was produced: `python bench/suite.py --only drill` (bench/drill.py). `embedserve up "
           "--drill-leak RATE` makes each engine grow its memory at RATE on purpose; the gateway's "
           "health monitor forecasts the time to out-of-memory and `up` replaces the engine when the "
           "forecast falls under `replace_below_hours`: a new engine beside the old one, warmed up, new "
           "work routed to it, the old one finishing what it holds, then stopped. An open-loop load runs "
           "from ready to the end; a sampler reads /health/memory, /metrics and the engines' memory "
           "every second. The true time to the limit is (limit - used) / rate, with the rate the drill "
           "was started with.", "",
           f"- hardware: {meta.get('hardware')}"
           + (f" ({'; '.join(meta['gpus'])})" if meta.get("gpus") else ""),
           f"- versions: {versions(meta.get('versions') or {})}",
           f"- model: `{meta.get('model')}` "
           f"({'a tiny checkpoint' if cpu else 'random weights, the real shapes'}), "
           f"max sequence length {meta.get('cap')}",
           f"- leak: {meta.get('rate')} ({meta['rate_bytes_per_s'] / 2**20:.1f} MiB/s) per engine; resource "
           f"`{meta.get('resource')}` against a limit of {meta['limit_bytes'] / GB:g} GB",
           f"- health (EMBEDSERVE_HEALTH__*): {health}",
           f"- load: {(doc.get('load') or {}).get('traffic', '-')}, {meta['config']['mix']} length mix, "
           f"{meta['config']['inputs']} inputs per request, unique inputs",
           f"- ended: {meta.get('ended')}; stack stopped "
           f"{'cleanly' if meta.get('stopped_clean') else 'by SIGKILL'}",
           "", "```", f"{env} \\", f"  {' '.join(cmds.get('up') or [])}"]
    if cmds.get("loadtest"):
        md.append(" ".join(cmds["loadtest"]))
    md += ["```", "", "## Figures", "", "Times are seconds after the leak started (the engine's log line).",
           "", *table_lines(s), ""]
    for name in plots:
        md += [f"### {CAPTIONS.get(name, name)}", "", f"![{name}]({name})", ""]
    if doc.get("log"):
        t0 = leak_start(doc) or 0.0
        rows = [{"t": f"{x['t'] - t0:+.1f}", "m": x["msg"][:160].replace("|", "/")} for x in doc["log"][:40]]
        md += ["## `up`'s log around the drill", "",
               *table(rows, [("t", "s after leak start"), ("m", "message")]), ""]
    return "\n".join(md)


def _line(ax: Any, pts: list[tuple[float, float]], *fmt: str, **kw: Any) -> None:
    if pts:
        ax.plot(*zip(*pts, strict=True), *fmt, **kw)


def _finish(fig: Any, ax: Any, doc: dict[str, Any], t0: float, path: Path, plt: Any, loc: str,
            twin: Any = None, **labels: Any) -> None:
    """The replacement's marks, labels, legend and grid, then the PNG."""
    for key, label, color in (("replace_start", "replacement started", "tab:orange"),
                              ("replace_done", "old engine stopped", "tab:green")):
        if doc.get("events", {}).get(key):
            ax.axvline(doc["events"][key] - t0, color=color, ls="--", lw=1.2, label=label)
    ax.axvline(0.0, color="grey", ls=":", lw=1, label="leak started")
    ax.set(xlabel="seconds after the leak started", **labels)
    handles, names = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels() if twin is not None else ([], [])
    ax.legend(handles + more[0], names + more[1], fontsize=8, loc=loc)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_memory(doc: dict[str, Any], path: Path, plt: Any) -> None:
    samples = good_samples(doc)
    t0, key = leak_start(doc) or samples[0]["t"], memory_key(doc)
    fig, ax = plt.subplots(figsize=(10, 5))
    for n in sorted({n for s in samples for n in s.get("engines", {})}):
        _line(ax, [(s["t"] - t0, s["engines"][n][key] / GB) for s in samples
                   if s.get("engines", {}).get(n, {}).get(key) is not None],
              lw=1.6, label=f"engine :{n} ({'NVML' if key == 'gpu' else 'RSS'})")
    _line(ax, [(s["t"] - t0, s["used"] / GB) for s in samples if s.get("used") is not None],
          color="black", lw=1, alpha=0.6,
          label=f"health: {doc['meta']['resource']} used ({samples[-1].get('measure') or ''})")
    _line(ax, [(s["t"] - t0, sum(s["device_used"]) / GB) for s in samples if s.get("device_used")],
          color="grey", lw=0.8, ls=":", label="GPU memory in use (NVML)")  # other processes included
    ax.axhline(doc["meta"]["limit_bytes"] / GB, color="tab:red", lw=1.5, label="limit")
    _finish(fig, ax, doc, t0, path, plt, "upper left", ylabel="GB",
            title=f"Memory during the drill ({doc['meta']['rate']} per engine)")


def plot_forecast(doc: dict[str, Any], path: Path, plt: Any) -> None:
    samples = good_samples(doc)
    t0, ev, health = leak_start(doc) or samples[0]["t"], doc.get("events", {}), doc["meta"]["health"]
    pts = forecast_points(samples, float(doc["meta"]["rate_bytes_per_s"]))
    old = [p for p in pts if p.t <= (ev.get("replace_start") or float("inf"))]
    fig, ax = plt.subplots(figsize=(10, 5))
    xs = [p.t - t0 for p in old]
    ax.plot(xs, [p.true_s / 60 for p in old], color="black", lw=1.5, label="true time to the limit")
    ax.fill_between(xs, [0.8 * p.true_s / 60 for p in old], [1.2 * p.true_s / 60 for p in old],
                    color="grey", alpha=0.2, label="true +-20%")
    # one engine again (the health sample after the old one's stop): the truth holds again
    new = [p for p in pts if ev.get("replace_done") and p.t > ev["replace_done"] + 2.0]
    _line(ax, [(p.t - t0, p.true_s / 60) for p in new], color="black", lw=1, ls="--",
          label="true time to the limit, new engine")
    _line(ax, [(p.t - t0, p.forecast_s / 60) for p in pts if p.forecast_s is not None], ".",
          color="tab:blue", ms=3, label="forecast (health monitor)")
    if health.get("min_span_s"):
        ax.axvline(health["min_span_s"], color="tab:purple", ls=":", lw=1,
                   label="min_span_s after the leak's start")
    if health.get("replace_below_hours"):
        ax.axhline(health["replace_below_hours"] * 60, color="tab:orange", lw=1, label="replace below")
    ax.set_ylim(0, 1.6 * max([p.true_s for p in old] or [60.0]) / 60)
    _finish(fig, ax, doc, t0, path, plt, "upper right", ylabel="minutes",
            title="Forecast time to out-of-memory vs the true time to the limit")


def plot_requests(doc: dict[str, Any], path: Path, plt: Any) -> None:
    load = doc["load"]
    wins = load["windows"]
    t0 = leak_start(doc) or wins[0]["t0"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    xs, widths, bottom = [w["t0"] - t0 for w in wins], [w["t1"] - w["t0"] for w in wins], [0.0] * len(wins)
    for label, color in (("2xx", "tab:green"), ("429", "tab:orange"), ("503", "tab:purple"),
                         ("failed", "tab:red")):
        ys = [sum(n for k, n in w["by_status"].items() if status_group(k) == label) / (w["t1"] - w["t0"])
              for w in wins]
        if any(ys) or label == "2xx":
            ax.bar(xs, ys, width=widths, bottom=bottom, align="edge", color=color, alpha=0.8, label=label)
            bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
    ax2 = ax.twinx()
    p95 = [(w["t0"] - t0 + (w["t1"] - w["t0"]) / 2, w["p95_ms"]) for w in wins if w.get("p95_ms") is not None]
    _line(ax2, p95, color="black", lw=1, marker=".", label="P95 ms")
    if p95:
        ax2.set(ylabel="P95 latency, ms", ylim=(0, None))
    _finish(fig, ax, doc, t0, path, plt, "lower left", ax2, ylabel="requests per second",
            title=f"Load by status ({load.get('traffic')})")


def write_report(doc: dict[str, Any], out: Path) -> Path:
    """README.md and the PNGs in ``out``; ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    doc = {**doc, "summary": summarize(doc)}
    plots = {"memory.png": plot_memory, "forecast.png": plot_forecast} if good_samples(doc) else {}
    if (doc.get("load") or {}).get("windows"):
        plots["requests.png"] = plot_requests
    for name, plot in plots.items():
        plot(doc, out / name, plt)
    (readme := out / "README.md").write_text(render_markdown(doc, list(plots)))
    return readme


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drill_json", type=Path)
    ap.add_argument("out", type=Path)
    a = ap.parse_args(argv)
    doc = json.loads(a.drill_json.read_text())
    print(f"{write_report(doc, a.out)}: {'PASS' if summarize(doc)['passed'] else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
