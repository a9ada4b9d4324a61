"""Pure figures and tables for the lab's soak, perf and scale visits (no I/O, no GPU), so the
arithmetic behind each verdict is unit-tested on CPU before a device minute is spent.

A *row* is one ``embedserve loadtest`` run condensed by :func:`row_from`; the visits
(labsteps.py) tag each row with ``case``, ``side`` (``raw`` / ``gateway``) and knobs.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

# issue 7's targets: gateway tok/s over raw SGLang tok/s per case; added P50 at low load
RATIO_TARGETS = {"short": 1.2, "medium": 0.97, "long": 0.97}
ADDED_P50_MS_MAX = 3.0
SCALE_TARGET = 1.9  # issue 8: two engines behind one gateway vs one
SOAK_FRACTION = 0.85  # issue 3 asks for >= 80% of capacity; a margin for Poisson arrivals


def row_from(doc: dict[str, Any], **tags: Any) -> dict[str, Any]:
    """The figures of one loadtest ``results.json`` that the tables use."""
    m = doc["measured"]
    lat = m.get("latency_ms", {})
    wins = [w for w in doc.get("windows", []) if w.get("latency_ms", {}).get("p95") is not None]
    client = [c["cpu_percent"] for c in doc.get("memory", {}).get("client", []) if "cpu_percent" in c]
    return {
        **tags,
        "seconds": m.get("duration_s"),
        "requests": m.get("ok", 0),
        "tok_s": round(float(m.get("tokens_per_s") or 0.0)),
        "req_s": round(float(m.get("requests_per_s") or 0.0), 2),
        "p50_ms": lat.get("p50"),
        "p95_ms": lat.get("p95"),
        "p99_ms": lat.get("p99"),
        "errors": m.get("errors", 0),
        "throttled_429": m.get("throttled_429", 0),
        "error_rate": m.get("error_rate", 0.0),
        "p95_first_window_ms": wins[0]["latency_ms"]["p95"] if wins else None,
        "p95_last_window_ms": wins[-1]["latency_ms"]["p95"] if wins else None,
        # the load generator is one process: near 100% it, not the target, sets the pace
        "client_cpu_pct": round(statistics.mean(client), 1) if client else None,
    }


def soak_rate(capacity_req_s: float, fraction: float = SOAK_FRACTION) -> float:
    """Open-loop arrival rate for the soak: ``fraction`` of the closed-loop capacity."""
    if capacity_req_s <= 0:
        raise ValueError("capacity must be positive (did the capacity run answer anything?)")
    return round(capacity_req_s * fraction, 3)


def pick_best(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The gateway knob setting with the most tokens/s among runs without errors."""
    clean = [r for r in rows if r.get("side") == "gateway" and not r.get("errors")]
    return max(clean, key=lambda r: r["tok_s"], default=None)


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [float(r[key]) for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def side_by_side(rows: list[dict[str, Any]], base: str, alt: str) -> list[dict[str, Any]]:
    """Per case, the medians of the alternating ``base`` and ``alt`` runs (keys prefixed with
    the side), tok/s ratio alt/base and the P50 that ``alt`` adds."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        b = [r for r in rows if r["case"] == case and r["side"] == base]
        a = [r for r in rows if r["case"] == case and r["side"] == alt]
        b_tok, a_tok = _median(b, "tok_s"), _median(a, "tok_s")
        b_p50, a_p50 = _median(b, "p50_ms"), _median(a, "p50_ms")
        out.append({"case": case, "runs": f"{len(b)}+{len(a)}", f"{base}_tok_s": b_tok,
                    f"{alt}_tok_s": a_tok,
                    "ratio": round(a_tok / b_tok, 3) if b_tok and a_tok is not None else None,
                    f"{base}_p50_ms": b_p50, f"{alt}_p50_ms": a_p50,
                    "added_p50_ms": round(a_p50 - b_p50, 2) if b_p50 is not None and a_p50 is not None
                    else None,
                    f"{base}_p95_ms": _median(b, "p95_ms"), f"{alt}_p95_ms": _median(a, "p95_ms"),
                    "errors": sum(int(r.get("errors") or 0) for r in a + b)})
    return out


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Raw SGLang against the gateway per case, each against issue 7's target (``pass`` is
    None where no target applies; any error fails the case)."""
    out = side_by_side(rows, "raw", "gateway")
    for c in out:
        target: str | None = None
        ok: bool | None = None
        if c["case"] in RATIO_TARGETS:
            target = f">= {RATIO_TARGETS[c['case']]}x raw tok/s"
            ok = c["ratio"] is not None and c["ratio"] >= RATIO_TARGETS[c["case"]]
        elif c["case"] == "low":
            target = f"P50 <= raw + {ADDED_P50_MS_MAX:g} ms"
            ok = c["added_p50_ms"] is not None and c["added_p50_ms"] <= ADDED_P50_MS_MAX
        c |= {"target": target, "pass": ok if not c["errors"] else False}
    return out


def scale_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per load, the best tok/s over the concurrencies tried with 1 and with 2 replicas (the
    verdict), and the best 2-replica/1-replica ratio at the same in-flight count per engine
    (2 engines at 2c against 1 at c), which separates the engines' scaling from how deep a
    queue each one was given."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        ok = [r for r in rows if r["case"] == case and not r.get("errors")]
        one, two = (max((r for r in ok if r["replicas"] == n), key=lambda r: r["tok_s"], default=None)
                    for n in (1, 2))
        ratio = round(two["tok_s"] / one["tok_s"], 3) if one and two and one["tok_s"] else None
        tok = {(r["replicas"], r["conc"]): r["tok_s"] for r in ok}
        per_engine = [tok[(2, 2 * c)] / t for (n, c), t in tok.items() if n == 1 and t and (2, 2 * c) in tok]
        out.append({"per_engine_ratio": round(max(per_engine), 3) if per_engine else None,
                    "case": case, "one_tok_s": one and one["tok_s"], "one_conc": one and one["conc"],
                    "two_tok_s": two and two["tok_s"], "two_conc": two and two["conc"],
                    "ratio": ratio, "target": f">= {SCALE_TARGET}x",
                    "pass": ratio is not None and ratio >= SCALE_TARGET})
    return out


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:g}"
    return str(v)


def table(rows: list[dict[str, Any]], cols: list[tuple[str, str]]) -> list[str]:
    """Markdown table lines: ``cols`` is (key, header) pairs."""
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k, _ in cols) + " |" for r in rows]
    return lines


# --- results.md ---------------------------------------------------------------------------------
ROW_COLS = [("name", "run"), ("tok_s", "tok/s"), ("req_s", "req/s"), ("p50_ms", "p50 ms"),
            ("p95_ms", "p95 ms"), ("errors", "errors"), ("throttled_429", "429"),
            ("gw_cpu_pct", "gateway CPU %")]
CMP_COLS = [("case", "case"), ("runs", "runs raw+gw"), ("raw_tok_s", "raw tok/s"),
            ("gateway_tok_s", "gateway tok/s"), ("ratio", "ratio"), ("raw_p50_ms", "raw p50 ms"),
            ("gateway_p50_ms", "gw p50 ms"), ("added_p50_ms", "added p50 ms"),
            ("raw_p95_ms", "raw p95 ms"), ("gateway_p95_ms", "gw p95 ms"), ("errors", "errors"),
            ("target", "target"), ("pass", "met")]


RUN_COLS = [("tok_s", "tok/s"), ("p50_ms", "p50 ms"), ("p95_ms", "p95 ms")]
PHASE_COLS = [("phase", "phase"), ("seconds", "s"), *RUN_COLS, ("batches", "batches"),
              ("clears", "clears"), ("clear_ms_mean", "ms/clear"),
              ("end_unused_gb", "end reserved-allocated GB"),
              ("max_unused_gb", "max reserved-allocated GB"),
              ("end_inactive_split_gb", "end inactive-split GB"), ("max_reserved_gb", "max reserved GB")]
GB = 1e9


def render_engine(res: dict[str, Any], cap: int) -> str:
    """results.md of the first (engine) visit: correctness, memory, throughput, cache clearing."""
    st = res.get("steps", {})
    md = ["# GPU lab: embedserve on SGLang 0.5.17 + FlashInfer (H200)", "",
          "Produced by `loadtest/gpu_lab/lab.py` (random-weight Qwen3-Embedding-shaped "
          f"checkpoints from `service.synthetic`; cap {cap} tokens, so `--context-length "
          f"{cap + 1}`).", ""]
    for shape, info in res.get("engines", {}).items():
        md.append(f"- {shape} engine: `{' '.join(info['argv'][1:])}`")
        if ready := st.get(f"ready-{shape}", {}).get("ready_after_s"):
            md.append(f"  - ready {ready} s after launch")
    md.append("")
    cases = [{"engine": key.split("-")[-1], "path": path, **c}
             for key, path in (("correctness-0.6b", "SGLang token ids"),
                               ("correctness-4b", "SGLang token ids"), ("gateway-4b", "gateway text"))
             if st.get(key, {}).get("ok") for c in st[key].get("cases", [])]
    md += ["## Correctness (cosine vs transformers forward pass, last token, L2 norm)", ""]
    md += [*table(cases, [("engine", "engine"), ("path", "path"), ("case", "case"),
                          ("tokens", "tokens"), ("eos_last", "EOS last"),
                          ("cos_bfloat16", "cos vs bf16 ref"), ("cos_float32", "cos vs fp32 ref")]), ""]
    mem = st.get("memory-4b-idle", {})
    if mem.get("ok"):
        nv = mem["nvml"]
        md += ["## GPU memory (4B engine, NVML, its process group)", "",
               f"- idle after start: engine {nv['per_engine'].get('4b', 0) / GB:.2f} GB, "
               f"device used {nv['device_used'] / GB:.2f} of {nv['device_total'] / GB:.1f} GB"]
        md += [f"- plugin (scheduler pid {ps['pid']}): allocated {ps['allocated_bytes'] / GB:.2f} GB, "
               f"reserved {ps['reserved_bytes'] / GB:.2f} GB" for ps in mem.get("plugin_stats", [])]
        md.append("")
    thr = st.get("throughput-4b", {})
    if thr.get("ok"):
        rows = [{**r, "errors": sum(r["errors"].values())} for r in thr["rows"]]
        md += ["## Throughput (4B, token ids straight to SGLang, closed loop)", ""]
        md += [*table(rows, [("load", "load"), ("bs", "bs"), ("conc", "conc"), RUN_COLS[0],
                             ("req_s", "req/s"), *RUN_COLS[1:], ("errors", "errors"),
                             ("engine_gpu_peak_gb", "engine GPU peak GB"),
                             ("baseline_default_pool_tok_s", "README default pool tok/s"),
                             ("vs_default_pool", "ratio")]), ""]
    cc = st.get("cache-clearing-4b", {})
    if cc.get("ok"):
        md += ["## Cache clearing (4B, seed length mix, 1-16 inputs/request, conc 32)", ""]
        md += [*table(cc["phases"], [*PHASE_COLS[:5], ("p99_ms", "p99 ms"), *PHASE_COLS[5:],
                                     ("engine_gpu_peak_gb", "engine GPU peak GB")]), ""]
    var = st.get("variants-noexp-overlap", {})
    if var.get("ok"):
        md += ["### Same run with torch's default allocator (no `expandable_segments`)", ""]
        md += [*table(var["cache_noexp"]["phases"], PHASE_COLS), ""]
    runs = [{"variant": "expandable (default launch)", **r}
            for r in thr.get("rows", []) + thr.get("reruns_short", [])
            if r["load"] == "16-512" and r["bs"] == 1]
    runs += [{"variant": "expandable + overlap on", **r} for r in var.get("overlap_on", [])]
    runs += [{"variant": "no expandable_segments", **r} for r in var.get("noexp_short", [])]
    runs += st.get("variants-ab", {}).get("runs", [])
    short = [r["tok_s"] for r in runs if r["variant"].startswith("expandable (default")
             and r["load"] == "16-512" and r["bs"] == 1]
    if runs:
        md += ["## Launch variants, every run (4B, random token ids, closed loop)", ""]
        md += [*table(runs, [("variant", "variant"), ("load", "load"), ("bs", "bs"), ("conc", "conc"),
                             ("seconds", "s"), *RUN_COLS]), ""]
        if short:
            md += [f"16-512 tokens, bs 1, conc 64 with the default launch: {len(short)} runs, mean "
                   f"{statistics.fmean(short):,.0f} tok/s, median {statistics.median(short):,.0f} "
                   f"(README default pool: 59,870), range {min(short):,}-{max(short):,}.", ""]
    return "\n".join(md + failed_steps(st))


def failed_steps(st: dict[str, Any]) -> list[str]:
    failed = {k: v.get("error") for k, v in st.items() if not v.get("ok")}
    return ["## Failed steps", "", *(f"- {k}: `{v}`" for k, v in failed.items()), ""] if failed else []


def vector_lines(vc: dict[str, Any]) -> list[str]:
    """The vector check of a side-by-side step; older visits recorded only the batched cosine."""
    verdict = "ok" if vc["ok"] else "MISMATCH"
    if "hop_cos" not in vc:
        return [f"Vectors, same token ids ({vc['tokens']}) through the gateway and straight to "
                f"SGLang: min cosine {vc['min_cos']} ({verdict})."]
    return [f"Vectors, token ids of {vc['tokens']} tokens, cosine per input:",
            f"- each input alone, gateway vs SGLang: {vc['hop_cos']} ({verdict}, >= 0.9999)",
            f"- all three in one request, gateway vs SGLang: {vc['batch_cos']}",
            f"- SGLang against itself (the same batched request repeated, and each input alone): "
            f"{vc['raw_spread_cos']}"]


def render(res: dict[str, Any], device: str = "H200") -> str:
    """results.md of a soak, perf or scale visit, from lab.py's results.json."""
    st, visit = res.get("steps", {}), res.get("visit", "?")
    md = [f"# GPU lab, {visit} visit ({device})", "",
          "Produced by `loadtest/gpu_lab/lab.py run --visit " + visit + "` (docs/LAB-RUNBOOK.md); "
          "every load is one `embedserve loadtest` run; raw = SGLang with token ids, "
          "gateway = our gateway with texts of the same token counts.", ""]
    for name, s in st.items():
        if "ready_after_s" in s:
            md.append(f"- {name}: ready {s['ready_after_s']} s after launch"
                      + (f", GPU used {s['gpu_used_gb']} GB" if s.get("gpu_used_gb") else ""))
    md.append("")
    if "soak-summary" in st and st["soak-summary"].get("ok"):
        s = st["soak-summary"]
        r = s["row"]
        md += ["## Soak (4B, seed length mix, 1-16 inputs per request, open loop)", "",
               f"- rate {s['rate']} req/s = {SOAK_FRACTION:.0%} of the closed-loop capacity's req/s; "
               f"tokens/s {r['tok_s']:,} = {s['load_vs_capacity']} of capacity ({s['capacity_tok_s']:,})",
               f"- measured {r['seconds']} s, {r['requests']:,} requests, errors {r['errors']} "
               f"(rate {r['error_rate']}), 429 {r['throttled_429']}, stop: {s['stop_reason']}",
               f"- latency p50 {r['p50_ms']} ms, p95 {r['p95_ms']} ms, p99 {r['p99_ms']} ms; P95 first "
               f"window {r['p95_first_window_ms']} ms, last {r['p95_last_window_ms']} ms",
               f"- verdict: {'PASS' if s['verdict'].get('passed') else 'FAIL'}", ""]
        md += table(s["verdict"].get("checks", []), [("check", "check"), ("value", "value"),
                                                     ("target", "target"), ("status", "status"),
                                                     ("detail", "detail")])
        series = [{"series": k, **g} for k, g in s["growth_after_warmup"].items()]
        md += ["", *table(series, [("series", "memory series"), ("first_mib", "first MiB"),
                                   ("last_mib", "last MiB"), ("growth_mib", "growth MiB"),
                                   ("growth_mib_per_hour", "MiB/h"), ("samples", "samples")]), "",
               f"Allocator (plugin, after warm-up): `{json.dumps(s['allocator'])}`", ""]
    if "sweep-4b" in st and st["sweep-4b"].get("ok"):
        rows = st["sweep-4b"]["rows"]
        md += ["## Coalescing sweep (4B, 16-512 tokens, 1 input per request, conc 64)", ""]
        md += table(rows, [("side", "side"), ("calls", "engine calls/engine"),
                           ("wait_ms", "batch max wait ms"), *ROW_COLS[1:]])
        md += ["", f"Best: `{st['sweep-4b']['best']}` (used for the side-by-side below).", ""]
    for shape in ("4b", "0.6b"):
        s = st.get(f"perf-{shape}", {})
        if s.get("ok"):
            md += [f"## Side by side, {shape} (gateway knobs {s['knobs']})", ""]
            if vc := s.get("vector_check"):
                md += [*vector_lines(vc), ""]
            md += [*table(s["comparison"], CMP_COLS), "", "<details><summary>every run</summary>", ""]
            md += [*table(s["rows"], ROW_COLS), "", "</details>", ""]
    w = st.get("warm-start-4b", {})
    if w.get("ok"):
        md += ["## Start-up with a persisted FlashInfer cache (4B)", "",
               f"- cold: {w['cold_ready_s']} s; warm relaunch, same `{w['flashinfer_cache_dir']}` "
               f"({w['cache_mb']} MB): {w['warm_ready_s']} s (target <= {w['target_s']} s: "
               f"{fmt(bool(w['warm_ready_s'] and w['warm_ready_s'] <= w['target_s']))})", ""]
    rows = [r for k in ("load-r1", "load-r2") for r in st.get(k, {}).get("rows", [])]
    if rows:
        md += ["## Scale-out: one gateway, 1 then 2 SGLang engines (one GPU each)", ""]
        md += table(scale_summary(rows), [("case", "case"), ("one_tok_s", "1 engine tok/s"),
                                          ("one_conc", "conc"), ("two_tok_s", "2 engines tok/s"),
                                          ("two_conc", "conc"), ("ratio", "ratio"),
                                          ("target", "target"), ("pass", "met"),
                                          ("per_engine_ratio", "ratio at equal in-flight per engine")])
        md += ["", *table(rows, [("replicas", "replicas"), ("conc", "conc"), *ROW_COLS,
                                 ("client_cpu_pct", "load generator CPU %")]), ""]
        for k in ("load-r1", "load-r2"):
            if st.get(k, {}).get("gpu_used_gb"):
                md.append(f"- {k}: GPU used {st[k]['gpu_used_gb']} GB")
        md.append("")
    ab = st.get("ab-load", {})
    if ab.get("ok"):
        ready = st.get("ab-ready", {})
        md += ["## Prefill CUDA graphs on vs off (4B, raw SGLang, one engine per GPU)", "",
               f"- ready after launch (warm JIT cache, launched together): graphs "
               f"{ready.get('graphs_ready_s')} s, `--disable-prefill-cuda-graph` "
               f"{ready.get('eager_ready_s')} s", ""]
        md += table(ab["comparison"], [("case", "case"), ("runs", "runs graphs+eager"),
                                       ("graphs_tok_s", "graphs tok/s"), ("eager_tok_s", "eager tok/s"),
                                       ("ratio", "eager/graphs"), ("graphs_p50_ms", "graphs p50 ms"),
                                       ("eager_p50_ms", "eager p50 ms"), ("added_p50_ms", "added p50 ms"),
                                       ("graphs_p95_ms", "graphs p95 ms"), ("eager_p95_ms", "eager p95 ms"),
                                       ("errors", "errors")])
        md += ["", *table(ab["rows"], [("case", "case"), ("side", "side"), *ROW_COLS]), ""]
    return "\n".join(md + failed_steps(st))
