"""results.md from a suite's results.json: the arithmetic behind each table (medians over
alternating rounds, ratios, the cross-check's agreement, scale-out) and the tables. Pure:
no I/O, no GPU, so it is tested on any machine (bench/test_report.py)."""

from __future__ import annotations

import json
import statistics
from typing import Any

CROSSCHECK_TOLERANCE = 0.05  # the second client must agree within 5% on tok/s
QWEN3_TOKENS = 151669  # Qwen3-Embedding's tokenizer: 151,643 BPE ranks and 26 added tokens


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [float(r[key]) for r in rows if r.get(key) is not None]
    return round(statistics.median(vals), 2) if vals else None


def _max(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [float(r[key]) for r in rows if r.get(key) is not None]
    return max(vals) if vals else None


def side_by_side(rows: list[dict[str, Any]], base: str, alt: str) -> list[dict[str, Any]]:
    """Per case, medians of the ``base`` and ``alt`` runs, tok/s ratio alt/base, the P50 that
    ``alt`` adds, the highest GPU memory and prefix-cache hit rate seen on either side."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        b = [r for r in rows if r["case"] == case and r["side"] == base]
        a = [r for r in rows if r["case"] == case and r["side"] == alt]
        b_tok, a_tok = _median(b, "tok_s"), _median(a, "tok_s")
        b_p50, a_p50 = _median(b, "p50_ms"), _median(a, "p50_ms")
        out.append({
            "case": case, "runs": f"{len(b)}+{len(a)}", "base": base, "alt": alt,
            "base_tok_s": b_tok, "alt_tok_s": a_tok,
            "ratio": round(a_tok / b_tok, 3) if b_tok and a_tok is not None else None,
            "base_p50_ms": b_p50, "alt_p50_ms": a_p50,
            "added_p50_ms": round(a_p50 - b_p50, 2) if b_p50 is not None and a_p50 is not None else None,
            "base_p95_ms": _median(b, "p95_ms"), "alt_p95_ms": _median(a, "p95_ms"),
            "base_gpu_gb": _max(b, "gpu_used_gb"), "alt_gpu_gb": _max(a, "gpu_used_gb"),
            "base_hit_rate": _max(b, "prefix_cache_hit_rate"),
            "alt_hit_rate": _max(a, "prefix_cache_hit_rate"),
            "errors": sum(int(r.get("errors") or 0) for r in a + b)})
    return out


def crosscheck_agreement(rows: list[dict[str, Any]], cross: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each crosscheck.py run against the median `embedserve loadtest` tok/s of the same case
    and side: agreement within CROSSCHECK_TOLERANCE."""
    out = []
    for c in cross:
        same = [r for r in rows if r["case"] == c["case"] and r["side"] == c["side"]]
        main = _median(same, "tok_s")
        dev = round(c["tok_s"] / main - 1, 3) if main else None
        out.append({"case": c["case"], "side": c["side"], "loadtest_tok_s": main,
                    "crosscheck_tok_s": c["tok_s"], "deviation": dev,
                    "errors": c.get("errors", 0),
                    "agree": dev is not None and abs(dev) <= CROSSCHECK_TOLERANCE and not c.get("errors")})
    return out


def scale_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per load, tok/s with one engine and with two (same in-flight count per engine)."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        one = next((r for r in rows if r["case"] == case and r["replicas"] == 1), None)
        two = next((r for r in rows if r["case"] == case and r["replicas"] == 2), None)
        ratio = round(two["tok_s"] / one["tok_s"], 3) if one and two and one["tok_s"] else None
        out.append({"case": case, "one_tok_s": one and one["tok_s"], "one_conc": one and one["conc"],
                    "two_tok_s": two and two["tok_s"], "two_conc": two and two["conc"], "ratio": ratio,
                    "errors": sum(int(r.get("errors") or 0) for r in (one, two) if r)})
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
    if isinstance(v, list):
        return ", ".join(fmt(x) for x in v)
    return str(v)


def table(rows: list[dict[str, Any]], cols: list[tuple[str, str]]) -> list[str]:
    """Markdown table lines: ``cols`` is (key, header) pairs."""
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    return lines + ["| " + " | ".join(fmt(r.get(k)) for k, _ in cols) + " |" for r in rows]


def comparison_cols(base: str, alt: str) -> list[tuple[str, str]]:
    return [("case", "case"), ("runs", f"runs {base}+{alt}"), ("base_tok_s", f"{base} tok/s"),
            ("alt_tok_s", f"{alt} tok/s"), ("ratio", "ratio"), ("base_p50_ms", f"{base} P50 ms"),
            ("alt_p50_ms", f"{alt} P50 ms"), ("added_p50_ms", "added P50 ms"),
            ("base_p95_ms", f"{base} P95 ms"), ("alt_p95_ms", f"{alt} P95 ms"),
            ("base_gpu_gb", f"{base} GPU GB"), ("alt_gpu_gb", f"{alt} GPU GB"),
            ("base_hit_rate", f"{base} cache hits"), ("alt_hit_rate", f"{alt} cache hits"),
            ("errors", "errors")]


RUN_COLS = [("name", "run"), ("client", "client"), ("tok_s", "tok/s"), ("req_s", "req/s"),
            ("p50_ms", "P50 ms"), ("p95_ms", "P95 ms"), ("errors", "errors"),
            ("gpu_used_gb", "GPU GB"), ("prefix_cache_hit_rate", "cache hits"),
            ("gateway_cpu_pct", "gateway CPU %")]


def every_run(rows: list[dict[str, Any]]) -> list[str]:
    return ["<details><summary>every run</summary>", "", *table(rows, RUN_COLS), "", "</details>", ""]


def comparison_section(title: str, rows: list[dict[str, Any]], base: str, alt: str) -> list[str]:
    if not rows:
        return []
    cmp = side_by_side(rows, base, alt)
    return [f"## {title}", "", *table(cmp, comparison_cols(base, alt)), "", *every_run(rows)]


def rows_of(steps: dict[str, Any], prefix: str, key: str = "rows") -> list[dict[str, Any]]:
    """The rows of every step whose name starts with ``prefix`` (a scenario split in parts)."""
    return [r for name, s in steps.items() if name.startswith(prefix) for r in s.get(key) or []]


def first_of(steps: dict[str, Any], prefix: str, key: str) -> Any:
    return next((s[key] for name, s in steps.items() if name.startswith(prefix) and s.get(key)), None)


def tokenizer_words(steps: dict[str, Any]) -> str:
    """What the checkpoints tokenised with, from the token counts the models step recorded."""
    sizes = sorted(set((first_of(steps, "models", "tokenizer_tokens") or {}).values()))
    if sizes == [QWEN3_TOKENS]:
        return "Qwen3's own tokenizer"
    if not sizes:  # runs from before the step recorded it, when synth-model trained its own
        return "a 590-token byte-level BPE tokenizer trained on the fly, not Qwen3's"
    return f"a tokenizer of {' / '.join(f'{n:,}' for n in sizes)} tokens, not Qwen3's"


def header(res: dict[str, Any]) -> list[str]:
    meta = res.get("meta", {})
    md = [f"# embedserve GPU benchmark ({meta.get('hardware', 'unknown hardware')})", "",
          "How it was produced: `python bench/suite.py` (bench/README.md). Checkpoints have random "
          "weights, the exact Qwen3-Embedding shapes and "
          f"{tokenizer_words(res.get('steps', {}))} (`embedserve synth-model`): "
          "speed and memory depend on shapes, not weight values. Every input is unique unless a "
          "row says repeated content; `cache hits` is SGLang's prefix-cache hit rate over the run. "
          "GPU GB is the memory in use on the GPUs (NVML), peak over the run.", ""]
    if meta.get("device") == "cpu":
        md += ["**Dry run on CPU**: tiny checkpoints, the CPU engine in SGLang's place, short runs. It "
               "checks the suite and its report; its figures say nothing about performance.", ""]
    for key in ("gpus", "cpus", "python", "versions", "engine_argv", "device", "time_scale"):
        if meta.get(key) is not None:
            value = f"`{' '.join(meta[key])}`" if key == "engine_argv" else fmt(meta[key])
            md.append(f"- {key.replace('_', ' ')}: {value}")
    return [*md, ""]


def render(res: dict[str, Any]) -> str:
    """results.md of one run of the suite."""
    st = res.get("steps", {})
    md = header(res)
    ready = [f"- {name}: ready after {s['ready_s']} s" for name, s in st.items()
             if s.get("ready_s") and isinstance(s["ready_s"], int | float)]
    ready += [f"- {name}: {k.removeprefix('ready_s_')} engine ready after {v} s" for name, s in st.items()
              for k, v in s.items() if k.startswith("ready_s_")]
    if ready:
        md += [*ready, ""]
    for shape in ("4b", "0.6b"):
        prefix = f"raw-vs-gateway-{shape}"
        if vc := first_of(st, prefix, "vector_check"):
            md += [f"Vectors, the same token ids ({fmt(vc.get('tokens'))} tokens) each alone through the "
                   f"gateway and straight to SGLang: cosine {fmt(vc.get('cosines'))} "
                   f"({'ok' if vc.get('ok') else 'MISMATCH ' + str(vc.get('error', ''))}).", ""]
        rows = rows_of(st, prefix)
        md += comparison_section(f"Raw SGLang (token ids) vs the gateway (texts), {shape}", rows,
                                 "raw", "gateway")
        if cross := rows_of(st, prefix, "crosscheck_rows"):
            md += [f"Cross-check with bench/crosscheck.py (an independent client), {shape}:", "",
                   *table(crosscheck_agreement(rows, cross),
                          [("case", "case"), ("side", "side"), ("loadtest_tok_s", "loadtest tok/s"),
                           ("crosscheck_tok_s", "crosscheck tok/s"), ("deviation", "deviation"),
                           ("errors", "errors"), ("agree", "within 5%")]), ""]
    kv = st.get("kv-pool", {})
    if kv.get("rows"):
        md += comparison_section("KV pool: 65,536 vs 16,384 tokens (4B, raw token ids)", kv["rows"],
                                 *kv["sides"])
        md += [f"Engine GPU memory (its processes, NVML): idle {fmt_dict(kv['engine_gpu_gb_idle'])}; "
               f"after the runs {fmt_dict(kv.get('engine_gpu_gb_after', {}))}.", ""]
    radix = st.get("radix", {})
    if radix.get("rows"):
        md += comparison_section("Radix (prefix) cache on vs off (4B, through the gateway)", radix["rows"],
                                 *radix["sides"])
    md += comparison_section("Peers on the same GPU: embedserve vs Infinity 0.0.78 (same texts)",
                             rows_of(st, "peers-infinity"), "embedserve", "infinity")
    if after := first_of(dict(reversed(list(st.items()))), "peers-infinity", "gpu_gb_after"):
        md += [f"GPU memory of each server's processes after the runs: {fmt_dict(after)}.", ""]
    cap = st.get("soak-capacity", {})
    if cap.get("row"):
        r = cap["row"]
        md += ["## Soak capacity (`embedserve up`, seed mix, 1-16 inputs per request, closed loop)", "",
               f"{fmt(r['tok_s'])} tok/s, {fmt(r['req_s'])} req/s at {r['conc']} in flight, P50 "
               f"{fmt(r['p50_ms'])} ms, P95 {fmt(r['p95_ms'])} ms, errors {r['errors']}, GPU "
               f"{fmt(r['gpu_used_gb'])} GB, cache hits {fmt(r['prefix_cache_hit_rate'])}; a soak "
               f"at 85% of it: `--rate {cap['soak_rate_req_s']}`.", ""]
    scale_rows = [r for n in (1, 2) for r in st.get(f"scale-load-{n}", {}).get("rows", [])]
    if scale_rows:
        md += ["## Scale-out: one gateway, one then two 4B engines (one GPU each)", "",
               *table(scale_summary(scale_rows), [("case", "case"), ("one_tok_s", "1 engine tok/s"),
                                                  ("one_conc", "in flight"), ("two_tok_s", "2 engines tok/s"),
                                                  ("two_conc", "in flight"), ("ratio", "ratio"),
                                                  ("errors", "errors")]), "", *every_run(scale_rows)]
    md += fp8_sections(st)
    md += overlap_sections(st)
    md += small_model_sections(st)
    md += vllm_sections(st)
    md += drill_section(st.get("drill", {}).get("summary"))
    skipped = [f"- {name}: {s['skipped']}" for name, s in st.items() if s.get("skipped")]
    failed = [f"- {name}: `{s.get('error')}`" for name, s in st.items() if s.get("ok") is False]
    if skipped:
        md += ["## Not run", "", *skipped, ""]
    if failed:
        md += ["## Failed steps", "", *failed, ""]
    return "\n".join(md)


def fmt_dict(d: dict[str, Any]) -> str:
    return ", ".join(f"{k} {fmt(v)} GB" for k, v in d.items())


def quality_rows(quality: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per model: the gate's figures against its thresholds, or why it did not run.
    Reports from before the real-text corpus have no retrieval figures ("-")."""
    out = []
    for model, q in quality.items():
        m = q.get("measured") or {}
        recall = {side: r.get("recall_at_10") for side, r in (q.get("retrieval") or {}).items()}
        out.append({"model": model, "texts": q.get("texts"), "median": m.get("median_cosine"),
                    "p1": m.get("p1_cosine"), "min": (q.get("cosine") or {}).get("min"),
                    "overlap": m.get("top10_overlap"), "recall_base": recall.get("baseline"),
                    "recall_cand": recall.get("candidate"),
                    "passed": q.get("passed") if "passed" in q else None,
                    "note": q.get("not_run") or (q.get("error") or "")[-200:] or None})
    return out


def fp8_sections(st: dict[str, Any]) -> list[str]:
    md: list[str] = []
    engines = st.get("fp8-engines", {})
    if engines.get("engine_gpu_gb"):
        md += [f"FP8 scenario engines, GPU memory of each (its processes, NVML, idle): "
               f"{fmt_dict(engines['engine_gpu_gb'])}.", ""]
        md += [f"- {tag} did not start: `{why[-300:]}`" for tag, why in engines.get("failed", {}).items()]
        md += [""] if engines.get("failed") else []
    if quality := st.get("fp8-quality"):
        rows = quality_rows({k: v for k, v in quality.items() if isinstance(v, dict)})
        md += ["## FP8 quality gate: FP8 against bf16, same texts (embedserve quality)", "",
               "Thresholds: median cosine >= 0.99, 1st percentile >= 0.98, top-10 overlap >= 0.9, "
               "recall@10 and nDCG@10 at most 0.01 below bf16's, on the real-text corpus.", "",
               *table(rows, [("model", "model"), ("texts", "texts"), ("median", "median cosine"),
                             ("p1", "1st pct cosine"), ("min", "min cosine"),
                             ("overlap", "top-10 overlap"), ("recall_base", "recall@10 bf16"),
                             ("recall_cand", "recall@10 FP8"), ("passed", "passed"),
                             ("note", "note")]), ""]
    thr = st.get("fp8-throughput", {})
    if thr.get("rows"):
        md += comparison_section("FP8 vs bf16 (4B, through the gateway)", thr["rows"], *thr["sides"])
        md += [f"Engine GPU memory after the runs: {fmt_dict(thr.get('engine_gpu_gb', {}))}.", ""]
    att = st.get("attention", {})
    for name in dict.fromkeys(r["backend_pair"] for r in att.get("rows", [])):
        rows = [r for r in att["rows"] if r["backend_pair"] == name]
        md += comparison_section(f"Prefill attention: FlashInfer vs {name} (4B, bf16, through the gateway)",
                                 rows, "flashinfer", name)
    if att.get("quality"):
        md += ["Quality gate, each backend's vectors against FlashInfer's (4B, bf16):", "",
               *table(quality_rows(att["quality"]),
                      [("model", "backend"), ("median", "median cosine"), ("p1", "1st pct cosine"),
                       ("min", "min cosine"), ("overlap", "top-10 overlap"),
                       ("recall_base", "recall@10 FlashInfer"), ("recall_cand", "recall@10 backend"),
                       ("passed", "passed")]), ""]
    md += [f"- attention backend {name} not run: {why[-300:]}"
           for name, why in att.get("not_run", {}).items()]
    return md + ([""] if att.get("not_run") else [])


def multi_side(rows: list[dict[str, Any]], sides: list[str]) -> list[dict[str, Any]]:
    """Per case, each side's medians (tok/s, P50, P95), its worst cache hit rate and peak GPU
    memory; ``ratio``: embedserve's defaults' tok/s over the best vLLM side's, ``best_ratio``:
    the best embedserve side's (a variant included) over the same, and ``p50_ratio``: the best
    vLLM P50 over embedserve's defaults' P50 (above 1: embedserve answers sooner)."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case]
        d: dict[str, Any] = {"case": case, "errors": sum(int(r.get("errors") or 0) for r in mine)}
        for side in sides:
            runs = [r for r in mine if r["side"] == side]
            d[f"{side}|runs"] = len(runs)
            for key in ("tok_s", "p50_ms", "p95_ms"):
                d[f"{side}|{key}"] = _median(runs, key)
            d[f"{side}|hits"] = _max(runs, "prefix_cache_hit_rate")
        ours = [d[f"{s}|tok_s"] for s in sides if s.startswith("embedserve") and d[f"{s}|tok_s"]]
        theirs = [d[f"{s}|tok_s"] for s in sides if s.startswith("vllm") and d[f"{s}|tok_s"]]
        default = d.get("embedserve|tok_s")
        d["ratio"] = round(default / max(theirs), 3) if default and theirs else None
        d["best_ratio"] = round(max(ours) / max(theirs), 3) if ours and theirs else None
        their_p50 = [d[f"{s}|p50_ms"] for s in sides if s.startswith("vllm") and d[f"{s}|p50_ms"]]
        our_p50 = d.get("embedserve|p50_ms")
        d["p50_ratio"] = round(min(their_p50) / our_p50, 3) if our_p50 and their_p50 else None
        out.append(d)
    return out


def vllm_sections(st: dict[str, Any]) -> list[str]:
    """The vLLM peer, per shape: how each side was started, the side-by-side table, memory,
    vectors against SGLang's and a transformers forward pass, the cross-check."""
    md: list[str] = []
    for name, start in st.items():
        if not name.startswith("vllm-ready-"):
            continue
        shape = start.get("shape") or name.removeprefix("vllm-ready-")
        rows = rows_of(st, f"vllm-load-{shape}-")
        sides = list(dict.fromkeys(r["side"] for r in rows)) or list(start.get("argv", {}))
        md += [f"## vLLM 0.26.0 (pooling runner) vs embedserve, {shape}, same texts", "",
               "Every server on one GPU, each measured alone in turn, sides alternating; vLLM is sent "
               "texts (it tokenises itself). `ratio`: embedserve's defaults' tok/s over the best vLLM "
               "side's; `best ratio`: the best embedserve side's over the same; `P50 ratio`: the best "
               "vLLM P50 over embedserve's defaults' P50.", ""]
        for side, argv in start.get("argv", {}).items():
            facts = (start.get("vllm_facts") or {}).get(side, {})
            extra = (f"; attention backend {facts.get('attention_backend') or '?'}, CUDA graphs "
                     f"{facts.get('cudagraph_mode') or '?'}") if facts else ""
            env = [f"{k}={v}" for k, v in (start.get("settings") or {}).get(side, {}).items()]
            md.append(f"- {side}: `{' '.join([*env, *(str(a) for a in argv[-24:])])}`, ready after "
                      f"{fmt((start.get('ready_s') or {}).get(side))} s{extra}")
        md += [f"- {side} not run: {why[-400:]}" for side, why in (start.get("not_run") or {}).items()]
        md.append("")
        if rows:
            cmp = multi_side(rows, sides)
            cols = [("case", "case"), *[(f"{s}|tok_s", f"{s} tok/s") for s in sides], ("ratio", "ratio"),
                    ("best_ratio", "best ratio"),
                    *[(f"{s}|p50_ms", f"{s} P50 ms") for s in sides], ("p50_ratio", "P50 ratio"),
                    *[(f"{s}|p95_ms", f"{s} P95 ms") for s in sides],
                    *[(f"{s}|hits", f"{s} cache hits") for s in sides], ("errors", "errors")]
            md += [*table(cmp, cols), ""]
        idle = start.get("gpu_gb_idle") or {}
        after = first_of(st, f"vllm-load-{shape}-", "gpu_gb_after") or {}
        if idle or after:
            md += [f"GPU memory of each server's processes (NVML): idle {fmt_dict(idle)}; after the runs "
                   f"{fmt_dict(after)}.", ""]
        vec = st.get(f"vllm-vectors-{shape}", {})
        if vec.get("pairs") or vec.get("errors"):
            pairs = [{**p, "same_tokens": p.get("tokens_a") == p.get("tokens_b")} for p in vec["pairs"]]
            md += [f"Vectors, {vec.get('texts')} texts each sent alone (cosine per text):", "",
                   *table(pairs,
                          [("pair", "pair"), ("min", "min cosine"), ("cosines", "cosines"),
                           ("same_tokens", "same token counts")]), ""]
            md += [f"- {k}: no vectors: `{v[-300:]}`" for k, v in vec.get("errors", {}).items()]
        if cross := rows_of(st, f"vllm-load-{shape}-", "crosscheck_rows"):
            md += [f"Cross-check with bench/crosscheck.py, {shape}:", "",
                   *table(crosscheck_agreement(rows, cross),
                          [("case", "case"), ("side", "side"), ("loadtest_tok_s", "loadtest tok/s"),
                           ("crosscheck_tok_s", "crosscheck tok/s"), ("deviation", "deviation"),
                           ("errors", "errors"), ("agree", "within 5%")]), ""]
        if client := rows_of(st, f"vllm-load-{shape}-", "client_rows"):
            md += [f"The client alone, {shape}: `embedserve loadtest` building inputs on one thread "
                   "against its build processes, same side, alternating:", "",
                   *table(client, [("side", "client"), ("round", "round"), ("tok_s", "tok/s"),
                                   ("req_s", "req/s"), ("p50_ms", "P50 ms"),
                                   ("host_cpu_busy_pct", "host CPU busy %")]), ""]
        for step in (s for k, s in st.items() if k.startswith(f"vllm-load-{shape}-")):
            md += [f"- {side} stopped: {why}" for side, why in (step.get("stalled") or {}).items()]
            if step.get("recorded_from_log"):
                md += [f"- {step.get('shape')}: {step['recorded_from_log']}"]
        prof = st.get(f"vllm-profile-{shape}", {})
        if prof.get("torch_trace") or prof.get("pyspy"):
            keys = ("row", "torch_trace", "pyspy", "torch_error")
            md += [f"Profile of embedserve's first engine and its path, {shape} (seed mix, 64 in flight):",
                   "", "```json", json.dumps({k: prof.get(k) for k in keys if prof.get(k)}, indent=1),
                   "```", ""]
        if rows:
            md += every_run(rows)
    return md


def drill_section(s: dict[str, Any] | None) -> list[str]:
    """The leak drill's summary (bench/drill_report.py has the arithmetic, the plots and the
    full report, next to drill.json)."""
    if not s:
        return []
    fe, rq = s.get("forecast_error") or {}, s.get("requests") or {}

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.1f}%"

    def pair(a: Any, b: Any) -> str:
        return f"{a} / {b}"

    rows = [("replaced (start / old engine stopped, s after the leak's start)",
             f"{fmt(s.get('replaced'))} "
             f"({pair(fmt(s.get('replace_start_s')), fmt(s.get('replace_done_s')))})"),
            ("the limit would have been reached at (s)", fmt(s.get("limit_reached_s"))),
            ("forecast error vs true time to the limit, median / max",
             f"{pair(pct(fe.get('median_abs')), pct(fe.get('max_abs')))} ({fmt(fe.get('samples'))} samples)"),
            (f"peak {s.get('resource')} used (health) / limit, GB",
             pair(fmt(s.get("peak_used_gb")), fmt(s.get("limit_gb")))),
            (f"peak {s.get('memory_measure')}, whole drill / swap, GB",
             pair(fmt(s.get("peak_engines_gb")), fmt(s.get("peak_engines_swap_gb")))),
            ("requests sent / ok / failed / 429 / 503",
             " / ".join(fmt(rq.get(k)) for k in ("sent", "ok", "failed", "status_429", "status_503")))]
    return [f"## Leak drill (`embedserve up --drill-leak {s.get('rate')}`)", "",
            *table([{"figure": k, "value": v} for k, v in rows], [("figure", "figure"), ("value", "value")]),
            "",
            f"Verdict: {'PASS' if s.get('passed') else 'FAIL'} (replaced before the limit, forecast median "
            "error within 20%, no failed request). Plots and the full report: `drill/README.md`.", ""]


OVERLAP_COLS = [("case", "case"), ("side", "engines"), ("tok_s", "tok/s"), ("req_s", "req/s"),
                ("p50_ms", "P50 ms"), ("p95_ms", "P95 ms"), ("gpu_busy_pct", "GPU busy %"),
                ("stack_gpu_gb", "stack GPU GB"), ("prefix_cache_hit_rate", "cache hits"),
                ("gateway_cpu_pct", "gateway CPU %"), ("errors", "errors")]


def overlap_sections(st: dict[str, Any]) -> list[str]:
    """Engines per GPU: each case's configurations next to each other, and the cross-check."""
    md: list[str] = []
    for group in ("0.6b", "4b", "4b-fp8"):
        step = st.get(f"overlap-{group}", {})
        if not step.get("rows"):
            continue
        md += [f"## Engines per GPU: {group}", "", *table(step["rows"], OVERLAP_COLS), ""]
        if step.get("crosscheck"):
            md += ["Cross-check of the headline row (same load, two clients):", "",
                   *table(step["crosscheck"], RUN_COLS), ""]
    for group in ("0.6b", "4b"):
        prof = st.get(f"overlap-profile-{group}", {})
        if prof.get("torch_trace") or prof.get("pyspy"):
            md += [f"## Profile, one engine: {group}", "", "```json",
                   json.dumps({k: prof.get(k) for k in ("row", "torch_trace", "pyspy", "torch_error")
                               if prof.get(k)}, indent=1), "```", ""]
    return md


def per_side(rows: list[dict[str, Any]], sides: list[str]) -> list[dict[str, Any]]:
    """Per case, each side's median tok/s (and every round's), median P50 and the stack's GPU
    memory; ``vs_first``: its median tok/s over the first side's."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        first = _median([r for r in rows if r["case"] == case and r["side"] == sides[0]], "tok_s")
        for side in sides:
            runs = [r for r in rows if r["case"] == case and r["side"] == side]
            if not runs:
                continue
            tok = _median(runs, "tok_s")
            out.append({"case": case, "side": side, "tok_s": tok,
                        "rounds": " / ".join(fmt(r.get("tok_s")) for r in runs),
                        "vs_first": round(tok / first, 3) if tok and first else None,
                        "p50_ms": _median(runs, "p50_ms"), "p95_ms": _median(runs, "p95_ms"),
                        "gpu_busy_pct": _median(runs, "gpu_busy_pct"),
                        "stack_gpu_gb": _max(runs, "stack_gpu_gb"),
                        "gateway_ms": _median(runs, "gateway_cpu_ms_per_request"),
                        "hits": _max(runs, "prefix_cache_hit_rate"),
                        "errors": sum(int(r.get("errors") or 0) for r in runs)})
    return out


# no GPU busy share: sampled over the load generator's start-up too, it is diluted by idle
# seconds that differ from run to run (it stays in results.json)
PER_SIDE_COLS = [("case", "case"), ("side", "stack"), ("tok_s", "tok/s"), ("rounds", "each round"),
                 ("vs_first", "vs first"), ("p50_ms", "P50 ms"), ("p95_ms", "P95 ms"),
                 ("stack_gpu_gb", "stack GPU GB"),
                 ("gateway_ms", "gateway CPU ms/request"), ("hits", "cache hits"), ("errors", "errors")]


def small_model_sections(st: dict[str, Any]) -> list[str]:
    """The small-model scenario: the 0.6B matrix (with FP8), the gateway's settings side by
    side, the cross-check and the profile."""
    md: list[str] = []
    matrix = rows_of(st, "small-matrix-")
    if matrix:
        sides = list(dict.fromkeys(r["side"] for r in matrix))
        md += ["## The 0.6B: raw SGLang, the default stack and FP8", "",
               "`vs first`: tok/s over raw SGLang's (the default stack's first engine, sent token ids).",
               "", *table(per_side(matrix, sides), PER_SIDE_COLS), ""]
    gateway = rows_of(st, "small-gateway-")
    if gateway:
        sides = list(dict.fromkeys(r["side"] for r in gateway if r.get("round") == 0))
        md += ["## The 0.6B: the gateway's settings side by side", "",
               "Two rounds, the order turned in the second; `vs first`: median tok/s over the default "
               "stack's (x2).", "", *table(per_side(gateway, sides), PER_SIDE_COLS), ""]
    cross = st.get("small-crosscheck", {}).get("rows", [])
    if cross:
        md += ["Cross-check (two clients, back to back; `mix`: the lengths each sent):", "",
               *table(cross, [*RUN_COLS[:2], ("mix", "mix"), *RUN_COLS[2:]]), ""]
    prof = st.get("small-profile", {})
    if prof.get("torch_trace") or prof.get("pyspy"):
        md += ["## Profile, the default 0.6B stack", "", "```json",
               json.dumps({k: prof.get(k) for k in ("row", "torch_trace", "pyspy", "torch_error")
                           if prof.get(k)}, indent=1), "```", ""]
    return md
