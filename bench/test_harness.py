"""The harness without a GPU or a server: the report's arithmetic, the command lines each side and
run get, the run plan, every scenario's steps run end to end against stand-ins for the processes
and the load generator (the profiles': test_profiles.py). `python3 -m pytest bench/test_harness.py`."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import crosscheck
import gpu_scenarios as gs
import harness
import measure
import peers
import pytest
import report
import runner
import suite
from harness import Host, Side
from procs import WorkDir

from embedserve.config.engine import EngineSettings


def row(case: str, side: str, tok: int, p50: float = 10.0, section: str = "s", **kw: Any) -> dict[str, Any]:
    return {"section": section, "case": case, "side": side, "tok_s": tok, "p50_ms": p50, "errors": 0, **kw}


def test_each_side_beside_the_first_with_medians_and_the_worst_cache_hit_rate() -> None:
    rows = [row("short", "raw", 50_000, 200, prefix_cache_hit_rate=0.0, gpu_used_gb=20.1),
            row("short", "gateway", 66_000, 150, prefix_cache_hit_rate=0.01),
            row("short", "raw", 60_000, 220, prefix_cache_hit_rate=0.02, gpu_used_gb=20.4),
            row("short", "gateway", 70_000, 160), row("long", "gateway", 9_000, 900)]
    raw, gw, long = report.per_side(rows)
    assert (raw["tok_s"], raw["runs"], raw["p50_ms"], raw["vs_first"]) == (55_000, 2, 210, 1.0)
    assert gw["tok_s"] == 68_000 and gw["vs_first"] == pytest.approx(1.236, abs=1e-3)
    assert raw["prefix_cache_hit_rate"] == 0.02 and raw["gpu_used_gb"] == 20.4 and gw["gpu_used_gb"] is None
    assert gw["rounds"] == "66,000 / 70,000" and long["vs_first"] == 1.0  # the first side of its case
    md = "\n".join(report.section("T", rows, []))
    assert "| short | gateway | 2 | 68,000 | 1.236 |" in md
    assert "GPU busy %" not in md and "cache hits" in md  # a column no row has is left out


def test_the_crosscheck_must_agree_within_five_percent() -> None:
    rows = [row("short", "raw", 60_000), row("short", "raw", 62_000), row("short", "gateway", 70_000)]
    cross = [row("short", "raw", 63_000), row("short", "gateway", 60_000)]
    ok, off = report.crosscheck_agreement(rows, cross)
    assert ok["loadtest_tok_s"] == 61_000 and ok["agree"] is True
    assert off["deviation"] == pytest.approx(-0.143, abs=1e-3) and off["agree"] is False


def test_a_section_gathers_the_rows_of_every_step_that_shares_its_title() -> None:
    steps = {"a": {"ok": True, "rows": [row("short", "x", 100, section="One")],
                   "not_run": {"vllm-0.6b": "vLLM not importable"}},
             "b": {"ok": True, "rows": [row("short", "x", 120, section="One"),
                                        row("c", "y", 1, section="Two")],
                   "crosscheck_rows": [row("short", "x", 112, section="One", client="crosscheck")],
                   "quality": {"fp8-4b": {"not_run": "no corpus"}}, "notes": ["A soak: `--rate 3`."]},
             "c": {"ok": False, "error": "boom"}}
    meta = {"command": "python bench/suite.py --only x", "dry_run": True}
    md = report.render({"meta": meta, "steps": steps})
    assert md.count("## One") == 1 and "| short | x | 2 | 110 |" in md and "## Two" in md
    assert "| short | x | 110 | 112 | 0.018 | 0 | yes |" in md
    assert "vllm-0.6b not run: vLLM not importable" in md and "| fp8-4b |" in md and "no corpus" in md
    assert "`python bench/suite.py --only x`" in md and "**Dry run on CPU**" in md
    assert "A soak: `--rate 3`." in md
    assert "## Failed steps" in md and "boom" in md


def test_raw_runs_send_capped_ids_and_cpu_runs_words(tmp_path: Path) -> None:
    raw = measure.Target("http://h:30000/v1/embeddings", "/m/4b", "4b", True, 8192, [])
    a = measure.loadtest_argv(raw, measure.Load("uniform:16-512", 64), Path("/o"), 3)
    assert a[a.index("--input") + 1] == "ids" and a[a.index("--max-tokens") + 1] == "8192"
    assert a[a.index("--tokenizer") + 1] == "/m/4b" and "--repeat-rate" not in a
    words = measure.Load("fixed:20", 16, inputs="32", words=True, encoding="base64", repeated_content=True)
    b = measure.loadtest_argv(measure.Target("http://h:1/embeddings", "/m", "m", False, 256, []), words,
                              Path("/o"), 3)
    assert "--tokenizer" not in b and "--input" not in b and b[b.index("--inputs") + 1] == "32"
    assert b[b.index("--encoding-format") + 1] == "base64"
    assert "--repeat-rate" in b  # repeated content is labelled as such by loadtest


def test_a_side_is_sent_what_its_kind_takes(tmp_path: Path) -> None:
    host = Host(WorkDir(tmp_path))
    engine, gw = gs.raw("4b"), gs.gateway("gateway", 8000, gs.raw("4b"), "gateway-4b")
    t_raw, t_gw = measure.target(host, engine), measure.target(host, gw)
    assert t_raw.ids and not t_gw.ids and t_gw.url == "http://127.0.0.1:8000/v1/embeddings"
    assert t_gw.metrics == ["http://127.0.0.1:30000/metrics"] and t_raw.model == "4b"
    infinity = measure.target(host, gs.PEER_INFINITY)
    assert infinity.url.endswith(":7997/embeddings") and not infinity.ids
    assert infinity.rerank_url == "http://127.0.0.1:7997/rerank"
    assert str(t_gw.rerank_url).endswith(":8000/v1/rerank")
    assert host.cap_of("bundled") == 256 and host.served_name("bundled") == "all-MiniLM-L6-v2"


def test_the_crosscheck_client_is_given_the_same_length_mix_clamped_to_the_cap() -> None:
    assert measure.crosscheck_lengths("seed") == "0.92:8-512,0.06:513-1024,0.02:1025-32768"
    assert measure.crosscheck_lengths("uniform:16-512") == "1:16-512"
    assert measure.crosscheck_lengths("fixed:300") == "1:300-300"
    with pytest.raises(ValueError, match="cannot send"):
        measure.crosscheck_lengths("file:/tmp/texts.jsonl")
    a = argparse.Namespace(ids="x", text=None, cap=8192, vocab=50_000,
                           lengths=crosscheck.length_buckets("0.9:8-512,0.1:9000-10000"))
    rng = random.Random(3)
    lengths = [len(crosscheck.make_input(a, rng, [])) for _ in range(2000)]
    long = [n for n in lengths if n > 512]
    assert set(long) == {8192} and 0.07 < len(long) / len(lengths) < 0.13 and min(lengths) >= 8


def checkpoint(folder: Path) -> Path:
    """A folder with the 4B's config.json (the KV pool's size follows from it)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"hidden_size": 2560, "num_attention_heads": 32,
                                                    "num_hidden_layers": 36, "num_key_value_heads": 8,
                                                    "head_dim": 128}))
    return folder


def test_vllm_gets_the_same_kv_pool_and_the_tuned_side_the_batch_budget(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "4b")
    host = Host(WorkDir(tmp_path / "w"), models={"4b": str(model)})
    plain, _ = peers.vllm_command(host, Side("vllm", peers.VLLM, 8720, "4b"))
    assert plain[plain.index("serve") + 1] == str(model) and plain[plain.index("--runner") + 1] == "pooling"
    assert plain[plain.index("--kv-cache-memory-bytes") + 1] == str(16_384 * 2 * 36 * 8 * 128 * 2)
    assert "--no-enable-chunked-prefill" in plain and "--api-server-count" not in plain
    tuned, _ = peers.vllm_command(host, Side("tuned", peers.VLLM, 8721, "4b", args=peers.VLLM_TUNED_ARGS))
    assert tuned[tuned.index("--max-num-batched-tokens") + 1] == "16384"
    stub = Host(host.work, models=host.models, vllm_cmd=("python3", "stub.py"), vllm_kv_tokens=65_536)
    argv, _ = peers.vllm_command(stub, Side("vllm", peers.VLLM, 1, "4b"))
    assert argv[:3] == ["python3", "stub.py", "serve"]
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(4 * 16_384 * 2 * 36 * 8 * 128 * 2)
    profiler = json.loads(argv[argv.index("--profiler-config") + 1])  # idle until /start_profile
    assert profiler["torch_profiler_dir"] == str(tmp_path / "w" / "traces" / "vllm-4b")


def test_vllm_start_up_facts_come_from_its_log(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("compilation_config={'cudagraph_mode': <CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>}\n"
                   "WARNING Pooling models do not support full cudagraphs. Overriding cudagraph_mode to "
                   "PIECEWISE.\nINFO Using FLASH_ATTN attention backend out of potential backends: "
                   "['FLASH_ATTN'].\nother\n")
    facts = peers.vllm_facts(log)
    assert facts["attention_backend"] == "FLASH_ATTN" and facts["cudagraph_mode"] == "PIECEWISE"
    assert len(facts["log_lines"]) == 3


def test_variants_join_their_settings_or_bring_their_own(tmp_path: Path) -> None:
    name, env = peers.variant("x2+graphs+tokenizer-workers")
    assert name == "x2+graphs+tokenizer-workers" and env["EMBEDSERVE_ENGINE__ENGINES_PER_GPU"] == "2"
    extra = json.loads(env["EMBEDSERVE_ENGINE__EXTRA_ARGS"])
    assert extra == [*peers.TC_PIECEWISE, "--tokenizer-worker-num", "2"]
    own = {"EMBEDSERVE_A": "2", "EMBEDSERVE_B": "x"}
    assert peers.variant("calls2=EMBEDSERVE_A=2,EMBEDSERVE_B=x") == ("calls2", own)
    assert peers.variant("nokv")[1] == {"EMBEDSERVE_ENGINE__KV_CACHE": "none"}
    former = EngineSettings(**{k.removeprefix("EMBEDSERVE_ENGINE__").lower(): v  # the former defaults
                               for k, v in peers.variant("paged")[1].items()})
    assert (former.kv_cache, former.overlap_schedule, former.pooled_last_layer) == ("paged", False, False)
    tuned_only = Host(WorkDir(tmp_path), vllm_sides=("vllm tuned",))
    assert [s.name for s in gs.vllm_sides("4b")(tuned_only)] == ["embedserve", "vllm tuned"]
    for bad in ("x2+turbo", "n=PATH=/x"):
        with pytest.raises(ValueError):
            peers.variant(bad)


def test_the_plan_holds_what_each_scenario_needs() -> None:
    names = [s.name for s in suite.plan(("peers",))]
    assert names == ["models", "engines", "peers-infinity-1", "peers-infinity-2", "stop-engines", "finish"]
    both = [s.name for s in suite.plan(("raw-vs-gateway", "scale"))]
    assert both.index("down-2") < both.index("engines") and "raw-vs-gateway-0.6b-3" in both
    vllm = [s.name for s in suite.plan(("vllm",), ("0.6b",))]
    assert vllm[:3] == ["models", "vllm-start", "vllm-ready-0.6b"]
    assert not any("4b" in n for n in vllm) and "engines" not in vllm
    assert suite.plan(("fp8",))[0].run.keywords["shapes"] == ("4b", "0.6b")  # type: ignore[attr-defined]
    assert [s.name for s in suite.plan(("drill",))] == ["models", "drill", "finish"]
    assert suite.plan(("cpu-peers",))[0].name == "cpu-peers-export"  # no checkpoints built
    every = [s.name for s in suite.plan(suite.SCENARIOS)]
    assert len(every) == len(set(every))


def test_no_two_processes_of_a_scenario_share_a_port(tmp_path: Path) -> None:
    """Within a scenario (scenarios stop what they started before the next one starts), every
    process has ports of its own: a gateway's, and an `up` stack's engines on its port + 22000, ..."""
    host = Host(WorkDir(tmp_path), variants=(("x2", {}), ("graphs", {})),
                models={"qwen3": "/m", "minilm": "/m"})
    for scenario in suite.SCENARIOS:
        owner: dict[int, str] = {}
        for step in suite.plan((scenario,)):
            for key in ("sides", "start"):
                for side in runner.resolve(host, getattr(step.run, "keywords", {}).get(key) or []):
                    engines = range(harness.MAX_ENGINES) if side.kind is harness.UP else []
                    for port in [side.port, *(side.port + harness.UP_ENGINE_OFFSET + i for i in engines)]:
                        assert owner.setdefault(port, side.key) == side.key, (scenario, port, side.key)


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, int]]:
    """Processes that are always up and a load generator that answers at once: every step
    runs through its real orchestration, nothing is started or sent."""
    runs: list[tuple[str, str, int]] = []

    def start(host: Host, side: Side) -> dict[str, Any] | None:
        if host.work.running(side.key):
            return None
        info = {"pid": os.getpgrp(), "argv": side.kind.command(host, side)[0], "started_at": 0.0,
                "log": "/dev/null"}
        host.work.state["procs"][side.key] = info
        return info

    def fake_measure(name: str, t: measure.Target, load: measure.Load, runs_dir: Path, *, seed: int = 0,
                     tags: dict[str, Any] | None = None, client: str = "loadtest", **_: Any) -> Any:
        runs.append(((tags or {}).get("side", ""), client, seed))
        return {"name": name, **(tags or {}), "client": client, "tok_s": 1000 + seed, "req_s": 10.0,
                "requests": 5, "errors": 0}

    monkeypatch.setattr(harness, "start", start)
    monkeypatch.setattr(harness, "wait_ready", lambda host, side, budget_end, limit_s=0: 1.0)
    monkeypatch.setattr(runner, "measure", fake_measure)
    monkeypatch.setattr(runner, "http_post_json", lambda *a, **k: {"data": [{"embedding": [1, 0]}]})
    monkeypatch.setattr(runner, "gate", lambda host, name, base, cand: {"passed": True, "texts": 3})
    monkeypatch.setattr(harness, "pack_fi_cache", lambda host: None)
    monkeypatch.setattr(WorkDir, "stop", lambda self, tag, *a: self.state["procs"].pop(tag, None) and True)
    return runs


def test_every_gpu_scenario_runs_end_to_end_on_stand_ins(tmp_path: Path, stand_ins: list[Any]) -> None:
    models = {s: str(checkpoint(tmp_path / s)) for s in ("4b", "0.6b")}
    host = Host(WorkDir(tmp_path / "w"), device="cuda", models=models,
                variants=(("x2", {"EMBEDSERVE_ENGINE__ENGINES_PER_GPU": "2"}),), out=tmp_path / "out",
                vllm_cmd=("python3", "bench/inprocess.py"))
    skip = {"models", "rerank-gpu-model", "drill", "up-2", "scale-load-2"}  # need checkpoints, two GPUs
    steps = [s for s in suite.plan(suite.GPU_SCENARIOS)  # profiles: test_the_same_requests_are_profiled...
             if s.name not in skip and "profile" not in s.name and "kernels" not in s.name]
    assert suite.run(host, steps, tmp_path / "out", None, []) == 0
    st = host.work.state["steps"]
    assert [r["side"] for r in st["vllm-load-0.6b-1"]["rows"][:4]] == ["embedserve", "embedserve x2", "vllm",
                                                                      "vllm tuned"]
    second = [r["side"] for r in st["vllm-load-0.6b-1"]["rows"] if r["case"] == "short, 256 in flight"]
    assert second == ["embedserve x2", "vllm", "vllm tuned", "embedserve"]  # the order turns each case
    one = st["raw-vs-gateway-4b-3"]["rows"]
    order = [(r["side"], r["round"]) for r in one[:4]]
    assert order == [("raw", 0), ("gateway", 0), ("gateway", 1), ("raw", 1)]
    assert len({r["tok_s"] for r in one if r["round"] == 0}) == 1  # same seed per round on every side
    assert [(r["side"], r["client"]) for r in st["raw-vs-gateway-4b-3"]["crosscheck_rows"]][:2] == [
        ("raw", "crosscheck"), ("gateway", "crosscheck")]
    assert st["raw-vs-gateway-4b-1"]["vectors"]["min_0_9999"] is True
    assert st["soak-capacity"]["soak_rate_req_s"] == 8.5 and st["fp8-quality"]["quality"]["fp8-4b"]["passed"]
    md = (tmp_path / "out" / "results.md").read_text()
    assert "- peers-infinity-1: infinity: Infinity not importable" in md  # no Infinity here: said, not failed
    for title in ("Raw SGLang (token ids) vs the gateway (texts), 4b", "Soak capacity", "Scale-out",
                  "FP8 vs bf16", "Cross-check",
                  "vLLM 0.26.0 (pooling runner) vs embedserve, 0.6b"):
        assert title in md, title
    written = json.loads((tmp_path / "out" / "results.json").read_text())["steps"]
    assert written.keys() == {s.name for s in steps}


def test_a_side_that_answers_nothing_is_stopped_and_not_measured_again(
        tmp_path: Path, stand_ins: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    real = runner.measure

    def vllm_stalls(name: str, t: measure.Target, load: measure.Load, runs: Path,
                    **kw: Any) -> dict[str, Any]:
        out = real(name, t, load, runs, **kw)
        return out | {"requests": 0} if out["side"] == "vllm" else out

    monkeypatch.setattr(runner, "measure", vllm_stalls)
    host = Host(WorkDir(tmp_path / "w"), models={"0.6b": str(checkpoint(tmp_path / "m"))}, vllm_cmd=("stub",))
    sides = gs.vllm_sides("0.6b")
    runner.step_start(host, 0.0, sides)
    out = runner.step_compare(host, math.inf, sides, gs.VLLM_CASES[:2], section="v", seed=1, stall=True)
    assert out["stalled"] == {"vllm": "no answer in 'short, 64 in flight': stopped"}
    assert "vllm" not in {r["side"] for r in out["rows"] if r["case"] == "short, 256 in flight"}
    assert not harness.running(host, sides(host)[1])  # stopped, and recorded as failed for this run
    assert host.work.state["failed_sides"] == ["vllm-0.6b"]


def test_a_load_step_cut_off_goes_on_at_the_case_it_was_in(
        tmp_path: Path, stand_ins: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    real, cut = runner.measure, ["seed mix"]

    def killed_in_a_case(*args: Any, **kw: Any) -> dict[str, Any]:
        if kw["tags"]["case"] in cut:  # the command's time limit: the process ends mid-case
            cut.clear()
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(runner, "measure", killed_in_a_case)
    steps = [s for s in suite.plan(("vllm",), ("0.6b",)) if s.name in ("vllm-start", "vllm-load-0.6b-1")]
    models = {"0.6b": str(checkpoint(tmp_path / "m"))}
    for command in (1, 2):  # the same command twice: a new process reads the work dir's state
        host = Host(WorkDir(tmp_path / "w"), models=models, rounds=1, vllm_cmd=("stub",))
        with pytest.raises(KeyboardInterrupt) if command == 1 else contextlib.nullcontext():
            suite.run(host, steps, tmp_path / "out", None, [])
        # the warm-up and two cases on three sides, then the last two cases on servers still warm
        assert len(stand_ins) == (3 + 2 * 3 if command == 1 else 2 * 3)
        stand_ins.clear()
    rows = host.work.state["steps"]["vllm-load-0.6b-1"]["rows"]
    assert [r["case"] for r in rows] == [c.name for c in gs.VLLM_CASES[:4] for _ in range(3)]
    assert "vllm-load-0.6b-1" not in host.work.state["cases"]  # forgotten once the step is done


def test_a_load_step_stops_between_cases_where_the_next_would_outrun_its_budget(
        tmp_path: Path, stand_ins: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    clock, real = [1000.0], runner.measure

    def hundred_seconds_a_run(*args: Any, **kw: Any) -> dict[str, Any]:
        clock[0] += 100.0
        return real(*args, **kw)

    monkeypatch.setattr(runner, "measure", hundred_seconds_a_run)
    monkeypatch.setattr(time, "time", lambda: clock[0])
    steps = [s for s in suite.plan(("vllm",), ("0.6b",)) if s.name in ("vllm-start", "vllm-load-0.6b-1")]
    models = {"0.6b": str(checkpoint(tmp_path / "m"))}

    def command(budget_s: float | None) -> int:  # the same command again: a new process reads the state
        return suite.run(Host(WorkDir(tmp_path / "w"), models=models, rounds=1, vllm_cmd=("stub",)),
                         steps, tmp_path / "out", budget_s, [])

    assert command(300.0) == 3  # under the step's 450 s but over its least: it starts, warms up, stops
    assert len(stand_ins) == 3 and WorkDir(tmp_path / "w").state["cases"]["vllm-load-0.6b-1"]["done"] == 0
    stand_ins.clear()
    start = clock[0]
    assert command(1000.0) == 3  # stopped between cases, not cut off
    state = WorkDir(tmp_path / "w").state
    done = state["cases"]["vllm-load-0.6b-1"]["done"]
    assert 1 <= done < 4 and clock[0] <= start + 1000.0  # it never began a case it had no time for
    sides = gs.vllm_sides("0.6b")(Host(WorkDir(tmp_path / "w"), models=models, vllm_cmd=("stub",)))
    assert all(s.key in state["procs"] for s in sides)  # still up for the next command
    (work := WorkDir(tmp_path / "w")).stop_all()  # stopped between the commands all the same: started again
    work.save()
    stand_ins.clear()
    assert command(None) == 0
    assert len(stand_ins) == 3 + (4 - done) * 3  # the warm-up, then the cases not yet measured
    done_step = WorkDir(tmp_path / "w").state["steps"]["vllm-load-0.6b-1"]
    assert [r["case"] for r in done_step["rows"]] == [c.name for c in gs.VLLM_CASES[:4] for _ in range(3)]
    assert sorted(done_step["restarted"]) == sorted(s.key for s in sides)  # said in the results


def test_host_rounds_replace_each_cases_and_in_process_sides_run_each_batch(tmp_path: Path,
                                                                            stand_ins: list[Any]) -> None:
    import cpu_scenarios as cs

    host = Host(WorkDir(tmp_path), rounds=1)
    st_torch = next(s for s in cs.peer_sides(host) if s.name == "ST torch in process")
    runner.step_start(host, 0.0, [st_torch])
    rows = runner.alternate(host, [st_torch], cs.PEER_LOADS[0], 5, {"section": "p"})
    assert [r["side"] for r in rows] == ["ST torch in process, batch 1", "ST torch in process, batch 16"]


def test_cases_picks_the_load_steps_cases_in_its_order(tmp_path: Path, stand_ins: list[Any]) -> None:
    steps = [s for s in suite.plan(("vllm",), ("0.6b",)) if s.name in ("vllm-start", "vllm-load-0.6b-1",
                                                                         "vllm-load-0.6b-2")]
    host = Host(WorkDir(tmp_path / "w"), models={"0.6b": str(checkpoint(tmp_path / "m"))}, rounds=1,
                vllm_cmd=("stub",), cases=("one in flight", "medium"))  # ";" on the command line
    assert suite.run(host, steps, tmp_path / "out", None, []) == 0
    done = host.work.state["steps"]
    assert "none of its cases" in done["vllm-load-0.6b-1"]["skipped"]  # not even warmed up
    assert [r["case"] for r in done["vllm-load-0.6b-2"]["rows"]] == ["one in flight"] * 3 + ["medium"] * 3
    assert done["vllm-load-0.6b-2"]["crosscheck_rows"] == []  # its cross-checked case was not asked for
    assert len(stand_ins) == 3 + 2 * 3  # load-2's warm-up and the two cases, on three sides
