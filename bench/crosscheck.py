"""A second load client, independent of `embedserve loadtest`, to cross-check headline rows:
closed loop, N requests in flight, every input unique: random token ids (raw engines), or
texts of random whole-word vocabulary entries, one token each, so a text of N words is about
N tokens (the gateway). Tokens are counted from the server's `usage`. Prints one JSON line.

    python3 bench/crosscheck.py URL --model M --ids 16-512 --concurrency 64 --seconds 20
    python3 bench/crosscheck.py URL --model M --text 16-512 --tokenizer MODEL_DIR
    python3 bench/crosscheck.py URL --model M --text 0.92:8-512,0.06:513-1024,0.02:1025-32768 --cap 8192
    python3 bench/crosscheck.py URL --model M --ids 16-512 --requests 600   # a fixed set of inputs
    python3 bench/crosscheck.py RERANK_URL --model M --text 128-128 --rerank 32 --tokenizer MODEL_DIR

With --rerank N each request is a rerank body (an 8-word query and N passages, framed by --wrap),
and the row counts pairs: inputs_s is pairs/s, tok_s pairs/s x the passages' words.

Lengths are one range A-B, or weighted ranges W:A-B,... (uniform within the range drawn), clamped to --cap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp


def vocab_words(model_dir: str) -> list[str]:
    """Entries of the tokenizer's vocabulary that are a word start and 3+ lowercase letters (BPE's
    and Unigram's marked with a leading space sign, WordPiece's unmarked)."""
    model = json.loads((Path(model_dir) / "tokenizer.json").read_text())["model"]
    vocab = [v[0] if isinstance(v, list) else v for v in model["vocab"]]
    if model.get("type") == "WordPiece":
        return [w for w in vocab if len(w) > 3 and w.isalpha() and w.islower()]
    return [w[1:] for w in vocab if w[:1] in ("\u0120", "\u2581") and len(w) > 3 and w[1:].isalpha()
            and w[1:].islower()]


def length_buckets(spec: str) -> list[tuple[float, int, int]]:
    """``A-B`` or ``W:A-B,W:A-B,...`` as (weight, lo, hi) triples."""
    out = []
    for part in spec.split(","):
        weight, _, span = part.rpartition(":")
        lo, hi = (int(x) for x in span.split("-"))
        out.append((float(weight or 1), lo, hi))
    return out


def make_input(a: argparse.Namespace, rng: random.Random, words: list[str]) -> list[int] | str:
    """One input; ``a.lengths``: ``length_buckets`` of --ids or --text, parsed once."""
    _, lo, hi = rng.choices(a.lengths, weights=[b[0] for b in a.lengths])[0]
    n = min(rng.randint(lo, hi), a.cap) if a.cap else rng.randint(lo, hi)
    if a.ids:
        return [rng.randrange(1000, a.vocab) for _ in range(n)]
    return " ".join(rng.choice(words) for _ in range(n))


async def main(a: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(a.seed)
    a.lengths = length_buckets(a.ids or a.text)
    words = vocab_words(a.tokenizer) if a.text else []
    a.vocab = 100_000  # token ids below the model's vocabulary size
    if a.tokenizer and (config := Path(a.tokenizer) / "config.json").exists():
        a.vocab = min(a.vocab, json.loads(config.read_text()).get("vocab_size", a.vocab))
    tokens, lat, errors = 0, [], 0
    left = a.requests or -1  # with --requests, that many requests and every answer counts
    start = time.perf_counter() + (0 if a.requests else a.warmup)  # answers between start and stop count
    stop = math.inf if a.requests else start + a.seconds

    async def worker(s: aiohttp.ClientSession) -> None:
        nonlocal tokens, errors, left
        while time.perf_counter() < stop and left != 0:
            left -= 1
            inputs = [make_input(a, rng, words) for _ in range(a.rerank or a.batch)]
            body = {"model": a.model, "input": inputs} if not a.rerank else {
                "model": a.model, "query": a.wrap[0].format(" ".join(rng.choice(words) for _ in range(8))),
                "documents": [a.wrap[1].format(x) for x in inputs]}
            t = time.perf_counter()
            try:
                async with s.post(a.url, json=body) as r:
                    data = await r.json(content_type=None) if r.status == 200 else None
            except (TimeoutError, aiohttp.ClientError):
                data = None
            if not start <= (done := time.perf_counter()) <= stop:
                continue
            if data is None:
                errors += 1
                continue
            lat.append(done - t)
            if a.rerank:  # the passages' words, as the rerank rows count them
                tokens += sum(len(x.split()) for x in inputs if isinstance(x, str))
            else:
                usage = data.get("usage") or {}
                tokens += usage.get("prompt_tokens") or sum(len(x) for x in inputs if isinstance(x, list))

    conn = aiohttp.TCPConnector(limit=a.concurrency)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        await asyncio.gather(*(worker(s) for _ in range(a.concurrency)))
    n, secs = len(lat), time.perf_counter() - start if a.requests else a.seconds
    pairs = {"inputs_s": round(n * a.rerank / secs, 1)} if a.rerank else {}
    return {**pairs, "tok_s": round(tokens / secs), "req_s": round(n / secs, 2), "requests": n,
            "errors": errors, "tokens": tokens, "seconds": round(secs, 1),
            "p50_ms": round(statistics.median(lat) * 1000, 1) if lat else None}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url", help="full /v1/embeddings URL")
    ap.add_argument("--model", required=True)
    kind = ap.add_mutually_exclusive_group(required=True)
    kind.add_argument("--ids", help="token ids per input, A-B or W:A-B,... (raw engines)")
    kind.add_argument("--text", help="texts of about A-B (or W:A-B,...) tokens per input (the gateway)")
    ap.add_argument("--cap", type=int, help="no input longer than this many tokens")
    ap.add_argument("--tokenizer", help="model folder (texts from its vocabulary, ids below its size)")
    ap.add_argument("--batch", type=int, default=1, help="inputs per request")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=20, help="measured time")
    ap.add_argument("--warmup", type=float, default=3, help="seconds first, not measured")
    ap.add_argument("--requests", type=int, help="exactly this many (one seed: the same inputs), no warm-up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rerank", type=int, default=0, help="rerank requests of this many passages (--text)")
    ap.add_argument("--wrap", nargs=2, default=("{}", "{}"), metavar=("QUERY", "PASSAGE"),
                    help="format strings around the query and each passage (a client-framed prompt)")
    print(json.dumps(asyncio.run(main(ap.parse_args()))))
