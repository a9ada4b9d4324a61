"""Embedding a corpus through an OpenAI-compatible endpoint, within the server's limits.

- **Batches** of at most ``batch_inputs`` texts, and of at most ``max_request_tokens`` tokens
  counting every input at the model's ``max_seq_len`` (from ``GET /v1/models``, where the
  server says it), so a request never exceeds embedserve's per-request caps.
- **429 and 503** (overloaded, warming up) are waited out for their ``Retry-After`` and sent
  again, up to ``retries`` times a batch; so is a connection that failed (after 1 s).
- **A batch the server finds too large** (embedserve's 413 ``request_exceeds_capacity``, 400
  ``max_tokens_per_request`` or ``too_many_inputs``), or could not embed before its deadline
  (504), is halved, and later batches stay at the size that was accepted; a single text that
  times out is sent again like a 503.
- Vectors are asked for as base64 float32 (the server's own numbers, no decimal rounding);
  a server that answers float lists is read too. embedserve's other output types are asked
  for through its Cohere route (``/v2/embed`` with ``embedding_types``: every type from one
  embedding of the batch) and decoded as they are ranked.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from embedserve.contracts.quality import Traffic
from embedserve.loadtest.args import embeddings_url
from embedserve.loadtest.quality.metrics import Vectors
from embedserve.loadtest.runner import retry_after_s

TOO_LARGE = frozenset({"request_exceeds_capacity", "max_tokens_per_request", "too_many_inputs"})


class EndpointError(RuntimeError):
    """The endpoint failed in a way that sending again does not fix (the message says how)."""


@dataclass(frozen=True)
class Limits:
    """How the client stays within a server's limits."""

    batch_inputs: int = 64
    max_request_tokens: int = 300_000  # embedserve's default gateway.max_tokens_per_request
    retries: int = 8
    max_retry_after_s: float = 60.0
    timeout_s: float = 300.0


@dataclass(frozen=True)
class ServedModel:
    """The model an endpoint serves, as ``GET /v1/models`` describes it."""

    id: str
    max_seq_len: int | None = None


def _error_of(r: httpx.Response) -> tuple[str, str]:
    """(code, message) of an OpenAI error envelope, or ('', the body's start)."""
    try:
        err = r.json().get("error") or {}
        return str(err.get("code") or ""), str(err.get("message") or r.text[:200])
    except (ValueError, AttributeError):
        return "", r.text[:200]


def served_model(client: httpx.Client, base_url: str, wanted: str | None) -> ServedModel:
    """``wanted`` (or the first model listed) with its sequence cap; EndpointError when the
    endpoint cannot be reached or does not serve ``wanted``."""
    url = embeddings_url(base_url).rsplit("/embeddings", 1)[0] + "/models"
    try:
        r = client.get(url)
    except httpx.HTTPError as exc:
        raise EndpointError(f"{base_url} cannot be reached ({type(exc).__name__}: {exc})") from None
    if r.status_code != 200:
        raise EndpointError(f"GET {url} answered {r.status_code}: {_error_of(r)[1]}")
    try:
        entries = [e for e in r.json()["data"] if isinstance(e, dict) and "id" in e]
    except (ValueError, KeyError, TypeError):
        raise EndpointError(f"GET {url} did not answer a model list") from None
    entry = next((e for e in entries if wanted in (None, e["id"])), None)
    if entry is None:
        listed = ", ".join(str(e["id"]) for e in entries) or "none"
        raise EndpointError(f"{base_url} does not serve the model {wanted!r} (it lists {listed})")
    cap = entry.get("max_seq_len")
    return ServedModel(str(entry["id"]), int(cap) if isinstance(cap, int) and cap > 0 else None)


#: each output type's bytes as sent in base64
DTYPES = {"float": "<f4", "int8": "i1", "uint8": "u1", "binary": "i1", "ubinary": "u1"}


def decode(row: Any, embedding_type: str = "float") -> Vectors:
    """One ``embedding`` (base64 or a list) of ``embedding_type`` as the numbers it is ranked by:
    floats and int8 as they are, uint8 less 128 (int8's buckets), binary and ubinary unpacked to
    +-1 a bit (their cosine ranks as Hamming distance does)."""
    dtype = DTYPES[embedding_type]
    raw = np.frombuffer(base64.b64decode(row), dtype=dtype) if isinstance(row, str) else np.asarray(row)
    if embedding_type in ("binary", "ubinary"):
        packed = (raw.astype(np.int16) + (128 if embedding_type == "binary" else 0)).astype(np.uint8)
        return np.unpackbits(packed).astype(np.float64) * 2 - 1
    return raw.astype(np.float64) - (128 if embedding_type == "uint8" else 0)


def _vectors(body: Any, count: int, url: str, embedding_type: str = "float") -> Vectors:
    try:
        data = sorted(body["data"], key=lambda d: d["index"])
        out = np.stack([decode(d["embedding"], embedding_type) for d in data])
    except (KeyError, TypeError, ValueError) as exc:
        raise EndpointError(f"{url} answered an embeddings response that cannot be read ({exc})") from None
    if len(out) != count or not np.isfinite(out).all():
        raise EndpointError(f"{url} answered {len(out)} vectors (finite: {bool(np.isfinite(out).all())}) "
                            f"for {count} inputs")
    return out


class Embedder:
    """One endpoint's vectors for lists of texts; ``traffic`` counts what it took."""

    def __init__(self, client: httpx.Client, base_url: str, model: ServedModel, limits: Limits,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client, self.url, self.model, self.limits = client, embeddings_url(base_url), model, limits
        self.sleep, self.clock = sleep, clock
        cap = model.max_seq_len
        by_tokens = limits.max_request_tokens // cap if cap else limits.batch_inputs
        self.batch = max(1, min(limits.batch_inputs, by_tokens))
        self.traffic = Traffic(batch_inputs_final=self.batch)

    def embed(self, texts: list[str], input_type: str | None = None) -> Vectors:
        """Vectors of ``texts``, in order."""
        return self.embed_types(texts, input_type, ())["float"]

    def embed_types(self, texts: list[str], input_type: str | None,
                    types: tuple[str, ...]) -> dict[str, Vectors]:
        """The float vectors of ``texts`` and, with ``types``, the same vectors as each of
        embedserve's output types, decoded (:func:`decode`), from one embedding: asked for
        through Cohere's ``/v2/embed``, which answers several types at once."""
        t0 = self.clock()
        parts: list[dict[str, Vectors]] = []
        done = 0
        while done < len(texts):
            chunk = texts[done:done + self.batch]
            vectors = self._post(chunk, input_type, types)
            if vectors is None:  # too large: halve and send again
                self.batch = max(1, len(chunk) // 2)
                self.traffic.batch_splits += 1
                continue
            parts.append(vectors)
            done += len(chunk)
        self.traffic.texts += len(texts)
        self.traffic.batch_inputs_final = self.batch
        self.traffic.seconds += self.clock() - t0
        return {k: np.concatenate([p[k] for p in parts]) if parts else np.empty((0, 0))
                for k in ("float", *types)}

    def _body(self, chunk: list[str], input_type: str | None, types: tuple[str, ...]) -> tuple[str, Any]:
        if types:
            url = self.url.rsplit("/v1/embeddings", 1)[0] + "/v2/embed"
            cohere_type = "search_query" if input_type == "query" else "search_document"
            return url, {"model": self.model.id, "texts": chunk, "input_type": cohere_type,
                         "embedding_types": ["float", *types]}
        body: dict[str, Any] = {"model": self.model.id, "input": chunk, "encoding_format": "base64"}
        if input_type:
            body["input_type"] = input_type
        return self.url, body

    def _read(self, answer: Any, count: int, url: str, types: tuple[str, ...]) -> dict[str, Vectors]:
        if not types:
            return {"float": _vectors(answer, count, url)}
        try:
            by_type = answer["embeddings"]
            return {k: _vectors({"data": [{"index": i, "embedding": e} for i, e in enumerate(by_type[k])]},
                                count, url, k) for k in ("float", *types)}
        except (KeyError, TypeError) as exc:
            raise EndpointError(f"{url} answered an embed response without {exc}") from None

    def _post(self, chunk: list[str], input_type: str | None,
              types: tuple[str, ...]) -> dict[str, Vectors] | None:
        """The chunk's vectors, or None when the server says it is too large to take at once."""
        url, body = self._body(chunk, input_type, types)
        for attempt in range(self.limits.retries + 1):
            self.traffic.requests += 1
            try:
                r = self.client.post(url, json=body)
            except httpx.HTTPError as exc:
                if attempt == self.limits.retries:
                    raise EndpointError(f"{url}: {type(exc).__name__}: {exc}") from None
                self.traffic.retried += 1
                self.sleep(1.0)
                continue
            if r.status_code == 200:
                try:
                    return self._read(r.json(), len(chunk), url, types)
                except ValueError:
                    raise EndpointError(f"{url} answered 200 with a body that is not JSON") from None
            code, message = _error_of(r)
            if (code in TOO_LARGE or r.status_code == 504) and len(chunk) > 1:
                return None
            if r.status_code in (429, 503, 504) and attempt < self.limits.retries:
                self.traffic.retried += 1
                self.sleep(min(retry_after_s(r.headers.get("retry-after")), self.limits.max_retry_after_s))
                continue
            raise EndpointError(f"{self.url} answered {r.status_code}{f' {code}' if code else ''}: {message}")
        raise AssertionError("unreachable")
