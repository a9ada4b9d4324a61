"""results.md from a run's results.json: one table per section (medians over the alternating
rounds, each side beside the first), the cross-check's agreement, and what each step recorded
beside its rows. Pure: no I/O, so it is tested on any machine (bench/test_harness.py)."""

from __future__ import annotations

import json
import statistics
from typing import Any

CROSSCHECK_TOLERANCE = 0.05  # the second client must agree within 5% on tok/s
QWEN3_TOKENS = 151669  # Qwen3-Embedding's tokenizer: 151,643 BPE ranks and 26 added tokens
# (key, header, how rounds combine): every row carries them; a column no row has is left out
COLUMNS = [("tok_s", "tok/s", "median"), ("inputs_s", "inputs/s", "median"),
           ("p50_ms", "P50 ms", "median"), ("p95_ms", "P95 ms", "median"), ("gpu_used_gb", "GPU GB", "max"),
           ("side_gpu_gb", "side GPU GB", "max"), ("gpu_busy_pct", "GPU busy %", "median"),
           ("prefix_cache_hit_rate", "cache hits", "max"),
           ("gateway_cpu_ms_per_request", "gateway CPU ms/request", "median"),
           ("gateway_loop_cpu_ms_per_request", "loop CPU ms/request", "median"),
           ("engine_tokens_per_pass", "engine tokens/pass", "median"),
           ("engine_graph_passes_pct", "graph passes %", "median"),
           ("engine_forward_ms_per_1k_tokens", "forward GPU ms/1k tokens", "median"),
           ("client_cpu_pct", "client CPU %", "median"), ("host_cpu_busy_pct", "host CPU busy %", "median"),
           ("rss_mib", "RSS MiB", "max"), ("load_average", "load avg", "median")]
RUN_COLS = [("name", "run"), ("client", "client"), ("tok_s", "tok/s"), ("req_s", "req/s"),
            ("p50_ms", "P50 ms"), ("p95_ms", "P95 ms"), ("errors", "errors"), ("gpu_used_gb", "GPU GB"),
            ("gpu_busy_pct", "GPU busy %"), ("prefix_cache_hit_rate", "cache hits"),
            ("gateway_cpu_pct", "gateway CPU %"), ("engine_tokens_per_pass", "engine tokens/pass")]


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


def table(rows: list[dict[str, Any]], cols: list[tuple[str, str]], drop_empty: bool = False) -> list[str]:
    """Markdown table lines: ``cols`` is (key, header) pairs."""
    if drop_empty:
        cols = [(k, h) for k, h in cols if any(r.get(k) is not None for r in rows)]
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    return lines + ["| " + " | ".join(fmt(r.get(k)) for k, _ in cols) + " |" for r in rows]


def combine(rows: list[dict[str, Any]], key: str, how: str) -> float | None:
    vals = [float(r[key]) for r in rows if r.get(key) is not None]
    if not vals:
        return None
    return max(vals) if how == "max" else round(statistics.median(vals), 2)


def per_side(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case, per side (in the order they ran): each figure combined over the rounds
    (medians; the worst cache hit rate and the peak memory), every round's tok/s, and
    ``vs_first``: its median tok/s over the first side's."""
    sides = list(dict.fromkeys(r["side"] for r in rows))
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case]
        first = None
        for side in sides:
            runs = [r for r in mine if r["side"] == side]
            if not runs:
                continue
            d: dict[str, Any] = {"case": case, "side": side, "runs": len(runs),
                                 "rounds": " / ".join(fmt(r.get("tok_s")) for r in runs),
                                 "errors": sum(int(r.get("errors") or 0) for r in runs)}
            d |= {key: combine(runs, key, how) for key, _, how in COLUMNS}
            first = first if first is not None else d["tok_s"]
            d["vs_first"] = round(d["tok_s"] / first, 3) if d["tok_s"] and first else None
            out.append(d)
    return out


def crosscheck_agreement(rows: list[dict[str, Any]], cross: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each crosscheck.py run against the median `embedserve loadtest` tok/s of the same case
    and side: agreement within CROSSCHECK_TOLERANCE."""
    out = []
    for c in cross:
        same = [r for r in rows if r["case"] == c["case"] and r["side"] == c["side"]]
        main = combine(same, "tok_s", "median")
        dev = round(c["tok_s"] / main - 1, 3) if main else None
        out.append({"case": c["case"], "side": c["side"], "loadtest_tok_s": main,
                    "crosscheck_tok_s": c["tok_s"], "deviation": dev, "errors": c.get("errors", 0),
                    "agree": dev is not None and abs(dev) <= CROSSCHECK_TOLERANCE and not c.get("errors")})
    return out


def section(title: str, rows: list[dict[str, Any]], cross: list[dict[str, Any]]) -> list[str]:
    cols = [("case", "case"), ("side", "side"), ("runs", "runs"), ("tok_s", "tok/s"),
            ("vs_first", "vs first"), ("rounds", "each round"), *[(k, h) for k, h, _ in COLUMNS[1:]],
            ("errors", "errors")]
    md = [f"## {title}", "", "`vs first`: tok/s over the first side's, same case.", "",
          *table(per_side(rows), cols, drop_empty=True), ""]
    if cross:
        md += ["Cross-check with bench/crosscheck.py (a second client that shares no code with "
               "`embedserve loadtest`):", "",
               *table(crosscheck_agreement(rows, cross),
                      [("case", "case"), ("side", "side"), ("loadtest_tok_s", "loadtest tok/s"),
                       ("crosscheck_tok_s", "crosscheck tok/s"), ("deviation", "deviation"),
                       ("errors", "errors"), ("agree", "within 5%")]), ""]
    return [*md, "<details><summary>every run</summary>", "",
            *table([*rows, *cross], RUN_COLS, drop_empty=True), "", "</details>", ""]


def quality_rows(quality: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per pair, keyed by the table's headers: the gate's figures against its
    thresholds, or why it did not run."""
    out = []
    for name, q in quality.items():
        m = q.get("measured") or {}
        recall = {side: r.get("recall_at_10") for side, r in (q.get("retrieval") or {}).items()}
        out.append({"pair": name, "texts": q.get("texts"), "median cosine": m.get("median_cosine"),
                    "1st pct cosine": m.get("p1_cosine"), "min cosine": (q.get("cosine") or {}).get("min"),
                    "top-10 overlap": m.get("top10_overlap"), "recall@10 base": recall.get("baseline"),
                    "recall@10 candidate": recall.get("candidate"), "passed": q.get("passed"),
                    "note": q.get("not_run") or (q.get("error") or "")[-200:] or None})
    return out


def step_lines(name: str, s: dict[str, Any]) -> list[str]:
    """What a step recorded beside its rows."""
    ready: dict[str, Any] = s["ready_s"] if isinstance(s.get("ready_s"), dict) else {}
    facts: dict[str, Any] = s.get("facts") or {}
    md = [f"- {side}: `{' '.join(map(str, argv[-24:]))}`"
          + (f", ready after {ready[side]} s" if side in ready else "")
          + "".join(f"; {k.replace('_', ' ')} {v}" for k, v in facts.get(side, {}).items()
                    if k != "log_lines")
          for side, argv in (s.get("argv") or {}).items()]
    md += [f"- {side} not run: {why[-400:]}" for side, why in (s.get("not_run") or {}).items()]
    md += [f"- {side} stopped: {why}" for side, why in (s.get("stalled") or {}).items()]
    for key, what in (("gpu_gb_idle", "idle"), ("gpu_gb_after", "after the runs")):
        gb = ", ".join(f"{k} {fmt(v)} GB" for k, v in (s.get(key) or {}).items())
        md += [f"- GPU memory of each side's processes (NVML), {what}: {gb}"] if gb else []
    if isinstance(s.get("ready_s"), int | float):
        md.append(f"- ready after {s['ready_s']} s")
    md += [f"- {note}" for note in s.get("notes") or []]
    vec = s.get("vectors") if isinstance(s.get("vectors"), dict) else s if "pairs" in s else None
    if vec and (vec.get("pairs") or vec.get("errors")):
        unit = "tokens" if vec.get("inputs") == "token ids" else "words"
        md += ["", f"Vectors, the same {vec.get('inputs')} ({fmt(vec.get('lengths'))} {unit}), each sent "
               "alone:", "",
               *table(vec["pairs"], [("pair", "pair"), ("min", "min cosine"), ("cosines", "cosines")]), ""]
        md += [f"- {k}: no vectors: `{v[-300:]}`" for k, v in vec.get("errors", {}).items()]
    if rows := quality_rows(s.get("quality") or {}):
        md += ["", "Quality gate (`embedserve quality`; thresholds: median cosine >= 0.99, 1st percentile >= "
               "0.98, top-10 overlap >= 0.9, recall@10 and nDCG@10 at most 0.01 below the baseline's):", "",
               *table(rows, [(k, k) for k in rows[0]]), ""]
    for title, rows in (s.get("tables") or {}).items():
        if rows:
            md += ["", f"{title}:", "", *table(rows, [(k, k.replace("_", " ")) for k in rows[0]]), ""]
    if s.get("torch_trace") or s.get("pyspy"):
        keys = ("row", "torch_trace", "pyspy", "torch_error")
        md += ["", "Profile:", "", "```json", json.dumps({k: s[k] for k in keys if s.get(k)}, indent=1),
               "```", ""]
    if s.get("summary") and name == "drill":
        import drill_report

        md += ["", *drill_report.table_lines(s["summary"]), "",
               "Plots and the full report: `drill/README.md`.", ""]
    return [f"### {name}", "", *md, ""] if md else []


def tokenizer_words(steps: dict[str, Any]) -> str:
    """What the checkpoints tokenised with, from the token counts the models step recorded."""
    sizes = sorted(set(((steps.get("models") or {}).get("tokenizer_tokens") or {}).values()))
    if sizes == [QWEN3_TOKENS]:
        return "Qwen3's own tokenizer"
    return f"a tokenizer of {' / '.join(f'{n:,}' for n in sizes)} tokens, not Qwen3's" if sizes else ""


def header(res: dict[str, Any]) -> list[str]:
    meta, steps = res.get("meta", {}), res.get("steps", {})
    md = [f"# embedserve benchmark ({meta.get('hardware', 'unknown hardware')})", "",
          f"How it was produced: `{meta.get('command', 'python bench/suite.py')}` (bench/README.md). "
          "Sides alternate round by round; tables show medians. Every input is unique unless a row says "
          "repeated content; `cache hits` is the target's prefix-cache hit rate over the run; GPU GB is the "
          "memory in use on the GPUs (NVML), peak over the run; `side GPU GB` that of the side's own "
          "processes.", ""]
    if words := tokenizer_words(steps):
        md += [f"Checkpoints: random weights, the exact Qwen3-Embedding shapes and {words} (`embedserve "
               "synth-model`): speed and memory depend on shapes, not weight values.", ""]
    if meta.get("dry_run"):
        md += ["**Dry run on CPU**: tiny checkpoints, the CPU engine in SGLang's place, short runs. It "
               "checks the suite and its report; its figures say nothing about performance.", ""]
    for key in ("gpus", "cpus", "python", "versions", "engine_argv", "device", "time_scale"):
        if meta.get(key) is not None:
            value = f"`{' '.join(meta[key])}`" if key == "engine_argv" else fmt(meta[key])
            md.append(f"- {key.replace('_', ' ')}: {value}")
    return [*md, ""]


def render(res: dict[str, Any]) -> str:
    """results.md of one run."""
    steps = res.get("steps", {})
    every = [r for s in steps.values() for r in s.get("rows") or [] if r.get("section")]
    cross = [r for s in steps.values() for r in s.get("crosscheck_rows") or []]
    md, done = header(res), set()
    for name, s in steps.items():
        for title in dict.fromkeys(r["section"] for r in s.get("rows") or [] if r.get("section")):
            if title not in done:
                done.add(title)
                md += section(title, [r for r in every if r["section"] == title],
                              [r for r in cross if r.get("section") == title])
        md += step_lines(name, s)
    skipped = [f"- {name}: {s['skipped']}" for name, s in steps.items() if s.get("skipped")]
    failed = [f"- {name}: `{s.get('error')}`" for name, s in steps.items() if s.get("ok") is False]
    md += ["## Not run", "", *skipped, ""] if skipped else []
    md += ["## Failed steps", "", *failed, ""] if failed else []
    return "\n".join(md)
