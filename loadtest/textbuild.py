"""Build inputs of an exact length in the target model's tokens.

Lengths count what the server embeds: the tokenizer's special tokens included (for
Qwen3-Embedding the trailing ``<|endoftext|>``, for BERT ``[CLS]`` and ``[SEP]``).
Texts are cut from a deterministic pseudo-English corpus at a random word, so no two
requests share a prefix (prefix caches on the server see realistic misses).
"""

from __future__ import annotations

import bisect
import random
from pathlib import Path
from typing import Any

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


def load_tokenizer(path: str | Path) -> Any:
    """A ``tokenizers.Tokenizer`` from a tokenizer.json file or a model folder holding one."""
    from tokenizers import Tokenizer

    p = Path(path).expanduser()
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
    """Cuts texts (or token ids) of exactly N tokens, special tokens included."""

    def __init__(self, tokenizer: Any, seed: int = 0, min_corpus_tokens: int = 4096) -> None:
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
        self._corpus = ""
        self._corpus_ids: list[int] = []
        self._offsets: list[tuple[int, int]] = []
        self._starts: list[int] = []  # token indices that begin a word
        self._grow(min_corpus_tokens)

    @property
    def min_len(self) -> int:
        return self.n_special + 1

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
        self._starts = [i for i, (s, _) in enumerate(self._offsets)
                        if s == 0 or text[s - 1] == " "]

    def count(self, text: str) -> int:
        """Tokens the server will embed for this text (special tokens included)."""
        return len(self._ids(text))

    def text(self, n_tokens: int, rng: random.Random) -> str:
        """A text that encodes to exactly ``n_tokens`` (or the closest reachable length)."""
        return self.build(n_tokens, rng)[0]

    def build(self, n_tokens: int, rng: random.Random) -> tuple[str, int]:
        """Like ``text`` and also its measured token count."""
        target, k, start = self._cut(n_tokens, rng)
        best, best_err = "", None
        for _ in range(12):
            end = min(start + max(k, 1), len(self._offsets)) - 1
            text = self._corpus[self._offsets[start][0]:self._offsets[end][1]].strip()
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
        target = max(n_tokens, self.min_len)
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

    def ids(self, n_tokens: int, rng: random.Random) -> list[int]:
        """Token ids of exactly ``n_tokens`` (special tokens in place, EOS last for Qwen3):
        a slice of the encoded corpus, so that a load generator sending ids at thousands of
        requests/s does not spend its CPU tokenising."""
        if self._wrap is None:  # a template that does not wrap the text: tokenise a cut text
            return self._ids(self.text(n_tokens, rng))
        _, k, start = self._cut(n_tokens, rng)
        head, tail = self._wrap
        return head + self._corpus_ids[start:start + k] + tail  # k >= 1: min_len

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
    """No tokenizer: one word is taken as one token (approximate; said in the report)."""

    n_special = 0
    min_len = 1

    def __init__(self, seed: int = 0) -> None:
        self._words = corpus_text(40_000, seed).split(" ")

    def count(self, text: str) -> int:
        return len(text.split())

    def build(self, n_tokens: int, rng: random.Random) -> tuple[str, int]:
        n = max(1, n_tokens)
        start = rng.randrange(len(self._words))
        return " ".join(self._words[(start + i) % len(self._words)] for i in range(n)), n
