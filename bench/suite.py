"""The one benchmark command: every comparison, GPU or CPU, as steps of one runner (bench/README.md).

    python bench/suite.py --out results/gpu-perf                         # every GPU scenario
    python bench/suite.py --out /tmp/suite-cpu --device cpu              # dry run: tiny model, CPU engine
    python bench/suite.py --out results/cpu-peers --only cpu-peers       # a CPU comparison (named only)

State (finished steps, processes started with setsid and their pids) lives in the work dir, so a
run cut by --budget-s resumes where it stopped: run the same command again to go on.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import cpu_scenarios
import gpu_rerank
import gpu_scenarios as gs
import probes
import report
from harness import SHAPES_ON_CPU, Host, describe, pack_fi_cache
from peers import VARIANTS, variant
from procs import WorkDir, child_env, embedserve_cmd, log_tail
from runner import Step

from embedserve.loadtest.textbuild import load_tokenizer

GPU_SCENARIOS = ("raw-vs-gateway", "peers", "soak-capacity", "scale", "drill", "fp8", "vllm",
                 "rerank-gpu")
SCENARIOS = GPU_SCENARIOS + cpu_scenarios.SCENARIOS + probes.SCENARIOS


def step_models(host: Host, budget_end: float, shapes: tuple[str, ...] = ("4b",)) -> dict[str, Any]:
    """Random-weight checkpoints of the real shapes (`embedserve synth-model`), built at once."""
    procs = {}
    for shape in shapes:
        out = Path(host.model(shape))
        if not (out / "config.json").exists():
            argv = [*embedserve_cmd(), "synth-model", SHAPES_ON_CPU if host.cpu else shape, str(out),
                    "--device", host.device, "--max-seq-length", str(host.cap)]
            procs[shape] = subprocess.Popen(argv, env=child_env(), stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True)
    for shape, proc in procs.items():
        output, _ = proc.communicate(timeout=max(30.0, min(budget_end - time.time(), 1800.0)))
        if proc.returncode:
            raise RuntimeError(f"synth-model {shape} failed: {output[-1500:]}")
    return {"models": {s: host.model(s) for s in shapes}, "built": sorted(procs),
            # added tokens included (Qwen3's: 151,669): a folder kept from an earlier run may hold
            # another tokenizer, and the report says which
            "tokenizer_tokens": {s: load_tokenizer(host.model(s)).get_vocab_size(with_added_tokens=True)
                                 for s in shapes}}


def step_finish(host: Host, budget_end: float) -> dict[str, Any]:
    """Stop whatever is still running; pack the FlashInfer JIT cache again (kernels compiled
    since the engines started are in it too)."""
    return {"stopped": host.work.stop_all(), "fi_cache_tgz_mb": pack_fi_cache(host)}


def plan(selected: tuple[str, ...], vllm_shapes: tuple[str, ...] = gs.VLLM_SHAPES) -> list[Step]:
    both = {"raw-vs-gateway", "fp8"}
    shapes: tuple[str, ...] = ("4b", "0.6b") if both & set(selected) else ("4b",) if set(selected) - {
        "rerank-gpu"} else ()  # the rerankers build their own
    if "vllm" in selected:
        shapes = tuple(dict.fromkeys((*shapes, *vllm_shapes))) if set(selected) - {"vllm"} else vllm_shapes
    vllm = gs.vllm_steps(vllm_shapes)  # rerank-gpu is measured once the first vLLM servers are ready
    at = next(i for i, s in enumerate(vllm) if s.name.startswith("vllm-ready-")) + 1
    steps = [Step("models", GPU_SCENARIOS, partial(step_models, shapes=shapes), 90, always=True),
             *gs.UP_STEPS, *gs.raw_engine_steps(shapes), *gs.FP8_STEPS,
             *gpu_rerank.start_steps(), *vllm[:at], *gpu_rerank.measure_steps(), *vllm[at:],
             *cpu_scenarios.cpu_steps(), *probes.steps(),
             Step("finish", SCENARIOS, step_finish, 20, always=True)]
    return [s for s in steps if set(s.used_by) & set(selected)]


def write_results(host: Host, out: Path, names: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = host.work.state
    res = {"meta": state["meta"], "steps": {n: state["steps"][n] for n in names if n in state["steps"]}}
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "results.md").write_text(report.render(res))
    logs = sorted((host.work.root / "logs").glob("*.log"))
    tails = [f"===== {log.name} =====\n{log_tail(log, 6000)}\n" for log in logs]
    (out / "logs.txt").write_text("".join(tails))  # one file: a remote host may return only a few


def run(host: Host, steps: list[Step], out: Path, budget_s: float | None, redo: list[str],
        until: str | None = None, command: str = "python bench/suite.py",
        names: list[str] | None = None) -> int:
    work, names = host.work, names or [s.name for s in steps]
    gpu_run = any(set(s.used_by) & set(GPU_SCENARIOS) for s in steps if s.name not in ("models", "finish"))
    work.state["meta"] = describe(host, gpu_run, command)
    for name in redo:
        work.state["steps"].pop(name, None)
        work.state.setdefault("cases", {}).pop(name, None)
    t_end = time.time() + budget_s if budget_s else float("inf")
    for step in steps:
        done = work.state["steps"].get(step.name, {})
        if done.get("ok") and not step.always and all(work.running(t) for t in step.holds):
            continue
        need = (step.least_s or step.seconds) * (0.4 + 0.6 * host.time_scale)  # starts, launches: unscaled
        if budget_s and time.time() + need > t_end:
            work.note(f"stopping before {step.name}: {t_end - time.time():.0f} s left, needs ~{need:.0f} s; "
                      "run the same command again to go on")
            write_results(host, out, names)
            return 3
        work.note(f"step {step.name}")
        t0 = time.time()
        work.state["running_step"] = step.name  # a load step saves each finished case (runner.py)
        try:
            data = step.run(host, t_end)
            work.state["steps"][step.name] = {"ok": True, "seconds": round(time.time() - t0, 1), **data}
            work.state.setdefault("cases", {}).pop(step.name, None)
            if step.name == "models":  # the engine's command line needs the checkpoint
                work.state["meta"] = describe(host, gpu_run, command)
            work.note(f"step {step.name} done in {time.time() - t0:.0f} s")
        except TimeoutError as exc:  # waiting on a start-up past the budget: the next slice goes on
            work.note(f"step {step.name}: {exc}")
            write_results(host, out, names)
            return 3
        except Exception as exc:
            work.state["steps"][step.name] = {"ok": False, "error": repr(exc)[:2000]}
            work.note(f"step {step.name} FAILED: {exc!r}"[:600])
        work.save()
        write_results(host, out, names)
        if step.name == until and step is not steps[-1]:
            work.note(f"stopping after {step.name} (--until); run again without it to go on")
            return 3
    failed = [k for k in names if work.state["steps"].get(k, {}).get("ok") is False]
    print(f"results: {out / 'results.md'}" + (f" (failed: {', '.join(failed)})" if failed else ""))
    return 1 if failed else 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = ap.add_argument
    add("--out", type=Path, required=True, help="results.json, results.md (and fi-cache.tgz)")
    add("--only", help=f"comma-separated scenarios of: {', '.join(SCENARIOS)}")
    add("--budget-s", type=float, help="stop before a step that would not fit; resume later")
    add("--redo", nargs="*", default=[], help="forget these steps' results first")
    add("--fresh", action="store_true", help="forget every result in the work dir first (a re-measurement)")
    add("--until", metavar="STEP", help="stop after this step (exit 3): vllm-start starts servers early")
    add("--skip", nargs="*", default=[], metavar="STEP", help="leave these steps out (a profile done before)")
    add("--work", type=Path, help="state, logs, models (default: /tmp/embedserve-bench[-cpu|-SCENARIO])")
    add("--device", choices=("cuda", "cpu"), default="cuda")
    add("--cap", type=int, help="max sequence length (default 8192; 512 on cpu)")
    add("--time-scale", type=float, help="multiply every run's duration (default 1; cpu 0.1)")
    add("--rounds", type=int, help="rounds of every case (default: each case's own)")
    add("--model", action="append", default=[], metavar="NAME=DIR",
        help="use this checkpoint instead of building one (4b=/models/q4b)")
    add("--fi-cache", default="/tmp/fi-cache", help="FlashInfer JIT cache folder")
    add("--infinity-site", default="/tmp/site-infinity", help="Infinity's own package folder")
    add("--drill-leak", metavar="RATE", help="the drill's leak per engine (default 4GiB/min; 20MiB/s on cpu)")
    add("--quality-corpus", metavar="FILE", help="the quality gate's corpus (embedserve quality-corpus; "
                                                 "default: built from python3-doc when the host has it)")
    add("--vllm-site", default="/tmp/site-vllm", help="vLLM's own package folder")
    add("--vllm-cmd", help="replaces `python3 -m vllm.entrypoints.cli.main` ('python3 bench/inprocess.py')")
    add("--vllm-shapes", default="0.6b,4b", help="the vllm scenario's models, in this order")
    add("--vllm-kv-tokens", type=int, help="vLLM's KV pool in tokens (default: embedserve's engine's)")
    add("--vllm-sides", default="vllm,vllm tuned", help=f"vLLM's sides (vllm): {', '.join(gs.VLLM_SIDES)}")
    add("--rerank-sides", default="sglang,torch", help="rerank-gpu's embedserve engines: SHAPE:KIND or KIND, "
        "comma-separated (qwen3-reranker-0.6b:sglang,torch: SGLang for Qwen3-Reranker only)")
    add("--cases", default="", help="load steps measure only these cases, ';'-separated, in this order")
    add("--embedserve-variants", default="", help="embedserve sides beyond the defaults (vllm), comma-"
                                                 f"separated, of: {', '.join(VARIANTS)} (+ joins several)")
    add("--variant", action="append", default=[], metavar="NAME=K=V,K=V",
        help="an embedserve side with these settings (quality-cpu: `baseline` is the baseline; vllm)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    selected = tuple(a.only.split(",")) if a.only else GPU_SCENARIOS
    if unknown := set(selected) - set(SCENARIOS):
        ap.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    try:
        variants = tuple(variant(v) for v in [*filter(None, a.embedserve_variants.split(",")), *a.variant])
    except ValueError as exc:
        ap.error(str(exc))
    if set(shapes := a.vllm_shapes.split(",")) - set(gs.VLLM_SHAPES):
        ap.error(f"--vllm-shapes takes {', '.join(gs.VLLM_SHAPES)}")
    if set(vllm_sides := [v.strip() for v in a.vllm_sides.split(",") if v.strip()]) - set(gs.VLLM_SIDES):
        ap.error(f"--vllm-sides takes {', '.join(gs.VLLM_SIDES)}, comma-separated")
    only_cpu = not set(selected) & set(GPU_SCENARIOS)  # CPU scenarios: real figures, the host's CPU
    dry = a.device == "cpu" and not only_cpu
    default_work = "/tmp/embedserve-bench" + (f"-{selected[0]}" if only_cpu else "-cpu" if dry else "")
    work = WorkDir(a.work or Path(default_work))
    if a.fresh:
        work.stop_all()
        work.state.update(steps={}, failed_sides=[], cases={})
    host = Host(work, device="cpu" if only_cpu else a.device, cap=a.cap or (512 if dry else 8192),
                time_scale=a.time_scale or (0.1 if dry else 1.0), rounds=a.rounds,
                fi_cache=a.fi_cache, infinity_site=a.infinity_site, out=a.out, drill_rate=a.drill_leak,
                models={k: str(Path(v).resolve()) for k, v in (m.split("=", 1) for m in a.model)},
                quality_corpus=a.quality_corpus,
                vllm_site=a.vllm_site, vllm_cmd=tuple(shlex.split(a.vllm_cmd or "")),
                vllm_kv_tokens=a.vllm_kv_tokens, variants=variants, vllm_sides=tuple(vllm_sides),
                rerank_sides=tuple(a.rerank_sides.split(",")),
                cases=tuple(c.strip() for c in a.cases.split(";") if c.strip()))
    every = plan(selected, tuple(shapes))
    for name in [*a.skip, *([a.until] if a.until else [])]:
        if name not in {s.name for s in every}:
            ap.error(f"{name}: not a step of this run")
    known = {c.name for s in every for key in ("cases", "crosscheck")
             for c in getattr(s.run, "keywords", {}).get(key, ())}
    if unknown_cases := set(host.cases) - known:
        ap.error(f"--cases: no step of this run has {', '.join(sorted(unknown_cases))}")
    command = "python bench/suite.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    return run(host, [s for s in every if s.name not in a.skip], a.out, a.budget_s, a.redo, a.until, command,
               [s.name for s in every])


if __name__ == "__main__":
    sys.exit(main())
