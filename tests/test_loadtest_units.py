"""Fast unit tests of the load generator: mixes, text building, statistics, verdict."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("aiohttp", reason="loadtest needs aiohttp (the loadtest extra)")

from embedserve.config import BUNDLED_MODEL, resolve_model_path
from embedserve.contracts.memory import MemoryReport
from embedserve.loadtest.args import embeddings_url, parse_seconds, same_origin_url
from embedserve.loadtest.fake_target import fake_report
from embedserve.loadtest.memseries import SOURCES, series
from embedserve.loadtest.mixes import BucketMix, FileMix, parse_count, parse_mix
from embedserve.loadtest.records import Recorder
from embedserve.loadtest.runner import retry_after_s
from embedserve.loadtest.stats import aggregate, auto_window, columns, percentiles, window_edges, windows
from embedserve.loadtest.textbuild import TextBuilder, WordBuilder, load_tokenizer
from embedserve.loadtest.traffic import (
    Planned,
    Prefetcher,
    ProcessPrefetcher,
    RequestFactory,
    auto_build_workers,
    poisson_arrivals,
    prefetcher,
)
from embedserve.loadtest.verdict import (
    MIB,
    Targets,
    evaluate,
    growth,
    growth_caveats,
    p95_drift,
    verdict_label,
)
from embedserve.runtime.synth_model import EOS, build_tokenizer


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer()


@pytest.fixture(scope="module")
def builder(tok: Any) -> TextBuilder:
    return TextBuilder(tok, seed=3)


def test_seed_mix_proportions() -> None:
    mix = parse_mix("seed")
    assert isinstance(mix, BucketMix)
    rng = random.Random(1)
    n = np.array([mix.sample(rng) for _ in range(40_000)])
    assert n.min() >= 8 and n.max() <= 32768
    assert abs((n <= 512).mean() - 0.92) < 0.01
    assert abs(((n > 512) & (n <= 1024)).mean() - 0.06) < 0.006
    assert abs((n > 1024).mean() - 0.02) < 0.004


def test_other_mixes(tmp_path: Path) -> None:
    rng = random.Random(0)
    u = parse_mix("uniform:100-200")
    assert isinstance(u, BucketMix)
    vals = {u.sample(rng) for _ in range(2000)}
    assert min(vals) == 100 and max(vals) == 200
    f = parse_mix("fixed:77")
    assert isinstance(f, BucketMix) and f.sample(rng) == 77
    assert f.sample(rng, cap=50) == 50
    b = parse_mix("buckets:1:1-10,3:11-20")
    assert isinstance(b, BucketMix)
    hi = np.mean([b.sample(rng) > 10 for _ in range(4000)])
    assert abs(hi - 0.75) < 0.03
    (tmp_path / "t.txt").write_text("first text\n\nsecond\\nline\n")
    fm = parse_mix(f"file:{tmp_path / 't.txt'}")
    assert isinstance(fm, FileMix) and fm.texts == ("first text", "second\nline")
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "a b"}) + "\n")
    assert parse_mix(f"file:{tmp_path / 't.jsonl'}").texts == ("a b",)  # type: ignore[union-attr]
    for bad in ("nope", "uniform:5-1", "uniform:0-3", "buckets:0:1-2"):
        with pytest.raises(ValueError):
            parse_mix(bad)
    assert parse_count("3") == (3, 3) and parse_count("1-8") == (1, 8)


def test_text_builder_hits_exact_token_counts(tok: Any, builder: TextBuilder) -> None:
    rng = random.Random(7)
    lengths = [*range(2, 120), 255, 256, 511, 512, 513, 1000, 1024, 4097, 9000, 32768]
    lengths += [rng.randint(2, 2000) for _ in range(150)]
    for n in lengths:
        text, counted = builder.build(n, rng)
        assert counted == n, n
        assert len(tok.encode(text).ids) == n, n  # independent count
    assert builder.min_len == 2  # the trailing EOS plus one token


def test_token_ids_end_with_eos_and_cap_keeps_it(tok: Any, builder: TextBuilder) -> None:
    eos = tok.token_to_id(EOS)
    rng = random.Random(2)
    for n in (2, 10, 300, 2048):
        ids = builder.ids(n, rng)
        assert len(ids) == n and ids[-1] == eos
    long_text = builder.text(500, rng)
    capped = builder.encode(long_text, cap=64)
    assert len(capped) == 64 and capped[-1] == eos


def test_token_ids_are_cut_from_the_corpus_inside_the_models_template(builder: TextBuilder) -> None:
    """Ids come without tokenising per request: a unique marker of plain vocabulary tokens,
    then a slice of the encoded corpus, wrapped in the template's special tokens
    ([CLS] ... [SEP] for BERT, ... EOS for Qwen3)."""
    bert = load_tokenizer(resolve_model_path(BUNDLED_MODEL))
    cls, sep = bert.token_to_id("[CLS]"), bert.token_to_id("[SEP]")
    cases = [(builder, [], [builder.tok.token_to_id(EOS)]), (TextBuilder(bert, 1), [cls], [sep])]
    for b, head, tail in cases:
        corpus = b.tok.encode(b._corpus, add_special_tokens=False).ids
        special = set(b.tok.get_added_tokens_decoder())
        rng = random.Random(5)
        for n in (b.min_len, 17, 300, 5000):
            ids = b.ids(n, rng, serial=n)
            inner = ids[len(head):len(ids) - len(tail)]
            assert len(ids) == n and ids[:len(head)] == head and ids[len(ids) - len(tail):] == tail
            marker, body = inner[:b.marker_len], inner[b.marker_len:]
            assert marker and not special & set(marker)
            starts = [i for i in range(len(corpus)) if corpus[i:i + len(body)] == body]
            assert starts, n


def test_texts_differ_and_are_repeatable(builder: TextBuilder) -> None:
    a = [builder.text(50, random.Random(s)) for s in range(5)]
    assert len(set(a)) == 5
    assert builder.text(50, random.Random(3)) == a[3]


def test_factory_is_deterministic_and_counts(builder: TextBuilder) -> None:
    def bodies(seed: int, kind: str) -> list[tuple[bytes, int, int]]:
        f = RequestFactory(parse_mix("seed"), builder, kind, (1, 4), "m", seed, 2048)  # type: ignore[arg-type]
        return [(p.body, p.tokens, p.n_inputs) for p in (f.make() for _ in range(40))]

    assert bodies(5, "text") == bodies(5, "text")
    assert bodies(5, "text") != bodies(6, "text")
    for body, tokens, n_inputs in bodies(5, "ids"):
        doc = json.loads(body)
        assert doc["model"] == "m" and len(doc["input"]) == n_inputs
        assert sum(len(x) for x in doc["input"]) == tokens
        assert max(len(x) for x in doc["input"]) <= 2048


def test_build_processes_send_the_same_requests_as_chunks_built_in_process(tok: Any) -> None:
    """Requests come out in order and the same whichever process built them, and the
    factory's counters add up what was taken."""
    def factory() -> RequestFactory:
        return RequestFactory(parse_mix("seed"), TextBuilder(tok, seed=3), "text", (1, 3), "m", 9,
                              2048)

    local = factory().for_chunks()
    expected = [p for c in range(5) for p in local.make_chunk(c)[0]]

    async def taken(workers: int) -> tuple[list[Planned], RequestFactory]:
        f = factory()
        source = prefetcher(f, workers)
        assert isinstance(source, ProcessPrefetcher)
        try:
            await source.prime()
            return [await source.get() for _ in range(len(expected))], f
        finally:
            source.close()

    got, f = asyncio.run(taken(2))
    assert [p.body for p in got] == [p.body for p in expected]
    assert [p.index for p in got] == list(range(len(expected)))
    assert f.stats.inputs == sum(p.n_inputs for p in expected)
    assert f.stats.tokens == sum(p.tokens for p in expected)
    bodies = [x for p in got for x in json.loads(p.body)["input"]]
    assert len(set(bodies)) == len(bodies)  # serials do not repeat across chunks


def test_priming_waits_for_the_requests_sent_at_once_not_for_every_task_ahead() -> None:
    """A closed loop of 3 in flight starts once 3 requests are built: the 4th onwards are built
    during the warm-up (here they never finish until released)."""
    release, made = threading.Event(), list[int]()

    def make() -> Planned:
        if len(made) >= 3:
            release.wait(10)
        made.append(len(made))
        return Planned(len(made) - 1, b"{}", 1, 1)

    async def primed(first: int | None) -> bool:
        source = Prefetcher(make, depth=8)
        try:
            await asyncio.wait_for(source.prime(first), 1.0)
            return True
        except TimeoutError:
            return False
        finally:
            release.set()
            source.close()

    assert asyncio.run(primed(3)) and made[:3] == [0, 1, 2]
    made.clear()
    release.clear()
    assert not asyncio.run(primed(None))  # every task ahead: waits for the blocked 4th


def test_requests_that_depend_on_earlier_ones_are_built_on_one_thread(tok: Any) -> None:
    repeats = RequestFactory(parse_mix("seed"), WordBuilder(), repeat_rate=0.2)
    assert not repeats.chunkable
    assert isinstance(prefetcher(repeats, 4), Prefetcher)
    assert isinstance(prefetcher(RequestFactory(parse_mix("seed"), WordBuilder()), 0), Prefetcher)


@pytest.mark.parametrize("cores,workers", [(1, 0), (2, 0), (4, 0), (8, 2), (16, 4), (128, 4)])
def test_build_processes_by_default_only_where_cores_are_spare(cores: int, workers: int) -> None:
    assert auto_build_workers(cores) == workers


def test_ids_need_a_tokenizer() -> None:
    with pytest.raises(ValueError):
        RequestFactory(parse_mix("seed"), WordBuilder(), "ids")


def test_poisson_rate() -> None:
    it = poisson_arrivals(50.0, seed=1)
    ts = [next(it) for _ in range(20_000)]
    assert abs(len(ts) / ts[-1] - 50.0) < 1.5
    assert ts == sorted(ts)


def test_percentiles_and_windows() -> None:
    p = percentiles(np.arange(1, 101) / 1000.0)  # 1..100 ms
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01)
    assert p["max"] == 100.0
    assert percentiles([])["p95"] is None
    assert window_edges(0, 10, 5) == [(0, 5), (5, 10)]
    assert window_edges(0, 11, 5) == [(0, 5), (5, 11)]  # short tail folded in
    assert window_edges(0, 13, 5) == [(0, 5), (5, 10), (10, 13)]
    assert auto_window(60) == 5 and auto_window(7200) == 600

    rec = Recorder()
    for i in range(100):  # 10 per second for 10 s; first second is warm-up
        t = i / 10.0
        code = 200 if i % 10 else (503 if i % 20 else 429)
        rec.add(t, 0.010 if t < 5 else 0.020, code, 100, 100 if code == 200 else -1, 2, t < 1)
    c = columns(rec)
    m = aggregate(c, ~c["warm"], 9.0)
    assert m["attempts"] == 90 and m["ok"] == 81 and m["errors"] == 5 and m["throttled_429"] == 4
    assert m["tokens_sent"] == 9000 and m["tokens_ok"] == 8100
    assert m["usage_prompt_tokens"] == 8100 and m["inputs_ok"] == 162
    assert m["requests_per_s"] == pytest.approx(9.0)
    assert m["by_status"] == {"200": 81, "429": 4, "503": 5}
    ws = windows(c, 1.0, 10.0, 4.0)
    assert [(w["t_start"], w["t_end"]) for w in ws] == [(1, 5), (5, 10)]
    assert ws[0]["latency_ms"]["p95"] == pytest.approx(10.0)
    assert ws[1]["latency_ms"]["p95"] == pytest.approx(20.0)
    assert p95_drift(ws) == {"first_p95_ms": 10.0, "last_p95_ms": 20.0, "drift": 1.0}


def test_growth_ignores_warmup_and_jitter() -> None:
    ts = [float(t) for t in range(0, 1000, 10)]
    flat = [2e9 + (1e6 if i % 2 else -1e6) for i in range(len(ts))]
    g = growth(ts, flat, 100.0)
    assert g is not None and abs(g["growth_mib"]) < 2.5
    leak = [1e9 + 1e6 * t for t in ts]  # ~0.95 MiB/s
    warm_spike = [5e9 if t < 100 else v for t, v in zip(ts, leak, strict=True)]
    g2 = growth(ts, warm_spike, 100.0)
    assert g2 is not None and 700 < g2["growth_mib"] < 900
    assert growth(ts[:1], leak[:1], 0.0) is None


def test_a_per_hour_slope_needs_half_an_hour_after_a_warm_up_of_five_minutes() -> None:
    """60 s of samples from the first request (a server still warming up) scaled to an hour
    made a one-off step of 60 MiB 3,600 MiB/h; now there is no per-hour figure, and a caveat
    says why."""
    ts = [float(t) for t in range(0, 61, 5)]
    step = [1e9 if t < 30 else 1e9 + 60 * MIB for t in ts]
    g = growth(ts, step, 0.0)
    assert g is not None and g["growth_mib"] == 60.0 and g["growth_mib_per_hour"] is None
    assert "60 s of samples after the warm-up, under the 30 min a slope needs" in g["caveat"]
    assert "starts 0 s into the load" in g["caveat"] and "--warmup 5m" in g["caveat"]
    long = [float(t) for t in range(300, 300 + 1801, 60)]
    g = growth(long, [1e9 if t < 1200 else 1e9 + 60 * MIB for t in long], 300.0)
    assert g is not None and g["growth_mib_per_hour"] == 120.0 and g["caveat"] is None
    assert growth_caveats({"a": g, "b": None}) == []


def _measured(errors: int = 0, attempts: int = 100, p95: float = 10.0) -> dict[str, Any]:
    return {"attempts": attempts, "errors": errors, "throttled_429": 0,
            "error_rate": errors / attempts if attempts else 0.0, "requests_per_s": 5.0,
            "latency_ms": {"p95": p95}}


def _win(t: float, p95: float | None) -> dict[str, Any]:
    return {"t_start": t, "latency_ms": {"p95": p95}}


def test_verdict() -> None:
    t = Targets(max_error_rate=0.01, max_p95_drift=0.2, max_memory_growth_mib=100)
    wins = [_win(0, 10.0), _win(5, None), _win(10, 11.0)]
    mem = {"host": {"growth_mib": 20.0, "first_mib": 1.0, "last_mib": 21.0, "span_s": 9.0,
                    "growth_mib_per_hour": 1.0}}
    v = evaluate(t, _measured(errors=1), wins, mem)
    assert v["passed"] and [c["status"] for c in v["checks"]] == ["pass"] * 3
    v = evaluate(t, _measured(errors=2), [_win(0, 10.0), _win(5, 12.5)], mem)
    assert not v["passed"] and v["failed"] == ["error rate", "P95 drift"]
    mem["host"]["growth_mib"] = 150.0
    v = evaluate(t, _measured(), wins, mem)
    assert v["failed"] == ["memory growth MiB: host"]
    v = evaluate(t, _measured(), [_win(0, 10.0)], {})
    assert v["passed"] and v["no_data"] == ["P95 drift", "memory growth MiB"]
    assert not evaluate(Targets(), _measured(attempts=0), [], {})["passed"]
    assert verdict_label(evaluate(t, _measured(), [], {})) == "PASS"
    assert verdict_label(evaluate(Targets(), _measured(), [], {})) == "no targets"
    v = evaluate(Targets(max_p95_ms=100), _measured(errors=9), [], {})  # errors fail any run
    assert verdict_label(v) == "FAIL" and v["failed"] == ["error rate"]


def test_urls_and_parsing() -> None:
    assert embeddings_url("http://h:1") == "http://h:1/v1/embeddings"
    assert embeddings_url("http://h:1/v1/") == "http://h:1/v1/embeddings"
    assert embeddings_url("http://h:1/v1/embeddings") == "http://h:1/v1/embeddings"
    with pytest.raises(ValueError):
        embeddings_url("ftp://h/x")
    t = "http://h:1/v1/embeddings"
    assert same_origin_url(t, "/health/memory") == "http://h:1/health/memory"
    assert same_origin_url(t, "http://h:1/x") == "http://h:1/x"
    with pytest.raises(ValueError):
        same_origin_url(t, "http://other:1/health/memory")
    assert parse_seconds("90") == 90 and parse_seconds("5m") == 300
    assert parse_seconds("2h") == 7200
    assert retry_after_s("3") == 3.0 and retry_after_s(None) == 1.0
    assert retry_after_s("garbage") == 1.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past


def test_memory_series_from_the_report() -> None:
    report = fake_report(8 << 20)
    values = series(MemoryReport.model_validate_json(report.model_dump_json()))
    assert values["host_bytes"] == 8 << 20 and values["host_limit_bytes"] == 8 << 30
    assert values["engine_rss_bytes"] == 4 << 20 and values["gateway_rss_bytes"] is None
    assert values["hours_to_oom"] == 100.0 and values["hours_low"] == 80.0
    assert values["recommends_restart"] == 0.0
    assert values["gpu_bytes"] is None  # no GPU in the report: no guess
    assert set(values) == set(SOURCES)


def test_memory_series_filter() -> None:
    g = {"growth_mib": 500.0, "first_mib": 1.0, "last_mib": 501.0, "span_s": 9.0,
         "growth_mib_per_hour": 1.0}
    small = {**g, "growth_mib": 1.0}
    mem = {"target host": g, "target engine RSS": small}
    t = Targets(max_memory_growth_mib=100)
    assert evaluate(t, _measured(), [], mem)["failed"] == ["memory growth MiB: target host"]
    t = Targets(max_memory_growth_mib=100, memory_series="engine|gateway")
    v = evaluate(t, _measured(), [], mem)
    assert v["passed"] and [c["check"] for c in v["checks"]] == [
        "error rate", "memory growth MiB: target engine RSS"]


def test_a_shared_prefix_counts_in_the_exact_length(tok: Any) -> None:
    """Inputs of the shared-prefix scenario start with the prefix and keep their asked
    length, special tokens and prefix included; texts measured by the tokenizer itself."""
    bert = load_tokenizer(resolve_model_path(BUNDLED_MODEL))
    query = "Instruct: Given a web search query, retrieve relevant passages\nQuery:"
    rng = random.Random(4)
    for t in (tok, bert):
        b = TextBuilder(t, seed=2, prefix=query)
        p = b.prefix_ids
        assert b._wrap is not None
        lead = b._wrap[0]  # [CLS] for BERT, nothing for Qwen3
        for n in (b.min_len, b.min_len + 1, 40, 300, 1000):
            text, counted = b.build(n, rng, serial=n)
            assert text.startswith(query + " ") and counted == len(t.encode(text).ids) == n
            ids = b.ids(n, rng, serial=n)
            assert len(ids) == n and ids[len(lead):len(lead) + len(p)] == p
        assert b.min_len == b.n_special + len(p) + 1
