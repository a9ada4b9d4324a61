"""The GPU benchmark suite: embedserve on SGLang + FlashInfer, measured as an operator runs it.

    python bench/suite.py --out results/gpu-perf                         # everything, in one go
    python bench/suite.py --out results/gpu-perf --only raw-vs-gateway,peers
    python bench/suite.py --out results/gpu-perf --budget-s 540          # a slice; run again to go on
    python bench/suite.py --out /tmp/suite-cpu --device cpu              # dry run: tiny model, CPU engine

Scenarios (--only): raw-vs-gateway, kv-pool, radix, peers, soak-capacity, scale, drill, fp8,
attention, engines-per-gpu, engines-per-gpu-detail, small-model, vllm. Each is a list of named
steps; state (finished steps, processes started with setsid and their pids) lives in the work
dir, so a run cut by --budget-s resumes where it stopped. Writes results.json and results.md to
--out after every step. bench/README.md says what each scenario measures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import drill
import fp8
import overlap
import peers
import results_md
import scaleout
import scenarios
import small_model
import stacks
import vllm_peer
from gpu_memory import gpu_description
from procs import WorkDir, child_env, embedserve_cmd, log_tail

SCENARIOS = ("raw-vs-gateway", "kv-pool", "radix", "peers", "soak-capacity", "scale", "drill", "fp8",
             "attention", "engines-per-gpu", "engines-per-gpu-detail", "small-model", "vllm")
StepFn = Callable[[stacks.Host, float], dict[str, Any]]


@dataclass(frozen=True)
class Step:
    name: str
    used_by: tuple[str, ...]  # the scenarios that need it
    run: StepFn
    seconds: float  # roughly what it takes at time scale 1 with a warm JIT cache
    holds: tuple[str, ...] = ()  # processes it leaves running: done again when one is gone
    always: bool = False  # stops and clean-ups run on every pass


def step_models(host: stacks.Host, budget_end: float, shapes: tuple[str, ...] = ("4b",)) -> dict[str, Any]:
    """Random-weight checkpoints of the real shapes (`embedserve synth-model`), built at once."""
    procs = {}
    for shape in shapes:
        out = Path(host.model(shape))
        if (out / "config.json").exists():
            continue
        kind = stacks.SHAPES_ON_CPU if host.cpu else shape
        argv = [*embedserve_cmd(), "synth-model", kind, str(out), "--device", host.device,
                "--max-seq-length", str(host.cap)]
        procs[shape] = subprocess.Popen(argv, env=child_env(), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
    for shape, proc in procs.items():
        output, _ = proc.communicate(timeout=max(30.0, min(budget_end - time.time(), 1800.0)))
        if proc.returncode:
            raise RuntimeError(f"synth-model {shape} failed: {output[-1500:]}")
    return {"models": {s: host.model(s) for s in shapes}, "built": sorted(procs),
            "tokenizer_tokens": {s: tokenizer_tokens(Path(host.model(s))) for s in shapes}}


def tokenizer_tokens(model_dir: Path) -> int:
    """Tokens in a checkpoint's tokenizer.json, added ones included (Qwen3's: 151,669): a
    folder kept from an earlier run may hold another tokenizer, and the report says which."""
    doc = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = doc["model"]["vocab"]
    return len(vocab) + sum(t["content"] not in vocab for t in doc.get("added_tokens", []))


def step_finish(host: stacks.Host, budget_end: float) -> dict[str, Any]:
    """Stop whatever is still running; pack the FlashInfer JIT cache again (kernels compiled
    since the engines started are in it too)."""
    return {"stopped": host.work.stop_all(), "fi_cache_tgz_mb": stacks.pack_fi_cache(host)}


def raw_vs_gateway(shape: str) -> list[Step]:
    parts = ((1, 200), (2, 190), (3, 230 if shape == "4b" else 150))
    return [
        Step(f"raw-vs-gateway-{shape}-{part}", ("raw-vs-gateway",),
             partial(scenarios.step_raw_vs_gateway, shape=shape, part=part), seconds)
        for part, seconds in parts
    ]


def vllm_steps(shapes: tuple[str, ...]) -> list[Step]:
    """The vLLM peer: every shape's servers started together (their start-ups overlap), then per
    shape: readiness, vectors, the engine's profile, two load parts, its servers stopped."""
    steps = [Step("vllm-start", ("vllm",), partial(vllm_peer.step_start, shapes=shapes), 30)]
    for shape in shapes:
        steps += [
            Step(f"vllm-ready-{shape}", ("vllm",), partial(vllm_peer.step_ready, shape=shape), 150),
            Step(f"vllm-vectors-{shape}", ("vllm",), partial(vllm_peer.step_vectors, shape=shape), 40),
            Step(f"vllm-profile-{shape}", ("vllm",), partial(vllm_peer.step_profile, shape=shape), 45),
            Step(f"vllm-load-{shape}-1", ("vllm",), partial(vllm_peer.step_load, shape=shape, part=1), 450),
            Step(f"vllm-load-{shape}-2", ("vllm",), partial(vllm_peer.step_load, shape=shape, part=2), 380),
            Step(f"vllm-stop-{shape}", ("vllm",), partial(vllm_peer.step_stop, shape=shape), 20),
        ]
    return steps


def plan(selected: tuple[str, ...], vllm_shapes: tuple[str, ...] = ("0.6b", "4b")) -> list[Step]:
    both = {"raw-vs-gateway", "fp8", "engines-per-gpu", "engines-per-gpu-detail"}
    shapes: tuple[str, ...] = ("4b", "0.6b") if both & set(selected) else ("4b",)
    if "small-model" in selected:
        shapes = ("0.6b",) if set(selected) == {"small-model"} else tuple(dict.fromkeys((*shapes, "0.6b")))
    if "vllm" in selected:
        shapes = tuple(dict.fromkeys((*shapes, *vllm_shapes))) if set(selected) - {"vllm"} else vllm_shapes
    engines_for = ("raw-vs-gateway", "kv-pool", "radix", "peers")
    up_for = ("soak-capacity", "scale")
    steps = [  # `embedserve up` first: what operators run, and the 2-GPU part where GPUs are scarce
        Step("models", SCENARIOS, partial(step_models, shapes=shapes), 90, always=True),
        Step("up-1", up_for, scaleout.step_up, 150, holds=("up-1",)),
        Step("soak-capacity", ("soak-capacity",), scaleout.step_capacity, 45),
        Step("scale-load-1", ("scale",), scaleout.step_scale_load, 85),
        Step("down-1", up_for, scaleout.step_down, 30, always=True),
        Step("up-2", ("scale",), partial(scaleout.step_up, replicas=2), 100, holds=("up-2",)),
        Step("scale-load-2", ("scale",), partial(scaleout.step_scale_load, replicas=2), 85),
        Step("down-2", ("scale",), partial(scaleout.step_down, replicas=2), 30, always=True),
        # a stack of its own (ports 8300, 30300-30301), started and stopped within the step
        Step("drill", ("drill",), drill.step_drill, 640),
        Step("engines", engines_for, partial(scenarios.step_engines, shapes=shapes), 150,
             holds=tuple(f"engine-{s}" for s in shapes)),
        # the 4B's rows and its peer first, where time is short: the 0.6B's rows come last
        *raw_vs_gateway("4b"),
        Step("peers-infinity-1", ("peers",), peers.step_infinity, 300),
        Step("peers-infinity-2", ("peers",), partial(peers.step_infinity, part=2), 230),
        Step("kv-pool", ("kv-pool",), scenarios.step_kv_pool, 380),
        Step("radix", ("radix",), scenarios.step_radix, 300),
        *(step for shape in shapes if shape != "4b" for step in raw_vs_gateway(shape)),
        Step("stop-engines", engines_for, scenarios.step_stop_engines, 20, always=True),
        # FP8 and the attention backends: engines of their own, bf16 and FP8 side by side
        Step("fp8-engines", ("fp8",), fp8.step_fp8_engines, 150,
             holds=("engine-4b-bf16", "engine-4b-fp8", "gateway-4b-bf16", "gateway-4b-fp8")),
        Step("fp8-quality", ("fp8",), fp8.step_fp8_quality, 240),
        Step("fp8-throughput", ("fp8",), fp8.step_fp8_throughput, 330),
        Step("attention", ("attention",), fp8.step_attention, 330),
        Step("fp8-stop", ("fp8", "attention"), fp8.step_fp8_stop, 30, always=True),
        # several engines per GPU against one and raw SGLang; every stack starts at once
        Step("overlap-start", ("engines-per-gpu",), overlap.step_start, 150,
             holds=tuple(c.tag for g in ("0.6b", "4b", "4b-fp8") for c in overlap.CONFIGS[g])),
        Step("overlap-profile-0.6b", ("engines-per-gpu",), overlap.step_profile, 40),
        Step("overlap-0.6b", ("engines-per-gpu",), partial(overlap.step_measure, group="0.6b"), 390),
        Step("overlap-profile-4b", ("engines-per-gpu",), partial(overlap.step_profile, group="4b"), 40),
        Step("overlap-4b", ("engines-per-gpu",), partial(overlap.step_measure, group="4b"), 300),
        Step("overlap-4b-fp8", ("engines-per-gpu",), partial(overlap.step_measure, group="4b-fp8"), 120),
        Step("overlap-stop", ("engines-per-gpu",), overlap.step_stop, 30, always=True),
        # per-engine memory, GPU-only profiles with py-spy, latency in three rounds, batch budget
        Step("detail-start", ("engines-per-gpu-detail",), overlap.step_detail_start, 150,
             holds=tuple(c.tag for g in overlap.DETAIL.values() for c in g)),
        Step("detail-profile-0.6b", ("engines-per-gpu-detail",), overlap.step_detail_profile, 40),
        Step("detail-profile-4b", ("engines-per-gpu-detail",),
             partial(overlap.step_detail_profile, group="4b"), 40),
        Step("detail-latency", ("engines-per-gpu-detail",), overlap.step_detail_latency, 150),
        Step("detail-knobs", ("engines-per-gpu-detail",), overlap.step_detail_knobs, 140),
        Step("detail-stop", ("engines-per-gpu-detail",), overlap.step_detail_stop, 30, always=True),
        # the 0.6B: the gateway's settings side by side, and FP8; every stack starts at once
        Step("small-start", ("small-model",), small_model.step_start, 150,
             holds=tuple(c.tag for c in small_model.CONFIGS.values())),
        Step("small-profile", ("small-model",), small_model.step_profile, 45),
        Step("small-matrix-1", ("small-model",), small_model.step_matrix, 250),
        Step("small-matrix-2", ("small-model",), partial(small_model.step_matrix, part=2), 250),
        Step("small-gateway-1", ("small-model",), small_model.step_gateway, 240),
        Step("small-gateway-2", ("small-model",), partial(small_model.step_gateway, rnd=1), 240),
        Step("small-crosscheck", ("small-model",), small_model.step_crosscheck, 65),
        Step("small-stop", ("small-model",), small_model.step_stop, 65, always=True),
        # vLLM's pooling runner: servers of its own, the 0.6B first (the 4B where time is left)
        *vllm_steps(vllm_shapes),
        Step("finish", SCENARIOS, step_finish, 20, always=True),
    ]
    return [s for s in steps if set(s.used_by) & set(selected)]


def meta(host: stacks.Host) -> dict[str, Any]:
    """How the figures were produced: hardware, versions, the engine's command line."""
    gpus = gpu_description()
    names = sorted({g.split(",")[0] for g in gpus})
    versions = {}
    for dist in ("embedserve", "sglang", "flashinfer-python", "torch", "transformers", "tokenizers"):
        with contextlib.suppress(PackageNotFoundError):
            versions[dist] = version(dist)
    info: dict[str, Any] = {
        "hardware": f"{len(gpus)} x {', '.join(names)}" if gpus else f"CPU only, {os.cpu_count()} cores",
        "gpus": gpus or None, "cpus": os.cpu_count(), "python": platform.python_version(),
        "versions": ", ".join(f"{k} {v}" for k, v in versions.items()), "device": host.device,
        "time_scale": host.time_scale, "cap": host.cap}
    if not host.cpu:
        env = child_env(stacks.engine_env(host, "4b", 30000, kv_pool=scenarios.MAIN_KV_POOL))
        done = subprocess.run([*embedserve_cmd(), "engine", "--dry-run", "--json"], env=env,
                              capture_output=True, text=True, timeout=120, check=False)
        if done.returncode == 0:
            info["engine_argv"] = json.loads(done.stdout)["argv"][1:]
    return info


def write_results(host: stacks.Host, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    res = {k: v for k, v in host.work.state.items() if k != "procs"}
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "results.md").write_text(results_md.render(res))
    tails = [f"===== {log.name} =====\n{log_tail(log, 6000)}\n"
             for log in sorted((host.work.root / "logs").glob("*.log"))]
    (out / "logs.txt").write_text("".join(tails))  # one file: a remote host may return only a few


def run(host: stacks.Host, steps: list[Step], out: Path, budget_s: float | None, redo: list[str],
        until: str | None = None) -> int:
    work = host.work
    work.state.setdefault("meta", meta(host))
    for name in redo:
        work.state["steps"].pop(name, None)
    t_end = time.time() + budget_s if budget_s else float("inf")
    for step in steps:
        done = work.state["steps"].get(step.name, {})
        if done.get("ok") and not step.always and all(work.running(t) for t in step.holds):
            continue
        need = step.seconds * (0.4 + 0.6 * host.time_scale)  # starts and client launches do not scale
        if budget_s and time.time() + need > t_end:
            work.note(f"stopping before {step.name}: {t_end - time.time():.0f} s left, needs ~{need:.0f} s; "
                      "run the same command again to go on")
            write_results(host, out)
            return 3
        work.note(f"step {step.name}")
        t0 = time.time()
        try:
            data = step.run(host, t_end)
            work.state["steps"][step.name] = {"ok": True, "seconds": round(time.time() - t0, 1), **data}
            if step.name == "models":  # the engine's command line needs the checkpoint
                work.state["meta"] = meta(host)
            work.note(f"step {step.name} done in {time.time() - t0:.0f} s")
        except TimeoutError as exc:  # waiting on a start-up past the budget: the next slice goes on
            work.note(f"step {step.name}: {exc}")
            write_results(host, out)
            return 3
        except Exception as exc:
            work.state["steps"][step.name] = {"ok": False, "error": repr(exc)[:2000]}
            work.note(f"step {step.name} FAILED: {exc!r}"[:600])
        work.save()
        write_results(host, out)
        if step.name == until and step is not steps[-1]:
            work.note(f"stopping after {step.name} (--until); run again without it to go on")
            return 3
    write_results(host, out)
    failed = [k for k, v in work.state["steps"].items() if v.get("ok") is False]
    print(f"results: {out / 'results.md'}" + (f" (failed: {', '.join(failed)})" if failed else ""))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="results.json, results.md (and fi-cache.tgz)")
    ap.add_argument("--only", help=f"comma-separated scenarios of: {', '.join(SCENARIOS)}")
    ap.add_argument("--budget-s", type=float, help="stop before a step that would not fit; resume later")
    ap.add_argument("--redo", nargs="*", default=[], help="forget these steps' results first")
    ap.add_argument("--until", metavar="STEP", help="stop after this step (exit 3): e.g. vllm-start "
                                                     "starts servers while later bundles are staged")
    ap.add_argument("--skip", nargs="*", default=[], metavar="STEP",
                    help="leave these steps out of this run (e.g. a profile measured before)")
    ap.add_argument("--work", type=Path, help="state, logs, models (default: /tmp/embedserve-bench)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--cap", type=int, help="max sequence length (default 8192; 512 on cpu)")
    ap.add_argument("--time-scale", type=float, help="multiply every run's duration (default 1; cpu 0.1)")
    ap.add_argument("--model", action="append", default=[], metavar="SHAPE=DIR",
                    help="use this checkpoint instead of building one (e.g. 4b=/models/q4b)")
    ap.add_argument("--fi-cache", default="/tmp/fi-cache", help="FlashInfer JIT cache folder")
    ap.add_argument("--infinity-site", default="/tmp/site-infinity", help="Infinity's own package folder")
    ap.add_argument("--drill-leak", metavar="RATE",
                    help="the drill scenario's leak per engine (default 4GiB/min; 20MiB/s on cpu)")
    ap.add_argument("--attention-backends", default="fa3,triton",
                    help="the attention scenario's backends, each against FlashInfer (of: fa3, triton)")
    ap.add_argument("--quality-corpus", metavar="FILE",
                    help="the quality gate's corpus (embedserve quality-corpus; default: built from "
                         "python3-doc when the host has it)")
    ap.add_argument("--vllm-site", default="/tmp/site-vllm", help="vLLM's own package folder")
    ap.add_argument("--vllm-cmd", help="command that replaces `python3 -m vllm.entrypoints.cli.main` "
                                       "(e.g. a stub: 'python3 bench/fake_vllm.py')")
    ap.add_argument("--vllm-shapes", default="0.6b,4b", help="the vllm scenario's models, in this order")
    ap.add_argument("--vllm-kv-tokens", type=int, help="vLLM's KV pool in tokens (default: embedserve's "
                                                         "engine's, 16,384 at cap 8,192)")
    ap.add_argument("--vllm-sides", default="vllm,vllm tuned", help="the vllm scenario's vLLM sides "
                    "(vllm: its defaults; vllm tuned: --max-num-batched-tokens 16384 --api-server-count 4)")
    ap.add_argument("--embedserve-variants", default="",
                    help="the vllm scenario's embedserve sides beyond the defaults, comma-separated, of: "
                         f"{', '.join(vllm_peer.VARIANTS)} (joined by + for several at once; '' for none)")
    a = ap.parse_args(argv)
    selected = tuple(a.only.split(",")) if a.only else SCENARIOS
    unknown = set(selected) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    cpu = a.device == "cpu"
    work = WorkDir(a.work or Path("/tmp/embedserve-bench" + ("-cpu" if cpu else "")))
    host = stacks.Host(work, device=a.device, cap=a.cap or (512 if cpu else 8192),
                       time_scale=a.time_scale or (0.1 if cpu else 1.0), fi_cache=a.fi_cache,
                       infinity_site=a.infinity_site,
                       models={k: str(Path(v).resolve()) for k, v in (m.split("=", 1) for m in a.model)},
                       out=a.out, drill_rate=a.drill_leak,
                       attention_backends=tuple(a.attention_backends.split(",")),
                       vllm_site=a.vllm_site, vllm_cmd=tuple(shlex.split(a.vllm_cmd or "")),
                       vllm_kv_tokens=a.vllm_kv_tokens,
                       embedserve_variants=tuple(v for v in a.embedserve_variants.split(",") if v),
                       vllm_sides=tuple(v.strip() for v in a.vllm_sides.split(",") if v.strip()),
                       quality_corpus=a.quality_corpus)
    vllm_shapes = tuple(a.vllm_shapes.split(","))
    if set(vllm_shapes) - set(vllm_peer.SHAPES):
        ap.error(f"--vllm-shapes takes {', '.join(vllm_peer.SHAPES)}")
    if set(host.vllm_sides) - {"vllm", "vllm tuned"}:
        ap.error("--vllm-sides takes vllm and vllm tuned, comma-separated")
    for variant in host.embedserve_variants:
        try:
            vllm_peer.variant_env(variant)
        except ValueError as exc:
            ap.error(str(exc))
    steps = plan(selected, vllm_shapes)
    for name in [*a.skip, *([a.until] if a.until else [])]:
        if name not in {s.name for s in steps}:
            ap.error(f"{name}: not a step of this run")
    steps = [s for s in steps if s.name not in a.skip]
    return run(host, steps, a.out, a.budget_s, a.redo, a.until)


if __name__ == "__main__":
    sys.exit(main())
