"""Replays of what the load generator sends through a model of a server's prefix cache.

SGLang keeps its radix cache on for Qwen3 embedding models: an input whose leading tokens
are still cached is served partly from the cache, and throughput then measures the cache.
The model here is a radix tree with LRU eviction by token count (65,536 tokens, SGLang's
policy: least recently used leaves go first); for each input it counts the longest cached
prefix, then caches the input.

20,000 inputs (ids; 5,000 texts) replay in a few seconds. The bound holds at any count
because it does not rest on chance: input ``i`` opens with the marker that spells ``i``
through a bijection on at least 2**40 serials (see ``embedserve.loadtest.textbuild``), so
any two inputs of a run share at most the template's leading special tokens plus marker
length - 1 tokens, whether the run sends 20,000 inputs or 10 million
(``test_no_two_inputs_share_more_than_a_few_tokens`` checks that on every pair). A hit is
then at most those few tokens per input, and in practice one (a first token seen before):
under 1% of inputs of 16-512 tokens, at any count. Replayed by hand with 100,000 inputs:
0.00% (ids) and 0.38% (texts) for the tiny Qwen3 tokenizer, 0.38% for MiniLM (its [CLS]).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import json
import random
from collections.abc import Iterable, Sequence
from typing import Any

import pytest

pytest.importorskip("aiohttp", reason="loadtest needs aiohttp (the loadtest extra)")

from embedserve.config import BUNDLED_MODEL, resolve_model_path
from embedserve.loadtest.mixes import parse_count, parse_mix
from embedserve.loadtest.textbuild import TextBuilder, load_tokenizer
from embedserve.loadtest.traffic import RequestFactory
from embedserve.runtime.synth_model import build_tokenizer

CACHE_TOKENS = 65_536
MAX_HIT_RATE = 0.01


class _Node:
    __slots__ = ("children", "key", "parent", "used")

    def __init__(self, key: tuple[int, ...], parent: _Node | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.used = 0


class RadixLRU:
    """A radix tree of token ids holding at most ``capacity`` tokens; least recently used
    leaves are evicted whole, as SGLang's radix cache does."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.root = _Node((), None)
        self.size = 0
        self._clock = itertools.count(1)
        self._heap: list[tuple[int, int, _Node]] = []
        self._ids = itertools.count()

    def _touch(self, node: _Node, now: int) -> None:
        while node is not self.root:
            node.used = now
            if not node.children:
                heapq.heappush(self._heap, (now, next(self._ids), node))
            node = node.parent  # type: ignore[assignment]

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node``'s edge after ``at`` tokens; returns the new upper half."""
        parent = node.parent
        assert parent is not None
        upper = _Node(node.key[:at], parent)
        upper.used = node.used
        parent.children[upper.key[0]] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    def lookup_insert(self, tokens: Sequence[int]) -> int:
        """Tokens of ``tokens`` already cached as a prefix; then cache all of it."""
        now = next(self._clock)
        node, i, n = self.root, 0, len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                break
            key = child.key
            j = 0
            lim = min(len(key), n - i)
            while j < lim and key[j] == tokens[i + j]:
                j += 1
            i += j
            if j < len(key):
                node = self._split(child, j)
                break
            node = child
        hit = i
        if i < n:
            leaf = _Node(tuple(tokens[i:]), node)
            node.children[tokens[i]] = leaf
            self.size += n - i
            node = leaf
        self._touch(node, now)
        self._evict()
        return hit

    def _evict(self) -> None:
        while self.size > self.capacity and self._heap:
            used, _, node = heapq.heappop(self._heap)
            if node.children or node.used != used or node.parent is None:
                continue  # stale entry: touched since, or no longer a leaf
            parent = node.parent
            if parent.children.get(node.key[0]) is not node:
                continue
            del parent.children[node.key[0]]
            node.parent = None
            self.size -= len(node.key)
            if parent is not self.root and not parent.children:
                heapq.heappush(self._heap, (parent.used, next(self._ids), parent))


def replay(inputs: Iterable[Sequence[int]], capacity: int = CACHE_TOKENS) -> float:
    """Fraction of tokens a prefix cache of ``capacity`` tokens would have served."""
    cache = RadixLRU(capacity)
    hit = total = 0
    for ids in inputs:
        hit += cache.lookup_insert(ids)
        total += len(ids)
    return hit / total


@pytest.fixture(scope="module")
def qwen_tok() -> Any:
    return build_tokenizer()


@pytest.fixture(scope="module")
def bert_tok() -> Any:
    return load_tokenizer(resolve_model_path(BUNDLED_MODEL))


def sent_inputs(factory: RequestFactory, n_inputs: int) -> list[Any]:
    """Every input of the requests the factory makes, in order, as sent on the wire."""
    out: list[Any] = []
    while len(out) < n_inputs:
        out.extend(json.loads(factory.make().body)["input"])
    return out


def as_ids(inputs: list[Any], tok: Any) -> list[list[int]]:
    """Token ids the server sees: ids as sent, texts tokenised (special tokens included)."""
    if inputs and isinstance(inputs[0], str):
        return [list(e.ids) for e in tok.encode_batch(inputs)]
    return inputs


def _factory(tok: Any, kind: str, mix: str = "uniform:16-512", inputs: str = "1-4", seed: int = 0,
             **kw: Any) -> RequestFactory:
    return RequestFactory(parse_mix(mix), TextBuilder(tok, seed=seed), kind,  # type: ignore[arg-type]
                          parse_count(inputs), "m", seed, **kw)


def test_the_cache_model_counts_longest_cached_prefixes() -> None:
    cache = RadixLRU(10)
    assert cache.lookup_insert([1, 2, 3, 4]) == 0
    assert cache.lookup_insert([1, 2, 3, 4]) == 4
    assert cache.lookup_insert([1, 2, 9]) == 2  # splits the edge
    assert cache.lookup_insert([5, 6, 7, 8, 9]) == 0  # 4 + 1 + 5 = 10 tokens: all fit
    assert cache.lookup_insert([1, 2, 9]) == 3
    assert cache.lookup_insert([7, 7]) == 0  # 12 tokens: the LRU leaf [3, 4] goes
    assert cache.lookup_insert([1, 2, 3, 4]) == 2
    assert cache.size <= 10


@pytest.mark.parametrize("which", ["qwen", "bert"])
@pytest.mark.parametrize("kind,n_inputs", [("ids", 20_000), ("text", 5_000)])
def test_replay_hits_at_most_one_percent(which: str, kind: str, n_inputs: int, qwen_tok: Any,
                                         bert_tok: Any) -> None:
    tok = qwen_tok if which == "qwen" else bert_tok
    inputs = as_ids(sent_inputs(_factory(tok, kind, seed=11), n_inputs), tok)
    rate = replay(inputs)
    assert rate <= MAX_HIT_RATE, f"{which} {kind}: {rate:.2%} of tokens from the cache"


@pytest.mark.parametrize("kind,n_inputs", [("ids", 20_000), ("text", 5_000)])
def test_chunks_built_apart_hit_at_most_one_percent(kind: str, n_inputs: int, qwen_tok: Any) -> None:
    """Build processes make a run's requests in chunks, each from its own random stream:
    their inputs must stay as unique as one factory's."""
    f = _factory(qwen_tok, kind, seed=11).for_chunks()
    inputs: list[Any] = []
    chunk = 0
    while len(inputs) < n_inputs:
        inputs += [x for p in f.make_chunk(chunk)[0] for x in json.loads(p.body)["input"]]
        chunk += 1
    rate = replay(as_ids(inputs, qwen_tok))
    assert rate <= MAX_HIT_RATE, f"{kind}: {rate:.2%} of tokens from the cache"


def old_cut_ids(b: TextBuilder, n: int, rng: random.Random) -> list[int]:
    """How ids were cut before markers: a corpus slice, nothing else, from a start drawn
    among the tokens right after a space (with byte-level offsets, which hold the space,
    only ~5% of the corpus: 539 starts of 11,917 tokens for the tiny Qwen3 tokenizer)."""
    assert b._wrap is not None
    head, tail = b._wrap
    starts = [i for i, (s, _) in enumerate(b._offsets) if s == 0 or b._corpus[s - 1] == " "]
    k = max(n, b.n_special + 1) - b.n_special
    hi = bisect.bisect_right(starts, len(b._offsets) - k - 32) - 1
    start = starts[rng.randint(0, max(hi, 0))]
    return head + b._corpus_ids[start:start + k] + tail


def test_the_replay_catches_the_old_cutting(qwen_tok: Any) -> None:
    """Without markers, inputs cut from the ~4k-token corpus repeat their starts, and the
    same replay serves a quarter of the tokens from the cache."""
    b, rng, mix = TextBuilder(qwen_tok, seed=11), random.Random(11), parse_mix("uniform:16-512")
    old = [old_cut_ids(b, mix.sample(rng), rng) for _ in range(3_000)]  # type: ignore[union-attr]
    assert replay(old) > 0.10


@pytest.mark.parametrize("kind", ["ids", "text"])
def test_the_replay_catches_repeated_content(kind: str, qwen_tok: Any) -> None:
    """The labelled repeated-content scenario is what the replay exists to tell apart."""
    n = 6_000 if kind == "ids" else 2_000
    repeats = as_ids(sent_inputs(_factory(qwen_tok, kind, repeat_rate=0.3), n), qwen_tok)
    assert replay(repeats) > 0.05
    b = TextBuilder(qwen_tok, seed=0, prefix="Instruct: Given a web search query, retrieve "
                    "relevant passages that answer the query\nQuery:")
    f = RequestFactory(parse_mix("uniform:16-128"), b, kind, (1, 1), "m", 0)  # type: ignore[arg-type]
    assert replay(as_ids(sent_inputs(f, n // 2), qwen_tok)) > 0.05


def _longest_shared_prefix(inputs: list[list[int]]) -> int:
    """Longest common prefix over all pairs: the maximum over neighbours in sorted order."""
    ordered = sorted(inputs)
    best = 0
    for a, b in itertools.pairwise(ordered):
        j, lim = 0, min(len(a), len(b))
        while j < lim and a[j] == b[j]:
            j += 1
        best = max(best, j)
    return best


@pytest.mark.parametrize("mix", ["seed", "uniform:16-512", "fixed:40", "buckets:1:8-64,1:300-400",
                                 "fixed:3"])
@pytest.mark.parametrize("which", ["qwen", "bert"])
def test_no_two_inputs_share_more_than_a_few_tokens(mix: str, which: str, qwen_tok: Any,
                                                   bert_tok: Any) -> None:
    """Every pair of inputs, ids and text: at most the leading special tokens plus marker
    length - 1 tokens in common (inputs shorter than that: at most their own length)."""
    tok = qwen_tok if which == "qwen" else bert_tok
    for kind, n in (("ids", 8_000), ("text", 800)):
        f = _factory(tok, kind, mix=mix, inputs="1-3", seed=5, max_tokens=2048)
        inputs = as_ids(sent_inputs(f, n), tok)
        b: Any = f.builder
        lead = 1 if which == "bert" else 0  # [CLS]
        marker = b.marker_len if kind == "ids" else b._word_markers.length
        assert _longest_shared_prefix(inputs) <= lead + marker - 1, (mix, kind)
        lengths = [len(x) for x in inputs]
        if mix.startswith("fixed:"):
            assert set(lengths) == {int(mix[6:])}  # exact lengths, special tokens included
