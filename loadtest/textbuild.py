"""Build inputs of an exact length in the target model's tokens.

Lengths count what the server embeds: the tokenizer's special tokens included (for
Qwen3-Embedding the trailing ``<|endoftext|>``, for BERT ``[CLS]`` and ``[SEP]``).

No input of a run shares a prefix of more than a few tokens with another, so a server-side
prefix cache (SGLang's radix cache stays on for Qwen3 embedding models) serves next to
nothing and throughput measures the engine. The corpus alone cannot give that: it is ~4k
tokens, so two cuts from the same word start share their whole shorter length. Each input
therefore opens with a *marker*: K tokens (ids: vocabulary tokens, special tokens excluded;
texts: whole words the tokenizer keeps as one token each) that spell the input's serial
number through a bijection ``serial -> (a * serial + b) mod n**K`` (``a`` coprime with
``n``, both from the seed). Distinct serials give distinct markers, so two inputs share at
most the template's leading special tokens (BERT's ``[CLS]``) and K - 1 marker tokens, for
any run shorter than ``n**K`` >= 2**40 inputs; inputs too short to hold the whole marker
share at most their own few tokens. The least significant digit comes first, so even
neighbouring serials differ at the first token. The body after the marker is cut from the
corpus at a random word as before. (No generator can do better than one token: once a
cache holds more inputs than the vocabulary has first tokens, every new input finds its
first token cached, a hit of 1/length; for Qwen3's 151k-token vocabulary that takes over
150k cached inputs.) An optional shared prefix (``--shared-prefix``, the
labelled repeated-content scenario) goes before the marker.
"""

from __future__ import annotations

import bisect
import math
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from embedserve.contracts.models import resolve_model_path

_WORD_TEXT = (
    "the of and to in is for on with as by at from that this it be are was an or not "
    "memory model token embedding query passage search retrieve document vector server "
    "gpu cache batch length kernel attention layer weight normal pool request response "
    "error limit health probe restart pod cluster graph index score rank answer question "
    "river mountain history science music language city market energy water policy "
    "system network people company report research student government country world "
    "def return import class self print value list dict string number time data file "
    "however because although therefore meanwhile, quickly. slowly; (note) 2024 3.14 42"
)
_WORDS = _WORD_TEXT.split()
_EXTRA = ["数据", "模型", "向量", "检索", "naïve", "café", "Zürich", "😀", "{}", "x_1"]
MARKER_SPACE = 1 << 40  # distinct markers per run: far more inputs than any run sends
_WORD = re.compile(r" ?[a-z]{3,}")


class Markers:
    """Serial number -> marker digits, a bijection on ``prod(radices)`` serials.

    Mixed radix (a text's first word may come from a smaller list than the rest); the
    affine map spreads neighbouring serials, so consecutive inputs differ at digit 0."""

    def __init__(self, radices: Sequence[int], seed: int) -> None:
        if not radices or min(radices) < 2:
            raise ValueError("a marker needs at least two symbols per position")
        self.radices = list(radices)
        self.space = math.prod(self.radices)
        rng = random.Random(seed ^ 0x6D61726B)
        a = rng.randrange(1, self.space)
        while math.gcd(a, self.space) != 1:
            a += 1
        self.a, self.b = a, rng.randrange(self.space)

    @classmethod
    def covering(cls, first: int, rest: int, seed: int) -> Markers:
        """Enough positions (``first`` symbols, then ``rest`` each) for MARKER_SPACE serials."""
        radices = [first]
        while math.prod(radices) < MARKER_SPACE:
            radices.append(rest)
        return cls(radices, seed)

    @property
    def length(self) -> int:
        return len(self.radices)

    def digits(self, serial: int, m: int) -> list[int]:
        """The first ``m`` digits of ``serial``'s marker, least significant first."""
        x = (self.a * serial + self.b) % self.space
        out = []
        for r in self.radices[:m]:
            x, d = divmod(x, r)
            out.append(d)
        return out


def plain_ids(tokenizer: Any) -> list[int]:
    """Vocabulary ids that are not special/added tokens (what a marker may use)."""
    added = set(tokenizer.get_added_tokens_decoder())
    n = tokenizer.get_vocab_size(with_added_tokens=False)
    return [i for i in range(n) if i not in added]


def one_token_words(tokenizer: Any) -> tuple[list[str], list[str]]:
    """Lower-case words the tokenizer keeps as one token: (at the start of a text, after a
    space). Marker words from these lists make the marker's token count exact."""
    decoded = [s for s in tokenizer.decode_batch([[i] for i in plain_ids(tokenizer)])
               if _WORD.fullmatch(s)]
    # byte-level BPE marks word starts with a space; the rest are pieces of words ("tention")
    starts = [s for s in decoded if s.startswith(" ")]
    words = sorted({s.strip() for s in (starts or decoded)})
    first = [w for w, e in zip(words, tokenizer.encode_batch(words, add_special_tokens=False),
                               strict=True) if len(e.ids) == 1]
    spaced = [" " + w for w in words]
    after = [w for w, e in zip(words, tokenizer.encode_batch(spaced, add_special_tokens=False),
                               strict=True) if len(e.ids) == 1]
    return first, after


def load_tokenizer(path: str | Path) -> Any:
    """A ``tokenizers.Tokenizer`` from a tokenizer.json file, a model folder holding one, or
    the bundled model's name (``bundled:all-MiniLM-L6-v2``)."""
    from tokenizers import Tokenizer

    p = resolve_model_path(str(path))
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {p}")
    tok = Tokenizer.from_file(str(p))
    tok.no_truncation()
    tok.no_padding()
    return tok


def corpus_text(n_words: int, seed: int = 0) -> str:
    """Deterministic filler text: mostly common words, a few multilingual/emoji tokens."""
    rng = random.Random(seed)
    words = [rng.choice(_EXTRA) if rng.random() < 0.03 else rng.choice(_WORDS)
             for _ in range(n_words)]
    return " ".join(words)


class TextBuilder:
    """Cuts texts (or token ids) of exactly N tokens, special tokens included: a unique
    marker, then a body from the corpus (see the module docstring).

    ``prefix`` (text) or ``prefix_ids`` (token ids) go before the marker of every input:
    the shared-prefix scenario. They count towards the length."""

    def __init__(self, tokenizer: Any, seed: int = 0, min_corpus_tokens: int = 4096,
                 prefix: str = "", prefix_ids: Sequence[int] = ()) -> None:
        self.tok = tokenizer
        self.seed = seed
        probe = "hello world"
        with_special = list(tokenizer.encode(probe).ids)
        plain = list(tokenizer.encode(probe, add_special_tokens=False).ids)
        self.n_special = len(with_special) - len(plain)
        # where the template puts its special tokens ([CLS] x [SEP], x <|endoftext|>), so that
        # token ids can be cut from the encoded corpus without tokenising per request
        self._wrap: tuple[list[int], list[int]] | None = next(
            ((with_special[:i], with_special[i + len(plain):])
             for i in range(self.n_special + 1) if with_special[i:i + len(plain)] == plain), None)
        self.prefix = prefix
        self.prefix_ids = list(prefix_ids) or (
            list(tokenizer.encode(prefix, add_special_tokens=False).ids) if prefix else [])
        self._id_symbols = plain_ids(tokenizer)
        self._id_markers = Markers.covering(len(self._id_symbols), len(self._id_symbols), seed)
        first, after = one_token_words(tokenizer)
        self._first_words = after if prefix else first  # after a prefix, a space comes first
        self._after_words = after
        self._word_markers = Markers.covering(len(self._first_words), len(after), seed)
        self._corpus = ""
        self._corpus_ids: list[int] = []
        self._offsets: list[tuple[int, int]] = []
        self._starts: list[int] = []  # token indices that begin a word
        self._grow(min_corpus_tokens)

    @property
    def min_len(self) -> int:
        """Special tokens, the shared prefix and one token of marker."""
        return self.n_special + len(self.prefix_ids) + 1

    @property
    def marker_len(self) -> int:
        """Marker tokens at the start of an input long enough to hold them (ids)."""
        return self._id_markers.length

    def _grow(self, need_tokens: int) -> None:
        n_words = max(1024, int(need_tokens * 1.3) + 64)
        while True:
            text = corpus_text(n_words, self.seed)
            enc = self.tok.encode(text, add_special_tokens=False)
            if len(enc.ids) >= need_tokens + 64:
                break
            n_words *= 2
        self._corpus = text
        self._corpus_ids = list(enc.ids)
        self._offsets = list(enc.offsets)
        # a word starts after a space (WordPiece offsets) or with one (byte-level BPE's
        # offsets include the space: "Ġword")
        self._starts = [i for i, (s, _) in enumerate(self._offsets)
                        if s == 0 or text[s - 1] == " " or text[s] == " "]

    def reserve(self, n_tokens: int) -> None:
        """Grow the corpus now for inputs of up to ``n_tokens``, so that it never grows
        mid-run: what an input is then depends on the seed and its serial alone, whichever
        process builds it."""
        if n_tokens + 64 > len(self._offsets):
            self._grow(2 * n_tokens)

    def count(self, text: str) -> int:
        """Tokens the server will embed for this text (special tokens included)."""
        return len(self._ids(text))

    def text(self, n_tokens: int, rng: random.Random, serial: int | None = None) -> str:
        """A text that encodes to exactly ``n_tokens`` (or the closest reachable length)."""
        return self.build(n_tokens, rng, serial)[0]

    def _serial(self, rng: random.Random, serial: int | None, space: int) -> int:
        """The run's input number; a random one when the caller keeps no count (then two
        markers collide with probability ~ inputs**2 / 2**41)."""
        return rng.randrange(space) if serial is None else serial

    def _lead(self, room: int, rng: random.Random, serial: int | None) -> tuple[str, int]:
        """Shared prefix and marker words (each one token) for an input with ``room``
        tokens besides the special ones: (text, tokens)."""
        mk = self._word_markers
        m = max(1, min(mk.length, room - len(self.prefix_ids)))
        digits = mk.digits(self._serial(rng, serial, mk.space), m)
        words = [self._first_words[digits[0]], *(self._after_words[d] for d in digits[1:])]
        lead = " ".join([self.prefix, *words]) if self.prefix else " ".join(words)
        return lead, len(self.prefix_ids) + m

    def build(self, n_tokens: int, rng: random.Random, serial: int | None = None
              ) -> tuple[str, int]:
        """Like ``text`` and also its measured token count."""
        target = max(n_tokens, self.min_len)
        lead, lead_n = self._lead(target - self.n_special, rng, serial)
        start = self._cut(target - lead_n, rng)[2]
        k = target - self.n_special - lead_n  # corpus tokens: a first guess, then measured
        if k <= 0:  # the marker fills the input
            return lead, self.count(lead)
        best, best_err = "", None
        for _ in range(12):
            end = min(start + max(k, 1), len(self._offsets)) - 1
            body = self._corpus[self._offsets[start][0]:self._offsets[end][1]].strip()
            text = f"{lead} {body}"
            got = self.count(text)
            err = got - target
            if best_err is None or abs(err) < abs(best_err):
                best, best_err = text, err
            if err == 0:
                return text, got
            k -= err if abs(err) > 1 else (1 if err > 0 else -1)
        return self._trim(best, target)

    def _cut(self, n_tokens: int, rng: random.Random) -> tuple[int, int, int]:
        """(target length, corpus tokens wanted, a random word start to cut from)."""
        target = max(n_tokens, self.n_special + 1)
        k = target - self.n_special
        if k + 64 > len(self._offsets):
            self._grow(2 * k)
        hi = bisect.bisect_right(self._starts, len(self._offsets) - k - 32) - 1
        return target, k, self._starts[rng.randint(0, max(hi, 0))]

    def _trim(self, text: str, target: int) -> tuple[str, int]:
        """Last resort: shed or add characters one at a time until the count matches."""
        got = self.count(text)
        while got > target and len(text) > 1:
            text = text[:-1].rstrip() or text[:1]
            got = self.count(text)
        pad = iter(" a" * 64)
        while got < target:
            nxt = next(pad, None)
            if nxt is None:
                break
            text += nxt
            got = self.count(text)
        return text, got

    def ids(self, n_tokens: int, rng: random.Random, serial: int | None = None) -> list[int]:
        """Token ids of exactly ``n_tokens`` (special tokens in place, EOS last for Qwen3):
        shared prefix, marker, then a slice of the encoded corpus, so that a load generator
        sending ids at thousands of requests/s does not spend its CPU tokenising."""
        if self._wrap is None:  # a template that does not wrap the text: tokenise a cut text
            return self._ids(self.text(n_tokens, rng, serial))
        target = max(n_tokens, self.min_len)
        room = target - self.n_special - len(self.prefix_ids)
        mk = self._id_markers
        m = min(mk.length, room)
        symbols = self._id_symbols
        marker = [symbols[d] for d in mk.digits(self._serial(rng, serial, mk.space), m)]
        start = self._cut(room - m + self.n_special, rng)[2]
        head, tail = self._wrap
        body = self._corpus_ids[start:start + room - m]
        return head + self.prefix_ids + marker + body + tail

    def _ids(self, text: str) -> list[int]:
        # encode_batch releases the GIL (encode does not): the event loop keeps running
        return list(self.tok.encode_batch([text])[0].ids)

    def encode(self, text: str, cap: int | None = None) -> list[int]:
        """Ids for a real text; when capped, keep the trailing special tokens."""
        ids = self._ids(text)
        if cap and len(ids) > cap:
            tail = ids[len(ids) - self.n_special:] if self.n_special else []
            ids = ids[: cap - len(tail)] + tail
        return ids


class WordBuilder:
    """No tokenizer: one word is taken as one token (approximate; said in the report).
    Inputs open with a marker of words, like ``TextBuilder``'s."""

    n_special = 0

    def __init__(self, seed: int = 0, prefix: str = "") -> None:
        self._words = corpus_text(40_000, seed).split(" ")
        self._vocab = sorted(set(_WORDS + _EXTRA))
        self._markers = Markers.covering(len(self._vocab), len(self._vocab), seed)
        self.prefix = prefix
        self.prefix_ids: list[int] = []
        self._prefix_words = prefix.split()

    @property
    def min_len(self) -> int:
        return len(self._prefix_words) + 1

    def count(self, text: str) -> int:
        return len(text.split())

    def build(self, n_tokens: int, rng: random.Random, serial: int | None = None
              ) -> tuple[str, int]:
        n = max(n_tokens, self.min_len)
        room = n - len(self._prefix_words)
        mk = self._markers
        m = min(mk.length, room)
        marker = [self._vocab[d] for d in
                  mk.digits(rng.randrange(mk.space) if serial is None else serial, m)]
        start = rng.randrange(len(self._words))
        body = [self._words[(start + i) % len(self._words)] for i in range(room - m)]
        return " ".join([*self._prefix_words, *marker, *body]), n
