"""Rerank on CPU, pairs/s, side by side in one run: embedserve's default stack (the bundled
all-MiniLM-L6-v2 scoring by cosine), embedserve with a cross-encoder of ms-marco-MiniLM-L-6-v2's
shape (random weights: no model hub here; speed depends on the shape), and Infinity 0.0.78's
rerank (its torch engine) on the same cross-encoder checkpoint. A benchmark that writes numbers,
not a test.

    python -m bench.cpu.rerank_peers --out results/rerank-cpu --rounds 3 --seconds 15 \\
        --infinity-site /tmp/venv-infinity/lib/python3.11/site-packages

Every server runs for the whole run; each round runs each load on each side in turn, the order
rotating per round; tables show medians of the rounds. A request is one query and ``docs``
passages of ``words`` words, every text unique (loadtest's word builder); every side gets the same
texts in a round. A pair is one (query, passage): pairs/s = passages scored per second. The
cross-encoder sides' scores are checked against each other on the same pairs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from embedserve.loadtest.textbuild import WordBuilder
from embedserve.runtime.synth_rerank import build_cross_encoder

# bench's scripts import each other by file name, as mypy names them (bench has no packages)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_peers import MODEL, Server, embedserve, infinity

CE_NAME = "ms-marco-MiniLM-L-6-shape"


@dataclass(frozen=True)
class Load:
    name: str
    docs: int
    words: int
    conc: int


LOADS = [
    Load("1 query x 16 passages of 64 words, 4 in flight", 16, 64, 4),
    Load("1 query x 64 passages of 64 words, 1 in flight", 64, 64, 1),
]


def rerank_body(model: str, seed: int, serial: int, load: Load) -> dict[str, Any]:
    builder, rng = WordBuilder(seed * 1_000_003 + serial), random.Random(seed + serial)
    texts = [builder.build(load.words if i else 8, rng, i)[0] for i in range(load.docs + 1)]
    return {"model": model, "query": texts[0], "documents": texts[1:]}


class RerankServer(Server):
    """A server warmed up with one rerank call."""

    model: str = MODEL

    def warm_up(self) -> None:
        body = {"model": self.model, "query": "q", "documents": ["d"]}
        httpx.post(self.url, json=body, timeout=120).raise_for_status()


def rerank_side(base: Server, model: str) -> RerankServer:
    side = RerankServer(
        base.name,
        base.argv,
        base.env,
        base.port,
        "/v1/rerank" if "embedserve" in base.name else "/rerank",
        base.ready_path,
        base.cwd,
    )
    side.model = model
    return side


async def drive(side: RerankServer, load: Load, seconds: float, seed: int) -> dict[str, Any]:
    done: list[float] = []
    errors = 0
    serial = 0
    end = time.monotonic() + seconds

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal serial, errors
        while time.monotonic() < end:
            serial += 1
            body = rerank_body(side.model, seed, serial, load)
            t0 = time.monotonic()
            r = await client.post(side.url, json=body)
            if r.status_code == 200:
                done.append(time.monotonic() - t0)
            else:
                errors += 1

    start = time.monotonic()
    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(worker(client) for _ in range(load.conc)))
    span = time.monotonic() - start
    return {
        "pairs_per_s": round(len(done) * load.docs / span, 1),
        "requests": len(done),
        "errors": errors,
        "p50_ms": round(1000 * statistics.median(done), 1) if done else None,
        "load_average": round(os.getloadavg()[0], 2),
    }


def scores(side: RerankServer, body: dict[str, Any]) -> list[float]:
    r = httpx.post(side.url, json={**body, "model": side.model}, timeout=120)
    r.raise_for_status()
    return [x["relevance_score"] for x in sorted(r.json()["results"], key=lambda x: x["index"])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=15)
    ap.add_argument(
        "--infinity-site", help="site-packages with infinity-emb 0.0.78; without it, no Infinity side"
    )
    ap.add_argument("--work", type=Path, default=Path("/tmp/rerank-peers"))
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    logs = a.out / "logs"
    logs.mkdir(exist_ok=True)
    ce = build_cross_encoder(a.work / CE_NAME, "minilm-l6")
    export = {"EMBEDSERVE_ENGINE__CPU_EXPORT_DIR": str(a.work / "onnx")}
    sides = [
        rerank_side(embedserve("embedserve, bundled MiniLM (cosine)", 18101, 18201, env=export), MODEL),
        rerank_side(
            embedserve("embedserve, cross-encoder (ONNX)", 18102, 18202, "--model", str(ce), env=export),
            CE_NAME,
        ),
    ]
    if a.infinity_site:
        inf = infinity("Infinity, cross-encoder (torch)", 18103, "torch", a.infinity_site)
        inf.argv[inf.argv.index("--model-id") + 1] = str(ce)
        inf.argv[inf.argv.index("--served-model-name") + 1] = CE_NAME
        at = inf.argv.index("--pooling-method")
        del inf.argv[at : at + 2]  # an embedding setting; a cross-encoder pools its own way
        sides.append(rerank_side(inf, CE_NAME))
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        s.name: {ld.name: [] for ld in LOADS} for s in sides
    }
    try:
        for s in sides:
            s.start(logs)
        for s in sides:
            s.wait()
        check = rerank_body(CE_NAME, 99, 0, Load("check", 8, 64, 1))
        ce_scores = {s.name: scores(s, check) for s in sides if s.model == CE_NAME}
        for r in range(a.rounds):
            for ld in LOADS:
                order = sides[r % len(sides) :] + sides[: r % len(sides)]
                for s in order:
                    results[s.name][ld.name].append(asyncio.run(drive(s, ld, a.seconds, seed=r)))
    finally:
        for s in sides:
            s.stop()
    medians = {
        s: {ld: statistics.median(x["pairs_per_s"] for x in runs) for ld, runs in per.items()}
        for s, per in results.items()
    }
    values = list(ce_scores.values())
    diff = float(np.max(np.abs(np.asarray(values[0]) - np.asarray(values[1])))) if len(values) == 2 else None
    doc = {
        "produced": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": platform.processor() or platform.machine(),
        "python": sys.version.split()[0],
        "rounds": a.rounds,
        "seconds": a.seconds,
        "loads": [ld.__dict__ for ld in LOADS],
        "runs": results,
        "median_pairs_per_s": medians,
        "ready_s": {s.name: s.ready_s for s in sides},
        "cross_encoder_scores": ce_scores,
        "cross_encoder_max_score_diff": diff,
    }
    (a.out / "results.json").write_text(json.dumps(doc, indent=1))
    lines = ["| side | " + " | ".join(ld.name for ld in LOADS) + " |", "|---" * (len(LOADS) + 1) + "|"]
    lines += [
        f"| {s} | " + " | ".join(f"{m[ld.name]:,.1f}" for ld in LOADS) + " |" for s, m in medians.items()
    ]
    (a.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"cross-encoder scores, embedserve against Infinity: max difference {diff}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
