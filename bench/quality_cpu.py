"""The quality gate on the CPU stack: one baseline ``embedserve up`` (the bundled
all-MiniLM-L6-v2, with ``--baseline`` settings) and, one after another, a candidate
``embedserve up`` per ``--candidate NAME=SETTINGS``, each compared with the baseline by
``embedserve quality`` on the same corpus. Both stacks run on this machine; the gate embeds
one side at a time, so they do not compete for the cores while measured.

    embedserve quality-corpus --out /tmp/python-docs.json
    python bench/quality_cpu.py --corpus /tmp/python-docs.json --out results/quality-cpu \\
        --baseline EMBEDSERVE_ENGINE__CPU_BACKEND=torch \\
        --candidate torch=EMBEDSERVE_ENGINE__CPU_BACKEND=torch \\
        --candidate onnx-fp32=EMBEDSERVE_ENGINE__CPU_BACKEND=onnx \\
        --candidate onnx-int8=EMBEDSERVE_ENGINE__CPU_BACKEND=onnx,EMBEDSERVE_ENGINE__CPU_QUANTIZATION=int8

The ``torch`` candidate is a second torch stack: the sanity check, whose recall must equal
the baseline's (``NAME=`` with no settings is a stack of the defaults). Each candidate's
report goes to ``--out/NAME/`` (quality.json, summary.md); ``--out/results.json`` and
``results.md`` gather them with the machine and versions (the stacks' logs go to the
temporary folder's embedserve-quality-cpu/). Flags after ``--`` go to ``embedserve quality``
(thresholds: ``-- --max-recall-drop 0.01``). The exit status is 0 when every candidate
passed, 1 when one missed, 2 when one could not run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from contextlib import suppress
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from procs import child_env, embedserve_cmd, log_tail, port_busy, spawn, stop_group, wait_ok


def settings(spec: str) -> dict[str, str]:
    """``K=V,K=V`` -> {K: V} (empty: the defaults)."""
    out = {}
    for item in filter(None, spec.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("EMBEDSERVE_"):
            raise argparse.ArgumentTypeError(f"wants EMBEDSERVE_NAME=VALUE pairs, got {item!r}")
        out[key] = value
    return out


def candidate(text: str) -> tuple[str, dict[str, str]]:
    name, sep, spec = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"wants NAME=SETTINGS (NAME= for the defaults), got {text!r}")
    return name, settings(spec)


class Stack:
    """``embedserve up`` on its own ports, in its own process group, until stopped."""

    def __init__(self, name: str, env: dict[str, str], port: int, log: Path) -> None:
        for p in (port, port + 20000):
            if port_busy(p):
                raise RuntimeError(f"port {p} is taken")
        argv = [*embedserve_cmd(), "up", "--port", str(port), "--engine-port", str(port + 20000)]
        self.name, self.env, self.url, self.log = name, env, f"http://127.0.0.1:{port}", log
        t0 = time.time()
        self.pid = spawn(argv, log, child_env({"EMBEDSERVE_LOG_FORMAT": "text", **env}))
        if wait_ok(self.url + "/health/ready", time.time() + 600, self.pid) is None:
            stop_group(self.pid, 30)
            raise RuntimeError(f"{name}: not ready in 600 s:\n{log_tail(log, 3000)}")
        self.ready_s = round(time.time() - t0, 1)

    def stop(self) -> None:
        stop_group(self.pid, 60)


def versions() -> dict[str, str]:
    out = {}
    for dist in ("embedserve", "torch", "sentence-transformers", "transformers", "onnxruntime"):
        with suppress(PackageNotFoundError):
            out[dist] = version(dist)
    return out


def machine() -> str:
    model = ""
    with suppress(OSError):
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    return f"{len(os.sched_getaffinity(0))} CPU cores ({model or platform.machine()})"


def gate(baseline: Stack, cand: Stack, corpus: Path, out: Path, extra: list[str]) -> dict[str, Any]:
    argv = [*embedserve_cmd(), "quality", "--baseline", baseline.url, "--candidate", cand.url,
            "--corpus", str(corpus), "--out", str(out), *extra]
    t0 = time.time()
    done = subprocess.run(argv, capture_output=True, text=True, env=child_env(), check=False)
    (out / "gate.log").parent.mkdir(parents=True, exist_ok=True)
    (out / "gate.log").write_text(done.stderr)
    if done.returncode not in (0, 1):
        return {"error": done.stderr[-1500:], "exit": done.returncode}
    report = json.loads((out / "quality.json").read_text())
    return {"exit": done.returncode, "seconds": round(time.time() - t0, 1), "report": report}


def table(results: dict[str, Any]) -> str:
    lines = ["| candidate | settings | recall@10 baseline / candidate | nDCG@10 baseline / candidate | "
             "median cosine | 1st pct | min | top-10 overlap | 10th-11th gap | passed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in results["candidates"].items():
        env = ", ".join(f"`{k}={v}`" for k, v in c["settings"].items()) or "defaults"
        if "report" not in c:
            lines.append(f"| {name} | {env} | not run: {c.get('error', '')[-200:]} |||||||| |")
            continue
        r = c["report"]
        b, k = r["retrieval"]["baseline"], r["retrieval"]["candidate"]
        lines.append(
            f"| {name} | {env} | {b['recall_at_10']:.4f} / {k['recall_at_10']:.4f} | "
            f"{b['ndcg_at_10']:.4f} / {k['ndcg_at_10']:.4f} | {r['cosine']['median']:.6f} | "
            f"{r['cosine']['p1']:.6f} | {r['cosine']['min']:.6f} | {r['top10_overlap']:.4f} | "
            f"{r['top10_boundary']['gap_k_to_next_median']:.4f} | {'yes' if r['passed'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, required=True, help="a file from embedserve quality-corpus")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--candidate", type=candidate, action="append", required=True, metavar="NAME=SETTINGS")
    ap.add_argument("--baseline", type=settings, default={}, metavar="SETTINGS",
                    help="the baseline's settings, K=V,K=V (default: none)")
    ap.add_argument("--port", type=int, default=18600, help="the baseline's; candidates take the next")
    ap.add_argument("quality_flags", nargs=argparse.REMAINDER, help="after --: for embedserve quality")
    a = ap.parse_args(argv)
    extra = [f for f in a.quality_flags if f != "--"]
    results: dict[str, Any] = {"machine": machine(), "versions": versions(), "corpus": str(a.corpus),
                               "baseline_settings": a.baseline, "started_at": time.time(), "candidates": {}}
    logs = Path(tempfile.gettempdir()) / "embedserve-quality-cpu"  # the stacks' logs, not results
    base = Stack("baseline", a.baseline, a.port, logs / "baseline.log")
    results["baseline_ready_s"] = base.ready_s
    try:
        for name, env in a.candidate:
            entry: dict[str, Any] = {"settings": env}
            try:
                cand = Stack(name, env, a.port + 1, logs / f"{name}.log")
            except RuntimeError as exc:
                entry["error"] = str(exc)[-1500:]
            else:
                try:
                    entry |= {"ready_s": cand.ready_s, **gate(base, cand, a.corpus, a.out / name, extra)}
                finally:
                    cand.stop()
            results["candidates"][name] = entry
            print(f"{name}: {entry.get('exit', 'not run')}", flush=True)
    finally:
        base.stop()
    (a.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (a.out / "results.md").write_text(
        f"# Quality gate on the CPU stack\n\n{results['machine']}; {results['versions']}\n\n"
        f"Corpus: {a.corpus}\n\n{table(results)}")
    print(table(results), end="")
    codes = [c.get("exit", 2) for c in results["candidates"].values()]
    return 2 if 2 in codes or any(c not in (0, 1) for c in codes) else max(codes)


if __name__ == "__main__":
    raise SystemExit(main())
