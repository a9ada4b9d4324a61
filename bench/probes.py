"""The CPU stack's probes that are not comparisons, as suite scenarios (`python bench/suite.py --only NAME`;
bench/README.md says what each measures and how --time-scale and --rounds apply). Every input is unique."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import os
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import httpx
import numpy as np
from cpu import autoscale_ramp as ramp
from harness import UP, Host, Side
from procs import child_env, port_busy
from runner import Step, lifecycle

STACK = Side("embedserve up", UP, 8940, "bundled", tag="probe-stack")
URL = f"http://127.0.0.1:{STACK.port}"
SERIAL = itertools.count()  # every text carries a serial number: no cache has seen it
OFFSETS_S = (0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 10, 12)  # SIGINT this long after the start
WORDS = ("memory", "model", "token", "embedding", "query", "passage", "search", "retrieve", "document",
         "vector")
RAMP_BOUND, RAMP_TOKENS = 512, 64  # one input a request: the ninth in flight is the first refused
RAMP = Side("embedserve up", UP, 18700, "bundled", {"EMBEDSERVE_GATEWAY__REQUEST_TIMEOUT_S": "120",
            "EMBEDSERVE_GATEWAY__MAX_TOKENS_IN_FLIGHT": str(RAMP_BOUND)}, tag="ramp")
PRIORITY = Side("embedserve up", UP, 18760, "bundled", {"EMBEDSERVE_GATEWAY__PRIORITY_AGING_S": "30"},
                tag="priority")
MAX_TRICKLE_S = 120.0  # a trickler gives up after this long: the bound of a slow-clients round
Answer = tuple[int, str, float, float]  # status, error code, seconds, the Retry-After it asked for


def ms(seconds: list[float], q: float) -> float | None:
    return round(float(np.percentile(seconds, q)) * 1000, 1) if seconds else None


def tally(keys: Any) -> str:
    return ", ".join(f"{k}: {n}" for k, n in Counter(keys).items())


def answers(name: str, what: str, got: list[Answer]) -> dict[str, Any]:
    """One client's row: its answers by status (and error code), latency of the 200s."""
    ok = [s for status, _, s, _ in got if status == 200]
    return {"client": name, "sends": what, "answers": len(got),
            "statuses": tally(sorted(f"{status} {code}".strip() for status, code, *_ in got)),
            "seconds": f"{min(g[2] for g in got):.2f}-{max(g[2] for g in got):.2f}" if got else None,
            "p50_ms": ms(ok, 50), "p95_ms": ms(ok, 95), "max_ms": round(max(ok) * 1000, 1) if ok else None}


def post(client: httpx.Client, body: dict[str, Any], url: str = URL) -> Answer:
    t0 = time.monotonic()
    r = client.post(url + "/v1/embeddings", json=body)
    code = "" if r.status_code == 200 else str(r.json().get("error", {}).get("code") or "")
    return r.status_code, code, time.monotonic() - t0, float(r.headers.get("retry-after", 1))


def step_ctrl_c(host: Host, budget_end: float) -> dict[str, Any]:
    """Each round a fresh `up` (ports of its own), sent SIGINT that long after its start (what a
    terminal's Ctrl-C delivers: the engines run in their own session), timed until it exits."""
    rounds: list[dict[str, Any]] = []
    for i, offset in enumerate(OFFSETS_S):
        side = dataclasses.replace(STACK, port=STACK.port + 1 + i)
        argv, env = UP.command(host, side)
        with tempfile.TemporaryFile() as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=child_env(env),
                                    start_new_session=True)
            time.sleep(offset)
            listening = port_busy(side.port)  # the gateway serves (503 while the engine loads)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            code = proc.wait(60)
            took = time.monotonic() - t0
            log.seek(0)
            text = log.read().decode(errors="replace")
        rounds.append({"sigint_after_s": offset, "exited_after_s": round(took, 3), "exit_code": code,
                       "gateway_listening": listening, "stack_was_up": "embedserve is up" in text,
                       "traceback": "Traceback" in text})
        if "Traceback" in text:
            rounds[-1]["log_tail"] = text[-3000:]
    starting = [r["exited_after_s"] for r in rounds if not r["stack_was_up"]]
    notes = [f"While starting: {min(starting):.2f}-{max(starting):.2f} s over {len(starting)} rounds."]
    return {"tables": {"SIGINT to `up` that long after its start, the time until it exited":
                       [{k: v for k, v in r.items() if k != "log_tail"} for r in rounds]},
            "rounds": rounds, "notes": notes if starting else []}


def step_huge(host: Host, budget_end: float, inputs: int, words: int, seconds: float, workers: int = 1,
              priority: int = 0, side: Side = STACK) -> dict[str, Any]:
    """``inputs`` texts of ``words`` distinct words (within the limits: 2,048 inputs, 300,000 tokens)
    sent again once answered (after its Retry-After when refused) by ``workers`` clients at ``priority``
    beside one short input at a time (priority 0), 0.2 s apart. Target: the short ones' P95 at most
    1 s, no 5xx, the huge one 200 or refused at once."""
    model, stop = host.served_name(side.shape), time.monotonic() + seconds * host.time_scale
    texts = [" ".join(f"{WORDS[(i + j) % len(WORDS)]}{i}" for j in range(words)) for i in range(inputs)]
    big, small = list[Answer](), list[Answer]()

    def client(got: list[Answer], body: Callable[[], Any], pause: Callable[[Answer], float]) -> None:
        with httpx.Client(timeout=300) as c:
            while time.monotonic() < stop:
                got.append(post(c, {"model": model, **body()}, f"http://127.0.0.1:{side.port}"))
                time.sleep(pause(got[-1]))

    with concurrent.futures.ThreadPoolExecutor(workers + 1) as pool:
        pool.submit(client, small, lambda: {"input": f"short question {next(SERIAL)}"}, lambda _: 0.2)
        for _ in range(workers):
            pool.submit(client, big, lambda: {"input": texts, "priority": priority},
                        lambda answer: 0 if answer[0] == 200 else answer[3])
    return {"tables": {f"{workers} x {inputs} inputs of {words} words at priority {priority} beside short "
                       "requests": [answers("huge", f"{inputs} inputs x {words} words", big),
                                    answers("short", "one input", small)]}}


async def trickle(kind: str, model: str) -> dict[str, Any]:
    """One slow client (``head``: a header line a second; ``body``: the head, then a byte a
    second): how long the server let it trickle and what it answered."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", STACK.port)
    body = json.dumps({"model": model, "input": f"slow client {next(SERIAL)}"}).encode()
    head = (b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    pieces = ([head[: head.index(b"\r\n") + 2]] + [b"X-Slow-%d: y\r\n" % i for i in range(200)]
              if kind == "head" else [head] + [body[i : i + 1] for i in range(len(body))])
    reading = asyncio.ensure_future(reader.read(65536))
    with contextlib.suppress(ConnectionError, OSError):
        for piece in pieces:
            if reading.done() or time.monotonic() - t0 > MAX_TRICKLE_S:
                break
            writer.write(piece)
            await writer.drain()
            await asyncio.wait([reading], timeout=1.0)
        await asyncio.wait([reading], timeout=max(0.0, MAX_TRICKLE_S - (time.monotonic() - t0)))
    took = time.monotonic() - t0
    answer = reading.result() if reading.done() and not reading.exception() else b""
    reading.cancel()
    writer.close()
    status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.1 ") else "closed"
    return {"kind": kind, "held_s": round(took, 2), "answer": status, "cut": took < MAX_TRICKLE_S - 1}


async def normal(client: httpx.AsyncClient, model: str, seconds: float) -> list[float]:
    """Closed loop, one short unique input a request: the 200s' latencies."""
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        body = {"model": model, "input": f"a normal query {next(SERIAL)}"}
        if (await client.post(URL + "/v1/embeddings", json=body)).status_code == 200:
            out.append(time.monotonic() - t0)
    return out


async def slow_rounds(model: str, rounds: int, tricklers: int, window_s: float) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=60) as client:
        await normal(client, model, 2.0)  # warm-up
        out: list[dict[str, Any]] = []
        for i in range(rounds):
            quiet = await normal(client, model, window_s)
            slow = [asyncio.ensure_future(trickle("head" if j % 2 else "body", model))
                    for j in range(tricklers)]
            await asyncio.sleep(0.5)  # all connected and trickling
            busy = await normal(client, model, window_s)
            held = await asyncio.gather(*slow)
            row: dict[str, Any] = {"round": i + 1, **{f"p{q}_ms_{when}": ms(got, q) for q in (50, 95)
                                                      for when, got in (("quiet", quiet), ("trickle", busy))}}
            if quiet and busy:
                row["p50_ratio"] = round(row["p50_ms_trickle"] / row["p50_ms_quiet"], 2)
            for kind in ("head", "body"):
                mine = [h for h in held if h["kind"] == kind]
                row[f"{kind}_cut_408"] = (f"{sum(h['cut'] for h in mine)}/{len(mine)} "
                                          f"({sum(h['answer'] == '408' for h in mine)})")
                row[f"{kind}_held_p50_max_s"] = (f"{np.median([h['held_s'] for h in mine]):.1f} / "
                                                 f"{max(h['held_s'] for h in mine):.1f}")
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def step_slow(host: Host, budget_end: float, tricklers: int = 400, window_s: float = 20.0) -> dict[str, Any]:
    """Each round a quiet window (the normal client alone), then one of the same length while
    ``tricklers`` connections trickle, half the head and half the body; each trickler timed
    until the server closes it (`gateway.header_timeout_s`, `gateway.body_idle_timeout_s`: 20 s)."""
    window = max(2.0, window_s * host.time_scale)
    rows = asyncio.run(slow_rounds(host.served_name(STACK.shape), host.rounds or 3, tricklers, window))
    title = f"A normal client, quiet and beside {tricklers} tricklers ({window:g} s windows)"
    return {"tables": {title: rows}}


def burst(model: str, inputs: int, clients: int = 8, words: int = 70) -> list[dict[str, Any]]:
    """``clients`` concurrent requests of ``inputs`` unique texts each."""
    def one(texts: list[str]) -> dict[str, Any]:
        t0 = time.monotonic()
        r = httpx.post(URL + "/v1/embeddings", json={"model": model, "input": texts}, timeout=120)
        ok = r.status_code == 200
        return {"status": r.status_code, "code": "" if ok else r.json()["error"]["code"],
                "tokens": r.json()["usage"]["prompt_tokens"] if ok else None,
                "s": round(time.monotonic() - t0, 3)}

    bodies = [[" ".join(f"note{next(SERIAL)}" for _ in range(words)) for _ in range(inputs)]
              for _ in range(clients)]
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, bodies))


def phase(name: str, model: str) -> dict[str, Any]:
    """Eight requests of one engine call's size (one input), then eight of several (twelve)."""
    row: dict[str, Any] = {"phase": name}
    for key, inputs in (("one_call", 1), ("several_calls", 12)):
        row[key] = got = burst(model, inputs)
        tokens = sorted(r["tokens"] for r in got if r["tokens"] is not None)
        row[f"{key}_statuses"] = tally(str(r["status"]) for r in got)
        row[f"{key}_tokens"] = f"{tokens[0]:,}-{tokens[-1]:,}" if tokens else "no usage"
    return row


def capacity() -> float | None:
    lines = httpx.get(URL + "/metrics", timeout=10).text.splitlines()
    gauge = "embedserve_capacity_tokens_per_second "
    return next((float(x.split()[1]) for x in lines if x.startswith(gauge)), None)


def step_idle(host: Host, budget_end: float, idle_s: float = 3600.0) -> dict[str, Any]:
    """Three evening rounds, ``idle_s`` with no request at all, the morning's burst. Target:
    every request of the burst answered 200 (none refused with 413), and the measured capacity
    the same before and after the idle spell."""
    model = host.served_name(STACK.shape)
    evening = [phase(f"evening, round {i + 1}", model) for i in range(3)]
    before, idle = capacity(), idle_s * host.time_scale
    time.sleep(idle)
    after = capacity()
    morning = phase(f"after {idle:g} s idle", model)
    rows = [{k: v for k, v in p.items() if k not in ("one_call", "several_calls")}
            for p in (evening[-1], morning)]
    caps = {"capacity_before_idle": before, "capacity_after_idle": after, "capacity_after_burst": capacity()}
    return {"phases": [*evening, morning], **caps, "tables": {
        "Statuses and embedded tokens (usage) per phase": rows, "Capacity (tokens/s)": [caps]}}


def step_ramp(host: Host, budget_end: float) -> dict[str, Any]:
    """A full admission window for 20 s, 45 s idle, then one closed-loop step per in-flight
    count (20 s to settle, 30 s measured); the table, the crossing and ``ramp.png``."""
    k, url, runs = host.time_scale, f"http://127.0.0.1:{RAMP.port}", host.work.root / "runs"
    a = argparse.Namespace(tokens=RAMP_TOKENS, inputs=1, seconds=30 * k, warmup=20 * k, prime=20 * k,
                           idle=45 * k)
    load_before = os.getloadavg()
    ramp.prime(url, a, RAMP_BOUND // RAMP_TOKENS, runs / "ramp-prime")
    rows = []
    for c in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12):
        rows.append(ramp.step(url, c, a, runs / f"ramp-{c}"))
        print(json.dumps(rows[-1]), flush=True)
    doc = {"title": f"embedserve_load along a closed-loop ramp, CPU stack ({os.cpu_count()} cores), 1 x "
                    f"{RAMP_TOKENS} tokens per request, admission bound {RAMP_BOUND:,} tokens",
           "steps": rows, "crossing": ramp.crossing(rows), "load_average": [load_before, os.getloadavg()]}
    (folder := host.out or host.work.root).mkdir(parents=True, exist_ok=True)
    ramp.plot(doc, folder / "ramp.png")
    return {**doc, "tables": {"The ramp (medians over each step's measured time)": ramp.table(doc)},
            "notes": ramp.verdict(doc)}


HUGE = partial(step_huge, inputs=1000, words=400, seconds=60.0)
ADMITTED = partial(step_huge, inputs=60, words=300, seconds=45.0)
BULK = partial(step_huge, inputs=4, words=24, seconds=30.0, workers=16, side=PRIORITY)
Probe = tuple[str, Callable[..., dict[str, Any]], float]  # a step: its name, what it runs, its seconds
PROBES: dict[str, list[Probe]] = {  # each on a fresh stack
    "huge-request": [("huge-request", HUGE, 90), ("huge-request-admitted", ADMITTED, 60)],
    "slow-clients": [("slow-clients", step_slow, 200)], "idle-burst": [("idle-burst", step_idle, 3720)],
    "autoscale-ramp": [("autoscale-ramp", step_ramp, 700)],
    "priority": [("priority-alone", partial(BULK, workers=0), 40), ("priority-same",
                 partial(BULK, priority=0), 45), ("priority-10", partial(BULK, priority=10), 45)]}
SCENARIOS = ("ctrl-c", *PROBES)


def steps() -> list[Step]:
    out = [Step("ctrl-c", ("ctrl-c",), step_ctrl_c, 150)]
    for name, probe in PROBES.items():
        side = {"autoscale-ramp": RAMP, "priority": PRIORITY}.get(name, STACK)
        on, off = lifecycle(f"{name}-stack", name, [side], 120)
        out += [on, *(Step(step, (name,), run, seconds) for step, run, seconds in probe), off]
    return out
