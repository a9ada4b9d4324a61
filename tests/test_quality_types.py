"""``embedserve quality --types``: the client decodes each output type as it is ranked, fetches all
types of a batch in one ``/v2/embed`` request, and reports each type against the float baseline."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np

from embedserve.contracts.quality import Corpus, CorpusInfo, Passage, Query
from embedserve.core.vectors import quantize, shape_vectors
from embedserve.loadtest.quality.cli import type_quality
from embedserve.loadtest.quality.client import Embedder, Limits, ServedModel, decode

RNG = np.random.default_rng(3)
UNIT = shape_vectors(RNG.standard_normal((6, 20)).astype(np.float32), None, True)


def test_decode_reads_each_type_as_it_is_ranked() -> None:
    int8, uint8 = quantize(UNIT, "int8"), quantize(UNIT, "uint8")
    assert np.array_equal(decode(int8[0].tolist(), "int8"), int8[0])
    assert np.array_equal(decode(uint8[0].tolist(), "uint8"), int8[0])  # less 128: int8's buckets
    signs = np.where(UNIT[0] > 0, 1.0, -1.0)
    for kind in ("binary", "ubinary"):
        packed = quantize(UNIT, kind)[0]
        as_list = decode(packed.tolist(), kind)
        as_base64 = decode(base64.b64encode(packed.tobytes()).decode(), kind)
        assert len(as_list) == 24 and np.array_equal(as_list[:20], signs)  # 3 bytes, zero-padded
        assert np.array_equal(as_list, as_base64)
    floats = decode(base64.b64encode(UNIT[0].astype("<f4").tobytes()).decode())
    assert np.array_equal(floats, UNIT[0])


def test_every_type_of_a_batch_comes_from_one_embed_request() -> None:
    seen: list[dict[str, object]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v2/embed"
        body = json.loads(request.content)
        seen.append(body)
        rows = UNIT[[int(t.split()[-1]) for t in body["texts"]]]
        by_type = {k: [r.tolist() for r in quantize(rows, k)] for k in body["embedding_types"]}
        return httpx.Response(200, json={"embeddings": by_type})

    client = httpx.Client(transport=httpx.MockTransport(answer))
    e = Embedder(client, "http://x", ServedModel("m"), Limits(batch_inputs=4))
    got = e.embed_types([f"t {i}" for i in range(6)], "query", ("int8", "binary"))
    assert [len(b["texts"]) for b in seen] == [4, 2]  # type: ignore[arg-type]
    assert seen[0]["embedding_types"] == ["float", "int8", "binary"]
    assert seen[0]["input_type"] == "search_query" and e.traffic.requests == 2
    assert np.allclose(got["float"], UNIT) and np.array_equal(got["int8"], quantize(UNIT, "int8"))
    assert np.array_equal(got["binary"][:, :20], np.where(UNIT > 0, 1.0, -1.0))


def test_a_type_is_reported_against_the_float_baseline() -> None:
    passages = RNG.standard_normal((30, 20))
    queries = passages[:12] + 0.3 * RNG.standard_normal((12, 20))
    corpus = Corpus(info=CorpusInfo(source="test"),
                    passages=[Passage(id=f"p{i}", text="x") for i in range(30)],
                    queries=[Query(id=f"q{i}", text="x", relevant=[f"p{i}"]) for i in range(12)])
    same = type_quality(corpus, (passages, queries), (passages, queries), packed_bits=False)
    assert same.recall_at_10_drop == 0 and same.top10_overlap == 1 and same.bytes_per_vector == 20
    signs = (np.where(passages > 0, 1.0, -1.0), np.where(queries > 0, 1.0, -1.0))
    padded = tuple(np.pad(s, ((0, 0), (0, 4)), constant_values=-1.0) for s in signs)
    binary = type_quality(corpus, (passages, queries), padded, packed_bits=True)  # type: ignore[arg-type]
    assert binary.bytes_per_vector == 3 and binary.top10_overlap < 1
    unpadded = type_quality(corpus, (passages, queries), signs, packed_bits=False)
    assert binary.retrieval == unpadded.retrieval  # the padding bits are cut off before ranking
