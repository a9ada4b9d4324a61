"""Every run's report states the target's prefix cache hit rate; repeated content is a
labelled scenario of its own; a run of unique inputs whose target served more than 1% from
its cache is flagged. Against the fake target, which simulates a prefix cache and exposes
SGLang's counters."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp", reason="loadtest needs aiohttp (the loadtest extra)")

from embedserve.loadtest import cachehits
from embedserve.loadtest.cli import main
from embedserve.loadtest.fake_target import FakeConfig, FakeServer, PrefixCache
from embedserve.loadtest.textbuild import TextBuilder, load_tokenizer
from tests.test_loadtest_prefix_cache import old_cut_ids


def _run(args: list[str], out: Path) -> tuple[int, dict[str, Any], str]:
    rc = main([*args, "--out", str(out), "--no-progress", "--no-plots", "--health-url", "none"])
    return rc, json.loads((out / "results.json").read_text()), (out / "summary.md").read_text()


SGLANG_PAGE = """# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="q",is_streaming="false"} 1000.0
sglang:prompt_tokens_total{model_name="q",is_streaming="true"} 500.0
sglang:prompt_tokens_created{model_name="q",is_streaming="false"} 1.7e9
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{model_name="q",cache_source="device"} 40.0
sglang:cached_tokens_total{model_name="q",cache_source="host"} 20.0
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="q"} 3.0
"""


def test_counters_sum_label_sets_and_the_rate_is_a_delta() -> None:
    c = cachehits.counters(SGLANG_PAGE)
    assert c == {"sglang:prompt_tokens_total": 1500.0, "sglang:cached_tokens_total": 60.0}
    before = cachehits.Scrape(c, {})
    after = cachehits.Scrape({"sglang:prompt_tokens_total": 11_500.0,
                              "sglang:cached_tokens_total": 260.0}, {})
    pc = cachehits.hit_rate(before, after, ["u"], repeated_content=False)
    assert pc["status"] == "measured" and pc["hit_rate"] == pytest.approx(0.02)
    assert pc["cached_tokens"] == 200 and pc["prompt_tokens"] == 10_000 and pc["flagged"]
    assert not cachehits.hit_rate(before, after, ["u"], repeated_content=True)["flagged"]
    low = cachehits.Scrape({**after.values, "sglang:cached_tokens_total": 160.0}, {})
    assert not cachehits.hit_rate(before, low, ["u"], False)["flagged"]  # exactly 1%: fine
    reset = cachehits.Scrape({"sglang:prompt_tokens_total": 10.0}, {})
    assert cachehits.hit_rate(before, reset, ["u"], False)["status"].startswith("unreadable")
    empty = cachehits.Scrape({}, {"u": "HTTP 404"})
    assert cachehits.hit_rate(empty, empty, ["u"], False)["status"] == "not exposed"
    assert cachehits.hit_rate(None, None, [], False)["status"].startswith("not read")


def test_the_fake_targets_cache_hits_repeats_and_forgets() -> None:
    cache = PrefixCache(8)
    assert cache.serve([1, 2, 3, 4]) == 0
    assert cache.serve([1, 2, 3, 5]) == 3
    assert cache.serve([9, 9, 9, 9, 9]) == 0  # 10 keys > 8: the oldest tails go first
    assert cache.serve([1, 2, 7]) == 2  # the shared [1, 2] was touched last, so it stayed


def test_unique_inputs_hit_next_to_nothing_and_metrics_urls_add_up(tok_dir: Path,
                                                                    tmp_path: Path) -> None:
    with FakeServer(FakeConfig(), load_tokenizer(tok_dir)) as srv, FakeServer() as other:
        rc, res, md = _run([srv.url, "--tokenizer", str(tok_dir), "--input", "ids",
                            "--concurrency", "4", "--requests", "300", "--inputs", "1-4",
                            "--mix", "uniform:16-512", "--metrics-url", "/metrics",
                            "--metrics-url", f"{other.url}/metrics"], tmp_path)
        seen = srv.counters
    pc = res["prefix_cache"]
    assert rc == 0 and pc["status"] == "measured"
    assert pc["prompt_tokens"] == seen.prompt_tokens == res["totals"]["tokens_sent"]
    assert pc["cached_tokens"] == seen.cached_tokens and pc["hit_rate"] <= 0.01
    assert not pc["flagged"] and len(pc["urls"]) == 2
    assert res["meta"]["content"]["scenario"] == "unique inputs"
    assert "Target prefix cache hits: " in md and "WARNING" not in md


def test_build_processes_send_unique_texts_of_the_counted_lengths(tok_dir: Path,
                                                                  tmp_path: Path) -> None:
    """Texts built in other processes: the server counts the tokens the client counted,
    its cache serves next to nothing, and the report says how they were built."""
    with FakeServer(FakeConfig(), load_tokenizer(tok_dir)) as srv:
        rc, res, _ = _run([srv.url, "--tokenizer", str(tok_dir), "--build-workers", "2",
                           "--concurrency", "8", "--requests", "200", "--inputs", "1-3",
                           "--mix", "uniform:16-256"], tmp_path)
        seen = srv.counters
    assert rc == 0 and res["meta"]["build_workers"] == 2
    assert res["prefix_cache"]["prompt_tokens"] == seen.prompt_tokens == res["totals"]["tokens_sent"]
    assert res["prefix_cache"]["hit_rate"] <= 0.01


def test_repeated_content_is_labelled_and_its_cache_benefit_reported_apart(
        tok_dir: Path, tmp_path: Path) -> None:
    with FakeServer(FakeConfig(), load_tokenizer(tok_dir)) as srv:
        rc, res, md = _run([srv.url, "--tokenizer", str(tok_dir), "--concurrency", "4",
                            "--requests", "300", "--mix", "uniform:16-128", "--repeat-rate",
                            "0.4", "--query-prefix"], tmp_path)
    content, pc = res["meta"]["content"], res["prefix_cache"]
    assert rc == 0 and content["scenario"] == "repeated content"
    assert 0.25 < content["repeated_input_fraction"] < 0.55
    assert content["shared_prefix"]["tokens"] > 5 and content["shared_prefix_token_fraction"] > 0
    assert pc["status"] == "measured" and pc["hit_rate"] > 0.2  # the repeats and the prefix
    assert not pc["flagged"] and pc["repeated_content"]
    assert "**Repeated content (a scenario of its own)**" in md
    assert "Cache benefit of the repeated content: prefix cache hits:" in md
    assert "WARNING" not in md


def test_a_unique_run_served_from_the_cache_is_flagged(tok_dir: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Inputs cut as they were before markers (corpus slices whose starts repeat): the
    target's cache serves a large share and the report warns, in both files."""

    def old_ids(self: TextBuilder, n: int, rng: random.Random, serial: int | None = None
                ) -> list[int]:
        return old_cut_ids(self, n, rng)

    monkeypatch.setattr(TextBuilder, "ids", old_ids)
    with FakeServer(FakeConfig()) as srv:
        rc, res, md = _run([srv.url, "--tokenizer", str(tok_dir), "--input", "ids",
                            "--concurrency", "4", "--requests", "400",
                            "--mix", "uniform:16-512"], tmp_path)
    pc = res["prefix_cache"]
    assert rc == 0 and pc["hit_rate"] > 0.1 and pc["flagged"]
    assert res["meta"]["content"]["scenario"] == "unique inputs"
    assert "> **WARNING: the target served" in md


def test_a_target_without_counters_says_not_exposed(tmp_path: Path) -> None:
    with FakeServer(FakeConfig(metrics=False)) as srv:
        rc, res, md = _run([srv.url, "--requests", "5", "--mix", "fixed:5"], tmp_path)
    assert rc == 0 and res["prefix_cache"]["status"] == "not exposed"
    assert not res["prefix_cache"]["flagged"]
    assert "Target prefix cache hits: not exposed." in md


def test_a_file_mix_that_repeats_its_texts_is_labelled(tmp_path: Path) -> None:
    texts = tmp_path / "texts.txt"
    texts.write_text("first real text\nsecond real text\nthird one\n")
    with FakeServer() as srv:
        _, res, _ = _run([srv.url, "--requests", "30", "--mix", f"file:{texts}"], tmp_path / "o")
    content = res["meta"]["content"]
    assert content["scenario"] == "repeated content" and "recur" in content["detail"]
    assert content["repeated_inputs"] >= 27  # 30 inputs sent (and more built ahead) of 3 texts


@pytest.mark.parametrize("args,message", [
    (["--repeat-rate", "1.5"], "--repeat-rate must be within 0-1"),
    (["--repeat-rate", "-0.1"], "--repeat-rate must be within 0-1"),
    (["--repeat-rate", "nan"], "--repeat-rate must be within 0-1"),
    (["--repeat-rate", "lots"], "invalid float value"),
    (["--mix", "zipf:1-2"], "unknown mix"),
    (["--requests", "-5"], "--requests must be >= 1"),
    (["--warmup-requests", "-1"], "--warmup-requests must be >= 0"),
    (["--build-workers", "-1"], "--build-workers must be >= 0"),
    (["--inputs", "-1"], "bad --inputs"),
    (["--duration", "-3"], "--duration must be > 0"),
    (["--shared-prefix", "preset:nope"], "unknown --shared-prefix preset"),
    (["--shared-prefix", "ids:1,x"], "wants token ids"),
    (["--shared-prefix", "ids:1,2"], "needs --input ids"),
    (["--query-prefix", "--shared-prefix", "Query:"], "give one of them"),
    (["--metrics-url", "ftp://x/metrics"], "--metrics-url must be an http(s) URL"),
    (["--query-prefix", "--max-tokens", "8"], "--max-tokens 8 leaves no room"),
])
def test_bad_input_exits_2_with_a_reason_and_sends_nothing(
        args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with FakeServer() as srv:
        rc = main([srv.url, "--requests", "3", "--no-progress", "--out", str(tmp_path), *args])
        sent = srv.counters.requests
    assert rc == 2 and sent == 0
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()
