"""``embedserve quality`` end to end: the client within a server's limits (batches, 429s,
too-large answers), the CLI against the CPU stack on a small corpus, and its exit statuses."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from embedserve.contracts.quality import Corpus, CorpusInfo, Passage, QualityReport, Query
from embedserve.loadtest.fake_target import FakeConfig, FakeServer
from embedserve.loadtest.quality import cli
from embedserve.loadtest.quality.client import Embedder, EndpointError, Limits, ServedModel, served_model
from embedserve.loadtest.quality.corpus import write_corpus
from tests.conftest import RunningStack, free_port

# -- the client, against a transport that answers as told ----------------------------------


def vector_of(text: str) -> list[float]:
    """A vector that says which text it belongs to: [number in the text, 1]."""
    return [float(text.split()[-1]), 1.0]


def b64(v: list[float]) -> str:
    return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()


class Server:
    """Answers /v1/embeddings as the rules say, and records each request's inputs."""

    def __init__(self, too_large_over: int | None = None, throttled: int = 0,
                 retry_after: str = "3", as_floats: bool = False) -> None:
        self.too_large_over, self.throttled, self.retry_after = too_large_over, throttled, retry_after
        self.as_floats = as_floats
        self.batches: list[list[str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "m", "max_seq_len": 256}, {"id": "other"}]})
        texts = json.loads(request.content)["input"]
        self.batches.append(texts)
        if self.throttled:
            self.throttled -= 1
            return httpx.Response(429, headers={"Retry-After": self.retry_after},
                                  json={"error": {"message": "busy", "code": "overloaded"}})
        if self.too_large_over is not None and len(texts) > self.too_large_over:
            return httpx.Response(413, json={"error": {"message": "too big",
                                                       "code": "request_exceeds_capacity"}})
        data = [{"index": i, "embedding": vector_of(t) if self.as_floats else b64(vector_of(t))}
                for i, t in reversed(list(enumerate(texts)))]  # out of order, as a server may
        return httpx.Response(200, json={"data": data})


def embedder(server: Server, limits: Limits | None = None,
             cap: int | None = None) -> tuple[Embedder, list[float]]:
    """An embedder on ``server`` whose waits are recorded, not slept."""
    slept: list[float] = []
    client = httpx.Client(transport=httpx.MockTransport(server))
    model = ServedModel("m", cap)
    return Embedder(client, "http://x", model, limits or Limits(), sleep=slept.append), slept


TEXTS = [f"text {i}" for i in range(10)]


def test_vectors_come_back_in_order_from_batches_within_the_token_cap() -> None:
    server = Server()
    e, _ = embedder(server, Limits(batch_inputs=64, max_request_tokens=1000), cap=256)
    out = e.embed(TEXTS)
    assert out[:, 0].tolist() == list(range(10))
    assert [len(b) for b in server.batches] == [3, 3, 3, 1]  # 1000 // 256 texts a request


def test_a_batch_the_server_finds_too_large_is_halved_and_stays_small() -> None:
    server = Server(too_large_over=4, as_floats=True)
    e, _ = embedder(server, Limits(batch_inputs=10))
    assert e.embed(TEXTS)[:, 0].tolist() == list(range(10))
    assert [len(b) for b in server.batches] == [10, 5, 2, 2, 2, 2, 2]
    assert (e.traffic.batch_splits, e.traffic.batch_inputs_final) == (2, 2)


def test_a_batch_past_the_deadline_is_halved_and_a_lone_text_sent_again() -> None:
    answers = iter([httpx.Response(504, json={"error": {"code": "engine_timeout"}})] * 3)
    server = Server()

    def handler(request: httpx.Request) -> httpx.Response:
        return next(answers, None) or server(request)

    slept: list[float] = []
    e = Embedder(httpx.Client(transport=httpx.MockTransport(handler)), "http://x", ServedModel("m"),
                 Limits(batch_inputs=2), sleep=slept.append)
    assert e.embed(TEXTS[:3])[:, 0].tolist() == [0, 1, 2]
    # 2 texts: 504, halved; 1 text: 504 twice, sent again after 1 s each; then answered
    assert (e.traffic.batch_splits, e.traffic.retried, slept) == (1, 2, [1.0, 1.0])


def test_queries_carry_the_input_type_when_asked() -> None:
    bodies: list[dict[str, object]] = []
    server = Server()

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return server(request)

    e = Embedder(httpx.Client(transport=httpx.MockTransport(handler)), "http://x", ServedModel("m"), Limits())
    e.embed(TEXTS[:2])
    e.embed(TEXTS[:2], "query")
    assert [b.get("input_type") for b in bodies] == [None, "query"]
    assert all(b["encoding_format"] == "base64" and b["model"] == "m" for b in bodies)


def test_429s_are_waited_out_for_their_retry_after() -> None:
    server = Server(throttled=2, retry_after="3")
    e, slept = embedder(server)
    assert e.embed(TEXTS)[:, 0].tolist() == list(range(10))
    assert slept == [3.0, 3.0] and e.traffic.retried == 2 and e.traffic.requests == 3
    long_wait = Server(throttled=1, retry_after="900")
    e, slept = embedder(long_wait, Limits(max_retry_after_s=60))
    e.embed(TEXTS)
    assert slept == [60.0]


def test_too_many_429s_or_a_bad_answer_is_an_endpoint_error() -> None:
    e, slept = embedder(Server(throttled=5), Limits(retries=2))
    with pytest.raises(EndpointError, match="429 overloaded: busy"):
        e.embed(TEXTS)
    assert len(slept) == 2
    one = {"data": [{"index": 0, "embedding": [1.0]}]}
    short = httpx.MockTransport(lambda r: httpx.Response(200, json=one))
    e = Embedder(httpx.Client(transport=short), "http://x", ServedModel("m"), Limits())
    with pytest.raises(EndpointError, match=r"1 vectors .* for 10 inputs"):
        e.embed(TEXTS)


def test_the_served_model_and_its_cap_come_from_the_model_list() -> None:
    client = httpx.Client(transport=httpx.MockTransport(Server()))
    assert served_model(client, "http://x", None) == ServedModel("m", 256)
    assert served_model(client, "http://x/v1", "other") == ServedModel("other", None)
    with pytest.raises(EndpointError, match=r"does not serve the model 'nope' .*lists m, other"):
        served_model(client, "http://x", "nope")


# -- the command, end to end ---------------------------------------------------------------

TOPICS = [
    ("Simmering a risotto", "Stir the rice into the softened onions, add warm stock a ladle at a time "
     "and keep stirring until the grains are creamy but still firm."),
    ("Changing a bicycle tyre", "Lever the old tyre off the rim, pull out the inner tube, check the "
     "inside of the tyre for thorns and fit the new tube before pumping it up."),
    ("Orbit of the Moon", "Our satellite circles the Earth every 27 days, always showing the same "
     "face because its rotation is locked to its revolution."),
    ("Pruning fruit trees", "Cut out dead and crossing branches in late winter so that light reaches "
     "the centre of the apple tree and next year's fruit ripens well."),
    ("Tuning a guitar", "Turn the pegs until each string matches its reference pitch, starting "
     "from the low E and comparing the fifth fret with the next open string."),
    ("Filing a tax return", "Gather your income statements and receipts for deductions, fill in the "
     "form for the fiscal year and submit it before the deadline to avoid penalties."),
    ("Training a puppy", "Reward the young dog with a treat the moment it sits on command, and keep "
     "sessions short so that it stays eager to learn."),
    ("Brewing espresso", "Grind the coffee beans finely, tamp the grounds evenly and force hot water "
     "through them at high pressure for about twenty-five seconds."),
    ("Volcanic eruptions", "Molten rock rises through cracks in the crust, and when the gas pressure "
     "is high enough the magma bursts out as lava and ash."),
    ("Knitting a scarf", "Cast on forty stitches with thick wool, knit every row in garter stitch "
     "until the scarf is long enough, then cast off loosely."),
    ("Backing up a database", "Dump the tables to a file while the server runs, copy the file to "
     "another machine and test that a restore from it works."),
    ("Migration of birds", "Each autumn swallows fly thousands of kilometres south to Africa, "
     "finding their way by the sun, the stars and the Earth's magnetic field."),
]


@pytest.fixture
def topic_corpus(tmp_path: Path) -> Path:
    """Twelve passages on unrelated topics; each heading is its query."""
    corpus = Corpus(info=CorpusInfo(source="hand-made"),
                    passages=[Passage(id=f"p{i}", text=t) for i, (_, t) in enumerate(TOPICS)],
                    queries=[Query(id=f"q{i}", text=h, relevant=[f"p{i}"])
                             for i, (h, _) in enumerate(TOPICS)])
    path = tmp_path / "topics.json"
    write_corpus(corpus, path)
    return path


def quality(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed command, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "embedserve", "quality", *args],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.timeout(900)  # 800 texts of up to 64 words: seconds on two idle cores, minutes on busy ones
def test_the_cpu_stack_against_itself_passes_on_a_real_text_corpus(
    minilm_stack: RunningStack, howto_corpus: Path, tmp_path: Path
) -> None:
    out = tmp_path / "result"
    done = quality("--baseline", minilm_stack.url, "--candidate", minilm_stack.url,
                   "--corpus", str(howto_corpus), "--out", str(out), "--batch-inputs", "32")
    assert done.returncode == 0, done.stderr + done.stdout
    report = QualityReport.model_validate_json((out / "quality.json").read_text())
    base, cand = report.retrieval["baseline"], report.retrieval["candidate"]
    assert base == cand and report.top10_overlap == 1.0 and report.cosine.min > 0.9999
    # a corpus whose queries did not belong to their passages would score about 10 / passages
    assert base.recall_at_10 > 0.5 and 0 < base.ndcg_at_10 <= base.recall_at_10
    assert "# Quality gate: PASS" in done.stdout and (out / "summary.md").read_text() == done.stdout


def test_a_worse_candidate_fails_and_its_429s_are_waited_out(
    minilm_stack: RunningStack, topic_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeServer(FakeConfig(dim=384, throttle_every=3, retry_after_s=0.05)) as fake:
        code = cli.main(["--baseline", minilm_stack.url, "--candidate", fake.url, "--corpus",
                         str(topic_corpus), "--batch-inputs", "4", "--out", str(tmp_path)])
    assert code == 1
    report = QualityReport.model_validate_json((tmp_path / "quality.json").read_text())
    assert report.retrieval["baseline"].recall_at_10 == 1.0  # twelve topics apart: all found
    assert {"median_cosine", "p1_cosine"} <= set(report.missed) and not report.passed
    assert report.traffic["candidate"].retried >= 1 and fake.counters.throttled_429 >= 1
    assert report.candidate_model == "fake-embed"
    assert "# Quality gate: FAIL (" in capsys.readouterr().out


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], code: int = 2,
                   progress: bool = False) -> str:
    """The one line of the command's error (after its progress lines, when it got that far)."""
    capsys.readouterr()
    assert cli.main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    said = [line for line in err if line.startswith("embedserve quality: ")]
    assert len(said) == 1 and "Traceback" not in "".join(err), err
    assert progress or len(err) == 1, err
    return said[0]


def test_bad_flags_and_corpora_exit_2_with_one_sentence(
    topic_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    both = ["--baseline", "http://127.0.0.1:9", "--candidate", "http://127.0.0.1:9"]
    with_corpus = [*both, "--corpus", str(topic_corpus)]
    cases: list[tuple[list[str], str]] = [
        ([*with_corpus, "--max-recall-drop", "2"], "--max-recall-drop: wants a number within 0-1"),
        ([*with_corpus, "--batch-inputs", "0"], "--batch-inputs: wants a value >= 1"),
        ([*with_corpus, "--timeout", "soon"], "--timeout: wants a number >= 1"),
        (both, "--corpus"),
        ([*both, "--corpus", str(tmp_path / "none.json")], "No such file"),
        ([*both, "--corpus", str(topic_corpus.parent)], "--corpus"),
    ]
    for argv, says in cases:
        assert says in one_line_error(capsys, argv)
    assert cli.main(["--help"]) == 0


def test_endpoints_that_cannot_be_compared_or_reached(
    topic_corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeServer(FakeConfig(dim=8)) as small, FakeServer(FakeConfig(dim=16)) as large:
        said = one_line_error(capsys, ["--baseline", small.url, "--candidate", large.url,
                                       "--corpus", str(topic_corpus)], progress=True)
    assert "8-dimensional vectors and the candidate 16-dimensional" in said
    nobody = f"http://127.0.0.1:{free_port()}"
    said = one_line_error(capsys, ["--baseline", nobody, "--candidate", nobody, "--corpus",
                                   str(topic_corpus)], code=3, progress=True)
    assert "cannot be reached" in said
