"""The load generator against a fake OpenAI-compatible server that counts what it saw:
the report's request and token counts must equal the server's."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp", reason="loadtest needs aiohttp (the loadtest extra)")

from embedserve.loadtest.cli import main
from embedserve.loadtest.fake_target import FakeConfig, FakeServer
from embedserve.loadtest.plots import token_line
from embedserve.loadtest.report import fmt
from embedserve.loadtest.textbuild import load_tokenizer


def _run(args: list[str], out: Path) -> tuple[int, dict[str, Any]]:
    rc = main([*args, "--out", str(out), "--no-progress", "--sample-interval", "0.5"])
    return rc, json.loads((out / "results.json").read_text())


def test_closed_loop_text_counts_match_server(tok_dir: Path, tmp_path: Path) -> None:
    with FakeServer(FakeConfig(), load_tokenizer(tok_dir)) as srv:
        rc, res = _run([srv.url, "--tokenizer", str(tok_dir), "--concurrency", "4",
                        "--requests", "150", "--warmup-requests", "20", "--inputs", "1-3",
                        "--mix", "seed", "--max-tokens", "2048", "--max-error-rate", "0",
                        "--max-memory-growth-mib", "100"], tmp_path)
        seen = srv.counters
    tot, meas = res["totals"], res["measured"]
    assert rc == 0 and res["verdict"]["passed"]
    assert tot["attempts"] == seen.requests == 170
    assert tot["tokens_sent"] == seen.tokens  # client's count == server's tokenizer
    assert tot["usage_prompt_tokens"] == seen.tokens_ok == seen.tokens
    assert tot["inputs_ok"] == seen.inputs
    assert meas["attempts"] == 150 and res["warmup"]["attempts"] == 20
    assert res["meta"]["model"] == "fake-embed"  # discovered from /v1/models
    assert res["memory"]["health_memory"]["status"] == "sampled"
    assert seen.health_calls >= 1
    assert res["memory"]["health_memory"]["samples"][0]["host_bytes"] == 1 << 30
    assert sum(w["attempts"] for w in res["windows"]) == 150
    for name in ("summary.md", "latency.png", "throughput.png", "memory.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "# Load test: PASS" in (tmp_path / "summary.md").read_text()


def test_open_loop_ids_with_errors_and_429(tok_dir: Path, tmp_path: Path) -> None:
    cfg = FakeConfig(fail_every=7, throttle_every=11, retry_after_s=0.05)
    with FakeServer(cfg) as srv:
        rc, res = _run([f"{srv.url}/v1/embeddings", "--tokenizer", str(tok_dir),
                        "--input", "ids", "--rate", "60", "--duration", "3", "--warmup", "0.5",
                        "--mix", "uniform:16-300", "--inputs", "2", "--seed", "9",
                        "--max-error-rate", "0.01", "--no-plots"], tmp_path)
        seen = srv.counters
    tot = res["totals"]
    assert tot["attempts"] == seen.requests > 100
    assert tot["tokens_sent"] == seen.tokens
    assert tot["by_status"].get("503", 0) == seen.failed_503 > 0
    assert tot["by_status"].get("429", 0) == seen.throttled_429 > 0
    assert tot["throttled_429"] == seen.throttled_429
    assert tot["ok"] == seen.ok and tot["usage_prompt_tokens"] == seen.tokens_ok
    assert rc == 1 and res["verdict"]["failed"] == ["error rate"]  # 503s: about 1 in 7
    assert res["meta"]["stop_reason"] == "duration reached"
    assert 2.5 <= res["measured"]["duration_s"] <= 3.5


def test_refused_connection_is_counted_not_fatal(tmp_path: Path) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    rc, res = _run([f"http://127.0.0.1:{port}", "--requests", "5", "--concurrency", "2",
                    "--max-error-rate", "0", "--model", "m", "--mix", "fixed:10"], tmp_path)
    assert rc == 1
    assert res["totals"]["by_status"] == {"connection_refused": 5}
    assert res["memory"]["health_memory"]["samples"] == []


def test_timeouts_are_counted_and_health_404_skipped(tmp_path: Path) -> None:
    cfg = FakeConfig(delay_s=1.0, health_memory=False)
    with FakeServer(cfg) as srv:
        rc, res = _run([srv.url, "--requests", "4", "--concurrency", "4", "--timeout", "0.2",
                        "--mix", "fixed:10"], tmp_path)
    assert rc == 1 and res["verdict"]["failed"] == ["error rate"]  # no targets, but errors
    assert res["totals"]["by_status"] == {"timeout": 4}
    assert res["memory"]["health_memory"]["status"].startswith("absent (HTTP 404)")
    assert "timeout" in res["error_samples"]


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    assert main(["ftp://x", "--out", str(tmp_path)]) == 2
    assert main(["http://127.0.0.1:1", "--health-url", "http://evil:80/h"]) == 2
    assert main(["http://127.0.0.1:1", "--input", "ids"]) == 2  # ids need a tokenizer


def test_redirects_are_not_followed(tmp_path: Path) -> None:
    with FakeServer() as other:
        cfg = FakeConfig(redirect_to=f"{other.url}/v1/embeddings")
        with FakeServer(cfg) as srv:
            _, res = _run([srv.url, "--requests", "3", "--concurrency", "1",
                           "--mix", "fixed:5", "--health-url", "none"], tmp_path)
        assert other.counters.requests == 0  # only the given target was ever contacted
    assert res["totals"]["by_status"] == {"307": 3}


def test_retry_after_pauses_sending(tmp_path: Path) -> None:
    import asyncio

    from embedserve.loadtest.mixes import parse_mix
    from embedserve.loadtest.runner import RunConfig, Runner
    from embedserve.loadtest.textbuild import WordBuilder
    from embedserve.loadtest.traffic import RequestFactory

    cfg = FakeConfig(throttle_every=3, retry_after_s=0.4)
    with FakeServer(cfg) as srv:
        factory = RequestFactory(parse_mix("fixed:5"), WordBuilder(), model="m")
        run_cfg = RunConfig(url=f"{srv.url}/v1/embeddings", concurrency=1, requests=6)
        out = asyncio.run(Runner(run_cfg).run(factory.make))
        seen = srv.counters.requests
    codes = list(out.rec.code)
    assert codes == [200, 200, 429, 200, 200, 429, 200, 200]  # each 429 resent once
    assert seen == len(codes)
    for i, code in enumerate(codes[:-1]):
        gap = out.rec.t[i + 1] - out.rec.t[i]
        assert gap >= (0.39 if code == 429 else 0.0)


def test_rescore_rejudges_a_finished_run(tmp_path: Path) -> None:
    from embedserve.loadtest.rescore import main as rescore

    with FakeServer() as srv:
        rc, _ = _run([srv.url, "--requests", "20", "--mix", "fixed:5", "--no-plots",
                      "--max-p95-ms", "0.001"], tmp_path)
    assert rc == 1
    assert rescore([str(tmp_path), "--no-plots", "--max-p95-ms", "60000"]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["verdict"]["passed"] and not res["verdict_history"][0]["passed"]
    assert "# Load test: PASS" in (tmp_path / "summary.md").read_text()
    assert rescore([str(tmp_path / "nowhere")]) == 2


def test_closed_loop_keeps_every_request_on_the_wire(tmp_path: Path) -> None:
    """Each request in flight gets its own connection: the target sees the whole concurrency
    (with a 256-connection pool, 512 "in flight" was 256 at the server plus a client queue)."""
    with FakeServer(FakeConfig(delay_s=1.0)) as srv:
        rc, _ = _run([srv.url, "--concurrency", "300", "--requests", "300",
                      "--max-error-rate", "0"], tmp_path)
        assert rc == 0 and srv.counters.peak_in_flight == 300
    assert main(["http://127.0.0.1:1", "--concurrency", "6", "--max-connections", "2",
                 "--out", str(tmp_path / "refused")]) == 2


def test_closed_loop_rate_excludes_the_drain(tok_dir: Path, tmp_path: Path) -> None:
    """The measured window ends when the loop stops sending: the answers still in flight are
    counted, but the second it takes them to come back is no time of the load (dividing by
    it understated slow requests' throughput by their latency over the run's length)."""
    with FakeServer(FakeConfig(delay_s=0.5, health_memory=False), load_tokenizer(tok_dir)) as srv:
        rc, res = _run([srv.url, "--tokenizer", str(tok_dir), "--concurrency", "4", "--duration", "2",
                        "--warmup", "0.5", "--mix", "fixed:32", "--health-url", "none"], tmp_path)
    meas = res["measured"]
    assert rc == 0
    # with the drain the window would be ~2.5 s; a busy machine moves the loop's stop by a few ms
    assert meas["duration_s"] == pytest.approx(2.0, abs=0.1)
    assert meas["requests_per_s"] == pytest.approx(meas["ok"] / meas["duration_s"], rel=0.01)


def test_inputs_longer_than_the_server_embeds_are_flagged(
    tok_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The headline is what the server embedded (its usage), not what was sent: with the seed
    mix (up to 32,768 tokens) against a 256-token model most tokens sent are cut off."""
    with FakeServer(FakeConfig(max_seq_len=256), load_tokenizer(tok_dir)) as srv:
        rc, res = _run([srv.url, "--tokenizer", str(tok_dir), "--concurrency", "4",
                        "--requests", "60", "--mix", "buckets:1:200-4000"], tmp_path)
    err = capsys.readouterr().err
    assert rc == 0
    assert "WARNING: the mix sends inputs of up to 4,000 tokens" in err and "--max-tokens 256" in err
    m = res["measured"]
    assert m["usage_prompt_tokens"] < m["tokens_ok"] / 2
    assert f"{m['embedded_tokens_per_s']:.0f} tokens/s embedded ({m['tokens_per_s']:.0f} sent;" in err
    assert "cut off by the server's truncation" in err
    assert res["meta"]["server_max_seq_len"] == 256
    summary = (tmp_path / "summary.md").read_text()
    assert "WARNING" in summary
    # the windows and throughput.png show what the server embedded; sent only where so labelled
    assert "| start s | req/s | tokens/s embedded | tokens/s sent |" in summary
    w = res["windows"][0]
    assert w["embedded_tokens_per_s"] < w["tokens_per_s"] / 2
    row = next(line for line in summary.splitlines() if line.startswith(f"| {w['t_start']:.0f} |"))
    assert row.split(" | ")[2:4] == [fmt(w["embedded_tokens_per_s"]), fmt(w["tokens_per_s"])]
    assert token_line(res["windows"]) == ("tokens/s embedded (server usage)",
                                          [x["embedded_tokens_per_s"] for x in res["windows"]])


def test_throughput_plot_says_sent_when_the_server_reports_no_usage() -> None:
    wins = [{"ok": 3, "usage_reported": 0, "embedded_tokens_per_s": 0.0, "tokens_per_s": 90.0}]
    assert token_line(wins) == ("tokens/s sent (the server reported no usage)", [90.0])


def test_gauges_are_read_from_the_targets_metrics(tmp_path: Path) -> None:
    """--gauge follows a gauge of the target's /metrics through the run (the autoscaling
    signal in a ramp): here the fake's count of requests answered, which only grows."""
    with FakeServer(FakeConfig(delay_s=0.02, health_memory=False)) as srv:
        rc, res = _run([srv.url, "--concurrency", "2", "--duration", "2", "--gauge", "fake_requests_seen",
                        "--gauge", "not_exported", "--no-plots"], tmp_path)
    assert rc == 0
    g = res["gauges"]
    values = [s["fake_requests_seen"] for s in g["samples"]]
    assert len(values) >= 3 and values == sorted(values) and values[-1] > values[0]
    assert all(s["not_exported"] is None for s in g["samples"])
    assert g["measured"]["fake_requests_seen"]["max"] > 0
    assert g["measured"]["not_exported"]["median"] is None
    assert "Gauge `fake_requests_seen`" in (tmp_path / "summary.md").read_text()


def test_a_memory_slope_on_a_short_span_is_left_out_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeServer() as srv:
        _, res = _run([srv.url, "--concurrency", "2", "--duration", "2", "--mix", "fixed:5",
                       "--no-plots"], tmp_path)
    g = res["memory"]["growth_after_warmup"]["target host"]
    assert g["growth_mib_per_hour"] is None and "under the 30 min a slope needs" in g["caveat"]
    warning = f"WARNING (memory growth): {g['caveat']}."
    assert warning in (tmp_path / "summary.md").read_text()
    assert f"WARNING: memory growth: {g['caveat']}" in capsys.readouterr().err


@pytest.mark.parametrize(("fake", "allow", "rc", "label"), [
    (FakeConfig(fail_every=11), [], 1, "FAIL"),  # 9% 503s
    (FakeConfig(fail_every=11), ["--max-error-rate", "0.1"], 0, "PASS"),
    (FakeConfig(throttle_every=5, retry_after_s=0.01), [], 0, "no targets"),  # 429s only
])
def test_without_targets_errors_fail_and_nothing_passes(
    fake: FakeConfig, allow: list[str], rc: int, label: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A run with no targets says "no targets", never PASS, and still fails on errors unless
    --max-error-rate allows their share; a 429 with Retry-After is throttling, not an error."""
    with FakeServer(fake) as srv:
        got, res = _run([srv.url, "--concurrency", "2", "--requests", "60", "--mix", "fixed:5",
                         "--no-plots", *allow], tmp_path)
        seen = srv.counters
    m = res["measured"]
    assert got == rc
    assert m["errors"] == seen.failed_503 and m["throttled_429"] == seen.throttled_429
    assert (m["errors"] > 0) == (fake.fail_every > 0)
    assert (m["throttled_429"] > 0) == (fake.throttle_every > 0)
    assert (tmp_path / "summary.md").read_text().startswith(f"# Load test: {label}\n")
    assert capsys.readouterr().err.startswith(f"{label}: ")
