"""The suite's arithmetic, report and run plan, checked without a GPU:
`python3 -m pytest bench/test_report.py` (pytest puts bench/ on the import path)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import cachestats
import loadgen
import pytest
import results_md
import suite

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "results-cpu-dry-run.json"


def row(case: str, side: str, tok: int, p50: float, **kw: Any) -> dict[str, Any]:
    return {"case": case, "side": side, "tok_s": tok, "p50_ms": p50, "p95_ms": p50 * 2, "errors": 0, **kw}


def test_side_by_side_takes_medians_and_the_worst_cache_hit_rate() -> None:
    rows = [row("short", "raw", 50_000, 200, prefix_cache_hit_rate=0.0, gpu_used_gb=20.1),
            row("short", "gateway", 66_000, 150, prefix_cache_hit_rate=0.01),
            row("short", "raw", 60_000, 220, prefix_cache_hit_rate=0.02, gpu_used_gb=20.4),
            row("short", "gateway", 70_000, 160)]
    (c,) = results_md.side_by_side(rows, "raw", "gateway")
    assert c["base_tok_s"] == 55_000 and c["alt_tok_s"] == 68_000 and c["runs"] == "2+2"
    assert c["ratio"] == pytest.approx(1.236, abs=1e-3) and c["added_p50_ms"] == -55
    assert c["base_hit_rate"] == 0.02 and c["alt_hit_rate"] == 0.01
    assert c["base_gpu_gb"] == 20.4 and c["alt_gpu_gb"] is None


def test_crosscheck_must_agree_within_five_percent() -> None:
    rows = [row("short", "raw", 60_000, 1), row("short", "raw", 62_000, 1),
            row("short", "gateway", 70_000, 1)]
    cross = [row("short", "raw", 63_000, 1), row("short", "gateway", 60_000, 1)]
    raw, gw = results_md.crosscheck_agreement(rows, cross)
    assert raw["loadtest_tok_s"] == 61_000 and raw["agree"] is True
    assert gw["deviation"] == pytest.approx(-0.143, abs=1e-3) and gw["agree"] is False


def test_scale_compares_one_and_two_engines_per_load() -> None:
    rows = [{"case": "short", "replicas": 1, "conc": 128, "tok_s": 80_000, "errors": 0},
            {"case": "short", "replicas": 2, "conc": 256, "tok_s": 158_000, "errors": 1}]
    (s,) = results_md.scale_summary(rows)
    assert s["ratio"] == pytest.approx(1.975) and s["two_conc"] == 256 and s["errors"] == 1


def test_cache_hit_rate_from_sglang_counters_sums_labelled_series() -> None:
    page = ("# TYPE sglang:prompt_tokens_total counter\n"
            'sglang:prompt_tokens_total{model_name="m4"} 1000.0\n'
            'sglang:cached_tokens_total{model_name="m4",cache_source="device"} 30.0\n'
            'sglang:cached_tokens_total{model_name="m4",cache_source="host"} 10.0\n'
            'sglang:prompt_tokens_histogram_bucket{le="8"} 3\n')
    before = cachestats.parse_counters(page)
    assert before == {cachestats.PROMPT_TOKENS: 1000.0, cachestats.CACHED_TOKENS: 40.0}
    after = {cachestats.PROMPT_TOKENS: 3000.0, cachestats.CACHED_TOKENS: 240.0}
    assert cachestats.hit_rate(before, after) == 0.1
    assert cachestats.hit_rate(before, before) is None and cachestats.hit_rate(None, after) is None


def test_hit_rate_from_the_loadtest_report_wins_wherever_it_sits() -> None:
    assert loadgen.find_hit_rate({"prefix_cache_hit_rate": 0.25}) == 0.25
    assert loadgen.find_hit_rate({"target": {"prefix_cache_hit_rate": 0}}) == 0.0
    assert loadgen.find_hit_rate({"measured": {}}) is None
    assert loadgen.find_hit_rate({"prefix_cache": {"status": "measured", "hit_rate": 0.003}}) == 0.003
    assert loadgen.find_hit_rate({"prefix_cache": {"status": "not exposed", "hit_rate": None}}) is None


def test_raw_runs_send_capped_ids_and_optional_flags_only_when_supported(monkeypatch: Any) -> None:
    monkeypatch.setattr(loadgen, "embedserve_cmd", lambda: ["embedserve"])
    monkeypatch.setattr(loadgen, "loadtest_help", lambda: "  --unique   no prefix cache\n  --raw-engine\n")
    raw = loadgen.Target("http://h:30000", "/m/4b", raw=True, cap=8192)
    gw = loadgen.Target("http://h:8000", "/m/4b", raw=False)
    a = loadgen.loadtest_argv(raw, loadgen.Load("uniform:16-512", 64), Path("/o"), 3)
    assert a[a.index("--input") + 1] == "ids" and a[a.index("--max-tokens") + 1] == "8192"
    assert "--raw-engine" in a and "--unique" in a and a[a.index("--model") + 1] == "4b"
    repeated = loadgen.Load("seed", 32, inputs="1-16", repeated_content=True)
    b = loadgen.loadtest_argv(gw, repeated, Path("/o"), 3)
    assert "--input" not in b and "--unique" not in b and b[b.index("--inputs") + 1] == "1-16"
    with pytest.raises(RuntimeError, match="input_type"):
        loadgen.loadtest_argv(gw, loadgen.Load("seed", 1, input_type="query"), Path("/o"), 0)


def test_only_selects_a_scenario_and_the_steps_it_needs() -> None:
    names = [s.name for s in suite.plan(("peers",))]
    assert names == ["models", "engines", "peers-infinity-1", "peers-infinity-2", "stop-engines", "finish"]
    scale = [s.name for s in suite.plan(("scale",))]
    assert "engines" not in scale and scale[-4:] == ["up-2", "scale-load-2", "down-2", "finish"]
    both = [s.name for s in suite.plan(("raw-vs-gateway", "scale"))]
    assert both.index("down-2") < both.index("engines")  # the stack's GPUs are free before
    everything = [s.name for s in suite.plan(suite.SCENARIOS)]
    assert len(set(everything)) == len(everything) == 61
    assert "raw-vs-gateway-0.6b-3" in everything and "raw-vs-gateway-0.6b-3" not in names


def test_the_vllm_scenario_runs_the_small_model_first_and_stops_its_servers() -> None:
    names = [s.name for s in suite.plan(("vllm",))]
    assert names[0] == "models" and names[-1] == "finish"
    assert names[1] == "vllm-start"  # every shape's servers start together
    assert names.index("vllm-stop-0.6b") < names.index("vllm-ready-4b")
    only_small = [s.name for s in suite.plan(("vllm",), ("0.6b",))]
    assert not any(n.endswith("4b") or "-4b-" in n for n in only_small)
    assert "engines" not in names  # its servers are its own


def test_the_recorded_dry_run_renders_every_table() -> None:
    res = json.loads(FIXTURE.read_text())
    md = results_md.render(res)
    for title in ("Raw SGLang (token ids) vs the gateway (texts), 4b", "the gateway (texts), 0.6b", "KV pool",
                  "Radix", "Peers on the same GPU", "Soak capacity", "Scale-out",
                  "Cross-check with bench/crosscheck.py"):
        assert title in md
    assert "| case | runs raw+gateway | raw tok/s | gateway tok/s | ratio |" in md
    assert "**Dry run on CPU**" in md and "## Failed steps" not in md
    assert "peers-vllm: vLLM is not installed here" in md
    assert "| one in flight | 4+4 |" in md  # Infinity vs embedserve, alternating rounds
    rows = results_md.rows_of(res["steps"], "raw-vs-gateway-4b")
    cmp = results_md.side_by_side(rows, "raw", "gateway")
    assert [c["case"] for c in cmp] == ["short", "seed mix", "seed mix, 1-16 inputs", "medium", "long",
                                        "one in flight"]
    assert [c["runs"] for c in cmp] == ["2+2", "1+1", "1+1", "1+1", "1+1", "6+6"]
    assert all(r["errors"] == 0 for r in rows)
    cross = results_md.rows_of(res["steps"], "raw-vs-gateway-4b", "crosscheck_rows")
    assert [(c["case"], c["side"]) for c in cross] == [("short", "raw"), ("short", "gateway"),
                                                       ("medium", "raw"), ("medium", "gateway")]


def test_the_header_names_the_tokenizer_the_checkpoints_had(tmp_path: Path) -> None:
    """Counted from the folders the models step used: a folder kept from an older run may hold
    the small BPE synth-model trained before it wrote Qwen3's tokenizer."""
    from embedserve.runtime.synth_model import write_tokenizer_files

    write_tokenizer_files(tmp_path)
    qwen3 = suite.tokenizer_tokens(tmp_path)
    assert qwen3 == results_md.QWEN3_TOKENS

    def said(step: dict[str, Any]) -> str:
        return results_md.header({"steps": {"models": {"ok": True, **step}}, "meta": {}})[2]

    assert "shapes and Qwen3's own tokenizer (`embedserve synth-model`)" in said(
        {"tokenizer_tokens": {"4b": qwen3, "0.6b": qwen3}})
    assert "a 590-token byte-level BPE tokenizer trained on the fly, not Qwen3's" in said({})
    assert "a tokenizer of 590 / 151,669 tokens, not Qwen3's" in said(
        {"tokenizer_tokens": {"4b": qwen3, "0.6b": 590}})


def test_fp8_sections_show_the_gate_and_why_a_backend_did_not_run() -> None:
    measured = {"median_cosine": 0.995, "p1_cosine": 0.97, "top10_overlap": 0.93}
    retrieval = {"baseline": {"recall_at_10": 0.71, "ndcg_at_10": 0.5},
                 "candidate": {"recall_at_10": 0.69, "ndcg_at_10": 0.49}}
    st = {"fp8-quality": {"4b": {"texts": 1000, "cosine": {"median": 0.995, "p1": 0.97, "min": 0.9},
                                 "measured": measured, "retrieval": retrieval, "passed": False},
                          "minilm": {"not_run": "an engine of the pair did not start"}},
          "attention": {"not_run": {"fa3": "sgl_kernel/flash_ops.abi3.so is not installed"}, "rows": []}}
    md = "\n".join(results_md.fp8_sections(st))
    assert "| 4b | 1,000 | 0.995 | 0.97 | 0.9 | 0.93 | 0.71 | 0.69 | NO | - |" in md
    assert "| minilm | - | - | - | - | - | - | - | - | an engine of the pair did not start |" in md
    assert "attention backend fa3 not run: sgl_kernel/flash_ops.abi3.so is not installed" in md


def test_attention_backends_get_a_quality_table() -> None:
    gate = {"texts": 1000, "cosine": {"min": 0.999},
            "measured": {"median_cosine": 0.9999, "p1_cosine": 0.9998, "top10_overlap": 0.98}, "passed": True}
    md = "\n".join(results_md.fp8_sections({"attention": {"rows": [], "quality": {"fa3": gate}}}))
    assert "Quality gate, each backend's vectors against FlashInfer's" in md
    assert "| fa3 | 0.9999 | 0.9998 | 0.999 | 0.98 | - | - | yes |" in md  # a report of before the corpus


def test_vllm_table_compares_the_best_side_of_each_server() -> None:
    sides = ["embedserve", "embedserve x2", "vllm", "vllm tuned"]
    rows = [row("short", "embedserve", 60_000, 100, prefix_cache_hit_rate=0.0),
            row("short", "embedserve x2", 66_000, 90), row("short", "vllm", 30_000, 200),
            row("short", "vllm tuned", 44_000, 180, prefix_cache_hit_rate=0.02),
            row("one in flight", "embedserve", 900, 12.0), row("one in flight", "embedserve", 1_100, 10.0),
            row("one in flight", "vllm tuned", 800, 15.0)]
    short, one = results_md.multi_side(rows, sides)
    # the defaults against the best vLLM side: 60k / 44k, 180 ms / 100 ms; a variant's 66k only in best_ratio
    assert short["ratio"] == 1.364 and short["best_ratio"] == 1.5 and short["p50_ratio"] == 1.8
    assert short["vllm tuned|hits"] == 0.02 and short["embedserve|runs"] == 1
    assert one["embedserve|p50_ms"] == 11.0 and one["vllm|tok_s"] is None and one["p50_ratio"] == 1.364


def test_vllm_section_shows_how_each_side_ran_and_what_did_not() -> None:
    argv = ["python3", "-m", "vllm.entrypoints.cli.main", "serve", "/m/0.6b", "--runner", "pooling"]
    st = {"vllm-ready-0.6b": {"shape": "0.6b", "argv": {"embedserve": ["embedserve", "up"], "vllm": argv},
                              "ready_s": {"embedserve": 80.5, "vllm": 95.0},
                              "vllm_facts": {"vllm": {"attention_backend": "FLASH_ATTN",
                                                      "cudagraph_mode": "PIECEWISE"}},
                              "not_run": {"embedserve graphs": "embedserve-graphs-0.6b exited"},
                              "gpu_gb_idle": {"embedserve-0.6b": 5.5, "vllm-0.6b": 7.25}},
          "vllm-vectors-0.6b": {"texts": 2, "errors": {}, "pairs": [
              {"pair": "vllm vs sglang", "cosines": [0.9999, 0.9991], "min": 0.9991,
               "tokens_a": [3, 40], "tokens_b": [3, 40]}]},
          "vllm-load-0.6b-1": {"rows": [row("short", "embedserve", 60_000, 100, name="a"),
                                        row("short", "vllm", 40_000, 150, name="b")]},
          "vllm-load-0.6b-2": {"rows": [], "crosscheck_rows": [row("short", "vllm", 41_000, 150)],
                               "gpu_gb_after": {"vllm-0.6b": 7.5}}}
    md = "\n".join(results_md.vllm_sections(st))
    assert "## vLLM 0.26.0 (pooling runner) vs embedserve, 0.6b, same texts" in md
    assert "attention backend FLASH_ATTN, CUDA graphs PIECEWISE" in md and "ready after 95 s" in md
    assert "- embedserve graphs not run: embedserve-graphs-0.6b exited" in md
    assert "| short | 60,000 | 40,000 | 1.5 | 1.5 | 100 | 150 | 1.5 |" in md
    assert "| vllm vs sglang | 0.9991 | 0.9999, 0.9991 | yes |" in md
    assert "idle embedserve-0.6b 5.5 GB, vllm-0.6b 7.25 GB; after the runs vllm-0.6b 7.5 GB" in md
    assert "| short | vllm | 40,000 | 41,000 | 0.025 | 0 | yes |" in md


def test_the_crosscheck_client_is_given_the_same_length_mix_or_refuses() -> None:
    assert loadgen.crosscheck_lengths("seed") == "0.92:8-512,0.06:513-1024,0.02:1025-32768"
    assert loadgen.crosscheck_lengths("uniform:16-512") == "1:16-512"
    assert loadgen.crosscheck_lengths("fixed:300") == "1:300-300"
    assert loadgen.crosscheck_lengths("buckets:3:8-64,1:65-128") == "3:8-64,1:65-128"
    with pytest.raises(ValueError, match="cannot send"):
        loadgen.crosscheck_lengths("file:/tmp/texts.jsonl")


def test_the_crosscheck_client_draws_weighted_lengths_clamped_to_the_cap() -> None:
    import argparse
    import random

    import crosscheck

    a = argparse.Namespace(ids="0.9:8-512,0.1:9000-10000", text=None, cap=8192, vocab=50_000,
                           lengths=crosscheck.length_buckets("0.9:8-512,0.1:9000-10000"))
    rng = random.Random(3)
    lengths = [len(crosscheck.make_input(a, rng, [])) for _ in range(4000)]
    long = [n for n in lengths if n > 512]
    assert max(lengths) == 8192 and set(long) == {8192}  # clamped, as loadtest's --max-tokens
    assert 0.07 < len(long) / len(lengths) < 0.13
    assert min(lengths) >= 8


def test_small_model_sections_put_each_stack_beside_the_first() -> None:
    rows = [row("short", "x2", 200_000, 60, round=0, stack_gpu_gb=11.6),
            row("short", "x2, uvloop", 220_000, 55, round=0),
            row("short", "x2", 240_000, 62, round=1), row("short", "x2, uvloop", 180_000, 70, round=1)]
    table = results_md.per_side(rows, ["x2", "x2, uvloop"])
    assert [r["tok_s"] for r in table] == [220_000, 200_000]
    assert table[1]["vs_first"] == pytest.approx(0.909, abs=1e-3)
    assert table[0]["rounds"] == "200,000 / 240,000" and table[0]["stack_gpu_gb"] == 11.6
    md = results_md.render({"steps": {"small-gateway-1": {"ok": True, "rows": rows}}})
    assert "the gateway's settings side by side" in md and "| short | x2, uvloop | 200,000 |" in md


def test_the_small_model_scenario_builds_the_0_6b_only() -> None:
    steps = suite.plan(("small-model",))
    assert [s.name for s in steps][:3] == ["models", "small-start", "small-profile"]
    assert steps[-2].name == "small-stop" and steps[-1].name == "finish"
    assert steps[0].run.keywords["shapes"] == ("0.6b",)  # type: ignore[attr-defined]
    assert suite.plan(("small-model", "fp8"))[0].run.keywords["shapes"] == ("4b", "0.6b")  # type: ignore[attr-defined]


def test_the_gpu_busy_share_is_taken_over_the_measured_window_only() -> None:
    import overlap

    sampler = overlap.BusySampler()
    # the load generator's start-up (idle GPU), then 6 s of load
    sampler.samples = [(t * 0.5, 0) for t in range(16)] + [(8 + t * 0.5, 90) for t in range(13)]
    assert sampler.median_last(6) == 90
    assert sampler.median_last(60) == 0  # over the whole run, as before: diluted
    assert overlap.BusySampler().median_last(6) is None
