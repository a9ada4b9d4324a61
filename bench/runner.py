"""The one runner: every comparison is sides and cases given to these steps (start, compare,
vectors, quality gate, profile, stop). Each takes the run's Host and the time it must end by and
returns what results.json keeps; a side that cannot start, or stalls, is a finding, not a failure."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import harness
import profile_engine
from gpu import tree_used_gb
from harness import Host, Side, slug
from measure import Case, Load, measure, target
from procs import child_env, embedserve_cmd, http_post_json

from embedserve.loadtest.quality.corpus import DEFAULT_HTML

Sides = Sequence[Side] | Callable[[Host], Sequence[Side]]


@dataclass(frozen=True)
class Step:
    name: str
    used_by: tuple[str, ...]  # the scenarios that need it
    run: Callable[[Host, float], dict[str, Any]]
    seconds: float  # roughly what it takes at time scale 1 with a warm JIT cache
    holds: tuple[str, ...] = ()  # processes it leaves running: done again when one is gone
    always: bool = False  # stops and clean-ups run on every pass
    least_s: float | None = None  # a load step: its warm-up and first case (it stops between cases)


def lifecycle(name: str, scenario: str, sides: Sides, seconds: float = 150,
              **start: Any) -> tuple[Step, Step]:
    """``NAME-start`` (held: done again when one of its processes is gone) and ``NAME-stop``."""
    holds = tuple(s.key for s in sides) if not callable(sides) else ()
    return (Step(f"{name}-start", (scenario,), partial(step_start, sides=sides, **start), seconds, holds),
            Step(f"{name}-stop", (scenario,), partial(step_stop, sides=sides), 30, always=True))


def resolve(host: Host, sides: Sides) -> list[Side]:
    return list(sides(host) if callable(sides) else sides)


def side_memory(host: Host, sides: Sequence[Side]) -> dict[str, float]:
    """GPU memory (NVML) of each side's processes and all their descendants."""
    procs = host.work.state["procs"]
    return tree_used_gb({s.key: [procs[s.key]["pid"]] for s in sides if s.key in procs})


def step_start(host: Host, budget_end: float, sides: Sides, wait: bool = True,
               one_at_a_time: bool = False) -> dict[str, Any]:
    """Start what is not running (a side that failed earlier in this run is not tried again)
    and, with ``wait``, wait for every side at once: each one's ready time, command line,
    settings and start-up facts, then each one's GPU memory while idle."""
    failed = host.work.state.setdefault("failed_sides", [])
    out: dict[str, Any] = {"ready_s": {}, "argv": {}, "settings": {}, "not_run": {}}
    todo = resolve(host, sides)

    def ready(side: Side) -> None:
        try:
            out["ready_s"][side.key] = harness.wait_ready(host, side, budget_end)
        except RuntimeError as exc:  # TimeoutError (budget) passes: the next slice goes on
            out["not_run"][side.key] = str(exc)[-1500:]
            failed.append(side.key)
            host.work.stop(side.key, 30)
            return
        if side.kind.facts:
            log = Path(host.work.state["procs"][side.key]["log"])
            out.setdefault("facts", {})[side.key] = side.kind.facts(log)

    for side in todo:
        if side.key in failed and not harness.running(host, side):
            out["not_run"][side.key] = "failed to start earlier in this run"
        elif not harness.running(host, side) and (why := side.kind.missing(host)):
            out["not_run"][side.key] = why
        else:
            try:
                harness.start(host, side)
            except OSError as exc:  # its command or folder is missing
                out["not_run"][side.key] = repr(exc)[:300]
                continue
            out["settings"][side.key] = side.env
            if one_at_a_time:  # its start is not measured against another's
                ready(side)
    started = [s for s in todo if s.key not in out["not_run"] and harness.running(host, s)]
    out["argv"] = {s.key: host.work.state["procs"][s.key]["argv"] for s in started}
    if wait and not one_at_a_time:
        with ThreadPoolExecutor(max(len(started), 1)) as pool:
            list(pool.map(ready, started))
    out["engines"] = {s.key: len(s.engine_ports()) for s in started if s.kind is harness.UP}
    out["gpu_gb_idle"] = side_memory(host, started)
    out["fi_cache_tgz_mb"] = harness.pack_fi_cache(host)  # now: a later slice may never come
    return out


def step_stop(host: Host, budget_end: float, sides: Sides) -> dict[str, Any]:
    return {"stopped": [s.key for s in resolve(host, sides) if host.work.stop(s.key, 60) is not None]}


class Pace:
    """A load step's time per run beyond its load (the client's start, scrapes), measured as it goes:
    the step stops between cases where the next would outrun the budget, not in one, so the next
    command goes on at that case (a command's time limit would lose the case it cut)."""

    def __init__(self, host: Host, budget_end: float) -> None:
        self.host, self.budget_end, self.runs, self.extra_s = host, budget_end, 0, 0.0

    def timed(self, case: Case, rows: Callable[[], list[Any]]) -> list[Any]:
        t0, out, load = time.time(), rows(), case.load.scaled(self.host.time_scale)
        self.extra_s += time.time() - t0 - len(out) * (load.seconds + load.warmup)
        self.runs += len(out)
        return out

    def check(self, case: Case, sides: int) -> None:
        load = case.load.scaled(self.host.time_scale)
        extra = max(0.0, self.extra_s / self.runs) if self.runs else 10.0  # before any run: a guess
        need = rounds(self.host, case) * sides * (load.seconds + load.warmup + extra)
        if (left := self.budget_end - time.time()) < need:
            raise TimeoutError(f"{case.name!r} needs ~{need:.0f} s, {left:.0f} s left; the finished cases "
                               "are kept: run the same command again to go on")


def rounds(host: Host, case: Case) -> int:  # ``host.rounds`` when given (--rounds), else the case's own
    return host.rounds or case.rounds


def alternate(host: Host, sides: Sequence[Side], case: Case, seed: int, tags: dict[str, Any],
              client: str = "loadtest", turn: int = 0) -> list[Any]:
    """``case.rounds`` rounds (``host.rounds`` when given), the sides' order rotated by one each
    round, starting ``turn`` places on; an in-process side runs each of the load's batch sizes."""
    rows = []
    for rnd in range(rounds(host, case)):
        shift = (rnd + turn) % len(sides)
        for side in [*sides[shift:], *sides[:shift]]:
            load, t = case.load.scaled(host.time_scale), target(host, side)
            for batch in (load.batches or (None,)) if t.in_process else (None,):
                label = side.name + (f", batch {batch}" if batch and len(load.batches) > 1 else "")
                name = slug(f"{str(tags.get('section', ''))[:20]}-{case.name}-{label}-{client}-{rnd}")
                row_tags = {**tags, "case": case.name, "side": label, "round": rnd}
                rows.append(measure(name, t, load, host.work.root / "runs", seed=seed + rnd, client=client,
                                    batch=batch, tags=row_tags))
    return rows


def step_compare(host: Host, budget_end: float, sides: Sides, cases: Sequence[Case], *, section: str,
                 seed: int, start: Sides = (), stop: Sides = (), warm: Load | None = None,
                 crosscheck: Sequence[Case] = (), stall: bool = False, vectors: bool = False,
                 least: int = 1) -> dict[str, Any]:
    """``cases`` on the running ``sides`` (``start`` started and waited for first, ``stop`` stopped at
    the end); ``crosscheck``: these cases again by bench/crosscheck.py; ``vectors``: step_vectors first."""
    out: dict[str, Any] = {"rows": [], "stalled": {}}
    if host.cases:  # --cases: these only, in the order given
        cases, crosscheck = ([c for name in host.cases for c in every if c.name == name]
                             for every in (cases, crosscheck))
        if not cases and not crosscheck and not vectors:
            return {"skipped": f"none of its cases is in --cases ({', '.join(host.cases)})"}
    try:
        begun = step_start(host, budget_end, start) if start else {"not_run": {}}
        if begun["not_run"]:
            return {"skipped": "; ".join(f"{k}: {v[-300:]}" for k, v in begun["not_run"].items())}
        if down := [s for s in resolve(host, sides) if not harness.running(host, s)]:
            # stopped between two commands of this run: up again (one that failed to start stays down)
            not_run = step_start(host, budget_end, down)["not_run"]
            out["restarted"] = [s.key for s in down if s.key not in not_run]
        live = [s for s in resolve(host, sides) if harness.running(host, s)]
        if len(live) < least:
            return {"skipped": f"{len(live)} of {', '.join(s.name for s in resolve(host, sides))} running"}
        every = {"section": section}
        if vectors:
            out["vectors"] = step_vectors(host, budget_end, live)
        pace = Pace(host, budget_end)
        kept = finished_cases(host)
        if warm and (not kept["done"] or out.get("restarted")):  # servers that measured a case are warm
            pace.timed(warmup := Case("warm-up", warm), lambda: alternate(
                host, live, warmup, seed + 90, {**every, "section": "warm-up"}))
        out["rows"], out["stalled"] = kept["rows"], kept["stalled"]
        live = [s for s in live if s.name not in out["stalled"]]
        for i, case in enumerate(cases):
            if i < kept["done"]:  # measured before this command was cut off
                continue
            pace.check(case, len(live))
            rows = pace.timed(case, partial(alternate, host, live, case, seed + 10 * i, every, turn=i))
            out["rows"] += rows
            for bad in [s for s in live if s.name in stalled(rows)] if stall else []:
                out["stalled"][bad.name] = f"no answer in {case.name!r}: stopped"
                host.work.stop(bad.key, 30)
                host.work.state.setdefault("failed_sides", []).append(bad.key)
            live = [s for s in live if s.name not in out["stalled"]]
            kept["done"] = i + 1
            host.work.save()
        checks = [dataclasses.replace(case, rounds=1) for case in crosscheck]
        for case in checks:
            pace.check(case, len(live))
        out["crosscheck_rows"] = [r for case in checks for r in alternate(
            host, live, case, seed + 70, every, client="crosscheck")]
        out["gpu_gb_after"] = side_memory(host, live)
    except TimeoutError:  # out of budget: the sides stay up for the next command
        stop = ()
        raise
    finally:
        step_stop(host, budget_end, stop)
    return out


def finished_cases(host: Host) -> dict[str, Any]:
    """The running step's finished cases (their count, rows and stalled sides), in the work dir's state
    and saved after each case: a command cut off by its time limit goes on at the case it was in, not
    at the step's start. suite.py names the running step and forgets them once it is done."""
    fresh: dict[str, Any] = {"done": 0, "rows": [], "stalled": {}}
    step = host.work.state.get("running_step")
    return host.work.state.setdefault("cases", {}).setdefault(step, fresh) if step else fresh


def stalled(rows: list[dict[str, Any]]) -> list[str]:
    """Sides with no answered request in any round of a case."""
    answered: dict[str, int] = {}
    for r in rows:
        answered[r["side"]] = answered.get(r["side"], 0) + (r.get("requests") or 0)
    return [side for side, n in answered.items() if n == 0]


def vector_texts(cap: int, seed: int = 3) -> list[str]:
    """Two texts of each of a few lengths (a word is at most ~2 tokens), plain words, no two alike."""
    rng = random.Random(seed)
    words = ("the", "model", "retrieves", "passages", "that", "answer", "a", "query", "about", "memory",
             "cache", "and", "vectors")
    lengths = [k for k in (3, 20, 60, 150, 400, 900) if 4 * k < cap for _ in range(2)]
    return [f"text {i}: " + " ".join(rng.choice(words) for _ in range(k)) for i, k in enumerate(lengths)]


def cosine(a: list[float], b: list[float]) -> float:
    norm = math.sqrt(sum(p * p for p in a) * sum(q * q for q in b))
    return round(sum(p * q for p, q in zip(a, b, strict=True)) / norm, 7) if norm else 0.0


def step_vectors(host: Host, budget_end: float, sides: Sides, reference: str | None = None) -> dict[str, Any]:
    """The same inputs, each alone (a batch must not change a vector), through every side: token
    ids when a side takes only ids, else texts. Cosines of every pair, or of every side against
    ``reference`` (a side's name)."""
    live = [s for s in resolve(host, sides) if harness.running(host, s)]
    if not live:
        return {"skipped": "no side running"}
    ids, cap, rng = any(s.takes_ids for s in live), min(host.cap_of(s.shape) for s in live), random.Random(7)
    inputs: list[Any] = ([[rng.randrange(1000, 3000) for _ in range(min(n, cap - 1))] for n in (8, 300, 2000)]
                         if ids else vector_texts(cap))
    got: dict[str, list[list[float]]] = {}
    errors: dict[str, str] = {}
    for side in live:
        t = target(host, side)
        try:
            got[side.name] = [http_post_json(t.url, {"model": t.model, "input": [x]})["data"][0]["embedding"]
                              for x in inputs]
        except Exception as exc:  # recorded; the throughput runs still go on
            errors[side.name] = repr(exc)[:300]
    names = list(got)
    pairs: list[dict[str, Any]] = [
        {"pair": f"{a} vs {b}", "min": min(cos), "cosines": cos} for i, a in enumerate(names)
        for b in names[i + 1:] if reference in (None, a, b)
        for cos in [[cosine(x, y) for x, y in zip(got[a], got[b], strict=True)]]]
    return {"inputs": "token ids" if ids else "texts", "pairs": pairs, "errors": errors,
            "lengths": [len(x) if ids else len(x.split()) for x in inputs],
            "min_0_9999": bool(pairs) and min(p["min"] for p in pairs) >= 0.9999}


def quality_corpus(host: Host) -> Path | None:
    """``--quality-corpus``, else one built once from python3-doc into the work folder (300
    passages on ``--device cpu``), else None."""
    if host.quality_corpus:
        return Path(host.quality_corpus)
    built = host.work.root / "quality-corpus.json"
    if not built.exists() and DEFAULT_HTML.is_dir():
        small = ["--max-passages", "300"] if host.cpu else []
        subprocess.run([*embedserve_cmd(), "quality-corpus", "--out", str(built), *small],
                       env=child_env(), capture_output=True, timeout=600, check=True)
    return built if built.exists() else None


def gate(host: Host, name: str, base: Side, cand: Side) -> dict[str, Any]:
    """``embedserve quality`` between two sides: its report (also in --out's quality/NAME, with
    its summary.md), or why it did not run."""
    if not (harness.running(host, base) and harness.running(host, cand)):
        return {"not_run": f"{base.name} or {cand.name} is not running (see the start step)"}
    if (corpus := quality_corpus(host)) is None:
        return {"not_run": f"no corpus: pass --quality-corpus FILE (embedserve quality-corpus) or install "
                           f"python3-doc ({DEFAULT_HTML})"}
    out = (host.out or host.work.root) / "quality" / name
    argv = [*embedserve_cmd(), "quality", "--baseline", f"http://127.0.0.1:{base.port}",
            "--candidate", f"http://127.0.0.1:{cand.port}", "--corpus", str(corpus), "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, env=child_env(), timeout=1800, check=False)
    if done.returncode in (0, 1) and (out / "quality.json").exists():
        return dict(json.loads((out / "quality.json").read_text()))
    return {"error": (done.stderr or done.stdout)[-1500:]}


def step_quality(host: Host, budget_end: float, pairs: Callable[[Host], list[tuple[str, Side, Side]]],
                 one_at_a_time: bool = False) -> dict[str, Any]:
    """The quality gate per (name, baseline, candidate); ``one_at_a_time``: each candidate is
    started for its gate and stopped after it, so two stacks compete for nothing else."""
    out: dict[str, Any] = {"quality": {}, "ready_s": {}}
    for name, base, cand in pairs(host):
        if one_at_a_time:
            out["ready_s"] |= step_start(host, budget_end, [cand])["ready_s"]
        try:
            out["quality"][name] = gate(host, name, base, cand)
        finally:
            if one_at_a_time:
                step_stop(host, budget_end, [cand])
    return out


def step_profile(host: Host, budget_end: float, side: Side, folder: str) -> dict[str, Any]:
    """Where the CPU time goes on one `up` stack under the seed mix at 64 in flight: py-spy over its
    gateway and first engine's processes (the GPU's: bench/kernel_profile.py)."""
    if not harness.running(host, side):
        return {"skipped": f"{side.key} is not running"}
    return profile_engine.pyspy_under_load(
        target(host, side), Load("seed", 64, seconds=14, warmup=2), host.work.root / folder,
        gateway_port=side.port, engine_port=side.engine_ports()[0], runs=host.work.root / "runs")
