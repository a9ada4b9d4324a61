"""Benchmark: how long ``embedserve up`` takes to exit after Ctrl-C while it is starting.

Each round starts ``embedserve up`` (the CPU engine, the bundled model), sends SIGINT a given
time after the start (what a terminal's Ctrl-C delivers: the engines run in their own session)
and times the exit; a round whose stack was already up is reported as such.

    python -m bench.cpu.ctrl_c_startup --out results/ctrl-c-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# bench's scripts import each other by file name, as mypy names them (bench has no packages)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from procs import machine, port_busy, publish


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_round(offset_s: float) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDSERVE_")}
    port = _free_port()
    env.update({"HF_HUB_OFFLINE": "1", "EMBEDSERVE_ENGINE__KIND": "cpu",
                "EMBEDSERVE_GATEWAY__PORT": str(port), "EMBEDSERVE_ENGINE__PORT": str(_free_port())})
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "embedserve", "up"], stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        time.sleep(offset_s)
        listening = port_busy(port)  # the gateway serves (503 while the engine loads)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
        took = time.monotonic() - t0
        log.seek(0)
        text = log.read().decode(errors="replace")
    return {"offset_s": offset_s, "exit_s": round(took, 3), "exit_code": code,
            "gateway_listening": listening, "was_up": "embedserve is up" in text,
            "traceback": "Traceback" in text,
            "log_tail": text[-3000:] if "Traceback" in text else None}


def markdown(res: dict[str, Any]) -> str:
    lines = [
        "# Ctrl-C while `embedserve up` starts (CPU stack)",
        "",
        f"{res['machine']}; {res['when']}. `python -m bench.cpu.ctrl_c_startup` with the offsets "
        "below: SIGINT to `up` that long after its start, the time until it exited. The "
        "machine was shared with other jobs.",
        "",
        "In a round whose gateway was listening, `up` stopped an engine that was still loading "
        "its model: the case where the engine used to wait for its load (or for up's 2 s grace).",
        "",
        "| SIGINT after (s) | exited after (s) | exit code | gateway listening | stack was up | traceback |",
        "|---|---|---|---|---|---|",
    ]
    yes = {True: "yes", False: "no"}
    lines += [f"| {r['offset_s']:g} | {r['exit_s']:.2f} | {r['exit_code']} | {yes[r['gateway_listening']]} "
              f"| {yes[r['was_up']]} "
              f"| {yes[r['traceback']]} |" for r in res["rounds"]]
    starting = [r["exit_s"] for r in res["rounds"] if not r["was_up"]]
    if starting:
        lines += ["", f"While starting: {min(starting):.2f}-{max(starting):.2f} s "
                  f"over {len(starting)} rounds."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Ctrl-C while embedserve up starts: time to exit")
    ap.add_argument("--offsets", default="0.5,1,1.5,2,2.5,3,3.5,4,5,6,7,8,10,12",
                    help="seconds after start, comma-separated")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    rounds = []
    for offset in (float(x) for x in a.offsets.split(",")):
        r = one_round(offset)
        print(json.dumps(r), flush=True)
        rounds.append(r)
    res = {**machine(), "rounds": rounds}
    publish(res, markdown(res), a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
