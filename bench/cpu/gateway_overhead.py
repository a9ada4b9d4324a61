"""Benchmark: what the gateway costs over calling the engine directly, in one run.

The same request sequence (same seed, lengths within the model's cap so nobody truncates)
goes to the engine as token ids and to the gateway as texts (it tokenises) and as token ids
(HTTP, validation and coalescing only), closed loop at a low and a high concurrency. Phases
alternate in rotating order over several rounds so a noisy neighbour hits all modes alike.
Prints, and writes JSON + Markdown: throughput ratio and added P50/P95 per load level.

    python -m bench.cpu.gateway_overhead --out results/gateway-overhead-cpu
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import psutil

from embedserve.loadtest.mixes import parse_count, parse_mix
from embedserve.loadtest.runner import RunConfig, Runner
from embedserve.loadtest.stats import percentiles
from embedserve.loadtest.textbuild import TextBuilder, load_tokenizer
from embedserve.loadtest.traffic import InputKind, RequestFactory

MODES: dict[str, tuple[str, InputKind]] = {
    "engine (ids)": ("engine", "ids"),
    "gateway (text)": ("gateway", "text"),
    "gateway (ids)": ("gateway", "ids"),
}


async def _get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(
        url, timeout=aiohttp.ClientTimeout(total=10)
    ) as r:
        r.raise_for_status()
        return await r.json(content_type=None)


async def phase(url: str, kind: InputKind, concurrency: int, a: argparse.Namespace,
                builder: TextBuilder, model: str) -> dict[str, Any]:
    """One closed-loop phase; returns ok latencies, counts and the measured span."""
    factory = RequestFactory(parse_mix(a.mix), builder, kind, parse_count(a.inputs), model,
                             a.seed, a.max_tokens)
    cfg = RunConfig(url=url, mode="closed", concurrency=concurrency, duration_s=a.phase,
                    warmup_s=a.warmup, timeout_s=60.0, seed=a.seed)
    out = await Runner(cfg).run(factory.make)
    rec = out.rec
    lat = [lt for lt, c, w in zip(rec.latency, rec.code, rec.warm, strict=True)
           if not w and 200 <= c < 300]
    toks = sum(t for t, c, w in zip(rec.tokens, rec.code, rec.warm, strict=True)
               if not w and 200 <= c < 300)
    bad = sum(1 for c, w in zip(rec.code, rec.warm, strict=True) if not w and not 200 <= c < 300)
    return {"latencies": lat, "ok": len(lat), "errors": bad, "tokens": toks,
            "span_s": out.measured_end - out.measured_start}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    span = sum(r["span_s"] for r in runs)
    lat = np.concatenate([np.asarray(r["latencies"], dtype=float) for r in runs])
    return {"requests_per_s": round(sum(r["ok"] for r in runs) / span, 3),
            "tokens_per_s": round(sum(r["tokens"] for r in runs) / span, 1),
            "errors": sum(r["errors"] for r in runs), "ok": int(lat.size),
            "span_s": round(span, 1), "latency_ms": percentiles(lat),
            "per_round_rps": [round(r["ok"] / r["span_s"], 3) for r in runs]}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _diff(v: float | None, base: float | None) -> str:
    return "-" if v is None or base is None else f"{v - base:+.1f}"


def markdown(doc: dict[str, Any]) -> str:
    m = doc["meta"]
    lines = [
        "# Gateway overhead vs the engine directly (CPU)", "",
        f"{m['when']} · host: {m['host']} · model `{m['model']}` · mix {m['mix']} capped at "
        f"{m['max_tokens']} tokens · {m['inputs']} input(s)/request · {m['rounds']} rounds x "
        f"{m['phase_s']} s per mode and level (after {m['warmup_s']} s warm-up), order rotated.",
        "", f"Command: `{m['command']}`", "",
        "| load | mode | req/s | tokens/s | P50 ms | P95 ms | throughput vs engine | "
        "added P50 ms | added P95 ms | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for level, modes in doc["levels"].items():
        base = modes["engine (ids)"]
        for name, s in modes.items():
            lat, blat = s["latency_ms"], base["latency_ms"]
            ratio = s["requests_per_s"] / base["requests_per_s"] if base["requests_per_s"] else 0
            same = name == "engine (ids)"
            rel = "1 (baseline)" if same else f"{ratio:.3f}"
            d50 = "-" if same else _diff(lat["p50"], blat["p50"])
            d95 = "-" if same else _diff(lat["p95"], blat["p95"])
            lines.append(
                f"| {level} | {name} | {s['requests_per_s']} | {s['tokens_per_s']:.0f} | "
                f"{_ms(lat['p50'])} | {_ms(lat['p95'])} | {rel} | {d50} | {d95} | "
                f"{s['errors']} |")
    lines += ["", "Throughput ratio per round (same round, same load, so the same neighbours):", ""]
    for level, modes in doc["levels"].items():
        base = modes["engine (ids)"]["per_round_rps"]
        for name, s in modes.items():
            if name == "engine (ids)":
                continue
            ratios = [g / b for g, b in zip(s["per_round_rps"], base, strict=True) if b]
            med = f"{float(np.median(ratios)):.3f}" if ratios else "-"
            lines.append(f"- {level}, {name}: median {med} of "
                         f"{', '.join(f'{r:.2f}' for r in ratios)}")
    lines += ["", m["note"], ""]
    return "\n".join(lines)


async def run(a: argparse.Namespace) -> dict[str, Any]:
    gw = a.gateway.rstrip("/")
    eng = a.engine.rstrip("/")
    models = await _get_json(f"{gw}/v1/models")
    card = models["data"][0]
    model = card["id"]
    if a.max_tokens is None:
        a.max_tokens = int(card.get("max_seq_len") or 256)
    if a.tokenizer is None:
        a.tokenizer = str((await _get_json(f"{eng}/get_model_info"))["model_path"])
    builder = TextBuilder(load_tokenizer(a.tokenizer), seed=a.seed)
    urls = {"engine": f"{eng}/v1/embeddings", "gateway": f"{gw}/v1/embeddings"}
    levels = {"low": a.low, "high": a.high}
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {
        lv: {m: [] for m in MODES} for lv in levels}
    names = list(MODES)
    for rnd in range(a.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for lv, conc in levels.items():
            for mode in order:
                target, kind = MODES[mode]
                r = await phase(urls[target], kind, conc, a, builder, model)
                raw[lv][mode].append(r)
                lat = percentiles(r["latencies"])
                print(f"round {rnd + 1} {lv:>4} (c={conc:>2}) {mode:<15} "
                      f"{r['ok'] / r['span_s']:7.2f} req/s  p50 {lat['p50']} ms  "
                      f"p95 {lat['p95']} ms  errors {r['errors']}", flush=True)
    return {
        "meta": {"when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                 "host": f"{platform.node()} {psutil.cpu_count()} CPUs, "
                         f"{psutil.virtual_memory().total / 2**30:.0f} GiB",
                 "gateway": gw, "engine": eng, "model": model, "mix": a.mix,
                 "max_tokens": a.max_tokens, "inputs": a.inputs, "rounds": a.rounds,
                 "phase_s": a.phase, "warmup_s": a.warmup, "seed": a.seed,
                 "concurrency": levels, "command": a.command,
                 "note": "Load generator, gateway and engine share this machine's CPUs (and "
                         "other jobs' processes may run alongside): read ratios, not "
                         "absolute figures. Engine requests carry the same token ids the "
                         "gateway would produce; no input exceeds the cap."},
        "levels": {lv: {m: summarise(runs) for m, runs in modes.items()}
                   for lv, modes in raw.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu.gateway_overhead",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gateway", default="http://127.0.0.1:8000")
    ap.add_argument("--engine", default="http://127.0.0.1:30000")
    ap.add_argument("--tokenizer", help="default: the engine's model_path")
    ap.add_argument("--mix", default="seed")
    ap.add_argument("--max-tokens", type=int, help="default: the gateway's max_seq_len")
    ap.add_argument("--inputs", default="1")
    ap.add_argument("--low", type=int, default=1, help="low-load concurrency")
    ap.add_argument("--high", type=int, default=16, help="high-load concurrency")
    ap.add_argument("--phase", type=float, default=20.0, help="measured seconds per phase")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write bench.json and bench.md here")
    a = ap.parse_args(argv)
    args = sys.argv[1:] if argv is None else argv
    a.command = "python -m bench.cpu.gateway_overhead " + " ".join(args)
    doc = asyncio.run(run(a))
    md = markdown(doc)
    print(md)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "bench.json").write_text(json.dumps(doc, indent=1))
        (a.out / "bench.md").write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
