"""Re-derive throughput in a suite result measured before the load generator's drain fix.

Until then, `embedserve loadtest` divided a closed loop's tokens by the time until its last
answer came back, not by the time it was sending: a run of requests that take a second
each read about 10% low over a 7.5-second window. Its rows record that span as
``seconds``; the window they were sent in is the case's configured duration times the
run's time scale. Crosscheck rows were measured right and stay as they are.

    python3 bench/drain_fix.py results/gpu-perf/results-as-measured.json results/gpu-perf
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import results_md
from peers import PEER_CASES
from scenarios import RAW_VS_GATEWAY

WARM_UP_S = 8.0  # the warm-up rounds' configured duration (scenarios.py, peers.py)


def configured_seconds() -> dict[str, float]:
    return {case.name: case.load.seconds for case in (*RAW_VS_GATEWAY, *PEER_CASES)} | {"warm-up": WARM_UP_S}


def fix_row(row: dict[str, Any], window_s: float) -> None:
    span = float(row["seconds"])
    if span <= window_s:
        return
    scale = span / window_s
    row["tok_s_as_reported"], row["req_s_as_reported"] = row["tok_s"], row["req_s"]
    row["tok_s"] = round(row["tok_s"] * scale)
    row["req_s"] = round(row["req_s"] * scale, 2)
    row["seconds"] = window_s


def rows(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        found = [node] if "tok_s" in node and "name" in node else []
        return found + [r for v in node.values() for r in rows(v)]
    if isinstance(node, list):
        return [r for v in node for r in rows(v)]
    return []


def main(argv: list[str]) -> int:
    source, out = Path(argv[0]), Path(argv[1])
    res = json.loads(source.read_text())
    scale = float(res["meta"].get("time_scale") or 1.0)
    seconds = configured_seconds()
    for row in rows(res["steps"]):
        if row.get("client") == "loadtest" and row.get("case") in seconds:
            fix_row(row, seconds[row["case"]] * scale)
    res["meta"]["note"] = (
        "loadtest rows re-derived by bench/drain_fix.py: tokens over the window they were sent "
        "in (the as-reported figures are kept as *_as_reported)"
    )
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "results.md").write_text(results_md.render(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
