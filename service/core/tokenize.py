"""Tokenise with the model's own ``tokenizer.json`` and truncate so special tokens survive.

We use the ``tokenizers`` library directly (``transformers`` would import torch). Content is
encoded without special tokens, cut to ``max_seq_len`` minus the model's frame (CLS/SEP for
BERT, the trailing EOS that Qwen3-Embedding's last-token pooling reads), then framed: the
same result as Hugging Face's ``truncation=True, max_length=max_seq_len``.

Text the tokenizer cannot spell becomes its unknown token (WordPiece, as in all-MiniLM-L6-v2,
turns a whole word into ``[UNK]`` when it has a character outside the vocabulary or is over
100 characters long: a 200,000-character string without spaces is one token). The model sees
none of that text, so each input is checked for the unknown id (a scan of ids already made);
only an input that holds it is tokenised again, with character offsets, to count the
characters lost. A byte-level tokenizer (Qwen3's) has no unknown token and skips all of it.
"""

from __future__ import annotations

import json
import logging
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Encoding, Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class UnknownTokens:
    """The unknown tokens among an input's embedded ids and the characters they stand for."""

    tokens: int
    chars: int

    @staticmethod
    def of(*parts: UnknownTokens | None) -> UnknownTokens | None:
        """The parts together (a pair's query and document), None when none has any."""
        found = [p for p in parts if p]
        return UnknownTokens(sum(p.tokens for p in found), sum(p.chars for p in found)) if found else None


@dataclass(frozen=True, slots=True)
class ItemTokens:
    """What a request reports for one of its items (an input embedded, a pair scored): its
    tokens before and after truncation, and the unknown tokens among those kept."""

    original_tokens: int
    kept_tokens: int
    unknown: UnknownTokens | None = None

    @property
    def truncated(self) -> bool:
        return self.original_tokens > self.kept_tokens


@dataclass(frozen=True, slots=True)
class TokenizedInput:
    ids: list[int]
    original_tokens: int
    unknown: UnknownTokens | None = None
    content: list[int] | None = None  # all of a cut input's content ids, when asked for (``whole``)

    @property
    def truncated(self) -> bool:
        return self.original_tokens > len(self.ids)

    def item(self) -> ItemTokens:
        """Embedded whole (``content``, in windows): nothing of it was cut."""
        kept = self.original_tokens if self.content is not None else len(self.ids)
        return ItemTokens(self.original_tokens, kept, self.unknown)


#: Above this share of texts that hold the unknown token, one encoding with character offsets
#: costs less than the fast one (no offsets) plus a second, with offsets, of each such text: the
#: offsets add about a quarter to a batch call (32 passages of 128 words, all-MiniLM-L6-v2).
OFFSETS_FIRST_ABOVE = 0.2
#: Each text's weight in the running share: about the last hundred texts count.
TEXT_WEIGHT = 0.01


class UnknownCounter:
    """A tokenizer's batch encoding (no special tokens) and the unknown tokens among each text's
    kept ids, with the characters they stand for. The fast encoding has no character offsets, so
    the texts that hold the unknown id are encoded again, with offsets. Where most texts hold it
    (a script the vocabulary lacks, sent to an English WordPiece model: each such text would be
    encoded twice), the first encoding has offsets instead. Which one is a running share of the
    texts seen; a tokenizer with no unknown token (byte-level BPE) always takes the fast one.
    Thread-safe (a lost update of the share only delays the switch)."""

    def __init__(self, tok: Tokenizer, unknown_id: int | None) -> None:
        self._tok, self.unknown_id = tok, unknown_id
        self.share = 0.0

    def encode(self, texts: list[str]) -> tuple[list[Encoding], bool]:
        """The encodings, and whether they carry character offsets."""
        offsets = self.unknown_id is not None and self.share > OFFSETS_FIRST_ABOVE
        encode = self._tok.encode_batch if offsets else self._tok.encode_batch_fast
        return encode(texts, add_special_tokens=False), offsets

    def count(
        self, texts: list[str], kept: list[list[int]], encodings: list[Encoding] | None = None,
        spans: list[list[tuple[int, int]] | None] | None = None,
    ) -> list[UnknownTokens | None]:
        """The unknown tokens among each text's ``kept`` ids (its first ones, or the ``spans`` of
        its ids they were taken from) and the characters they cover; None for a text with none.
        ``encodings``: the texts' own, with offsets (else the texts that hold the unknown id are
        encoded again, together in one batch call, parallel in Rust)."""
        out: list[UnknownTokens | None] = [None] * len(texts)
        if self.unknown_id is None or not texts:
            return out
        todo = [i for i, k in enumerate(kept) if self.unknown_id in k]
        keep = (1 - TEXT_WEIGHT) ** len(texts)
        self.share = self.share * keep + len(todo) / len(texts) * (1 - keep)
        again = [] if encodings or not todo else self._tok.encode_batch([texts[i] for i in todo],
                                                                        add_special_tokens=False)
        unknown = self.unknown_id
        for n, i in enumerate(todo):
            enc = encodings[i] if encodings else again[n]
            ids, offsets = enc.ids, enc.offsets  # each read of these builds a new list: once, not per token
            where = (spans[i] if spans else None) or [(0, min(len(kept[i]), len(ids)))]
            found = [offsets[t] for start, stop in where for t in range(start, stop) if ids[t] == unknown]
            out[i] = UnknownTokens(len(found), sum(end - start for start, end in found))
        return out


def unknown_id(tok: Tokenizer) -> int | None:
    """The id of the tokenizer's unknown token (WordPiece's ``[UNK]``); None for one that has none."""
    unk = getattr(tok.model, "unk_token", None)
    return tok.token_to_id(unk) if isinstance(unk, str) else None


def blank(text: str) -> bool:
    """Nothing to embed: only whitespace, control and format characters (NUL, a zero-width
    space, a byte-order mark). WordPiece drops them all, so such a text would embed as an empty
    one; it is refused like ``" "`` instead."""
    return all(c.isspace() or unicodedata.category(c) in ("Cc", "Cf") for c in text)


#: The characters one batch call tokenises at most. The call's encodings (ids, offsets, the
#: token strings: about 100 bytes a token) all live until it returns, so four 13 MiB bodies at
#: once took the gateway to 790 MiB; in groups, to 335 (results/gateway-memory-cpu/).
#: Ordinary requests (2,048 inputs of 400 characters) are one group, tokenised in parallel.
GROUP_CHARS = 1 << 20


def char_groups(texts: list[str], max_chars: int) -> Iterator[list[str]]:
    """``texts`` in order, in runs of at most ``max_chars`` characters (a longer text alone)."""
    start, size = 0, 0
    for i, text in enumerate(texts):
        if i > start and size + len(text) > max_chars:
            yield texts[start:i]
            start, size = i, 0
        size += len(text)
    if start < len(texts):
        yield texts[start:]


def _read_json(path: Path) -> dict[str, object]:
    return json.loads(path.read_text()) if path.exists() else {}


class ModelTokenizer:
    """Thread-safe after construction; ``encode_texts`` is CPU-heavy: call it off the loop."""

    def __init__(self, model_dir: Path, max_seq_len: int) -> None:
        self._tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._tok.no_truncation()
        self._tok.no_padding()
        self.max_seq_len = max_seq_len
        model_vocab = _read_json(model_dir / "config.json").get("vocab_size")
        self.vocab_size = model_vocab if isinstance(model_vocab, int) else self._tok.get_vocab_size(True)
        # Qwen3-Embedding-4B has 151,665 embedding rows and a tokenizer of 151,669 tokens: a
        # text that spells one of the last four cannot be embedded.
        self.exceeds_vocab = self._tok.get_vocab_size(True) > self.vocab_size
        self.unknowns = UnknownCounter(self._tok, unknown_id(self._tok))
        self.prefix, self.suffix = self._special_frame()
        if not self.suffix and self._pools_last_token(model_dir):
            eos = self._eos_id(model_dir)
            if eos is not None:
                log.warning("tokenizer adds no EOS but the model pools the last token: appending it")
                self.suffix = [eos]
        if len(self.prefix) + len(self.suffix) >= max_seq_len:
            raise ValueError(f"max_seq_len {max_seq_len} leaves no room for content")

    def _special_frame(self) -> tuple[list[int], list[int]]:
        content = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a").ids
        for start in range(len(full) - len(content) + 1):
            if full[start : start + len(content)] == content:
                return full[:start], full[start + len(content) :]
        return [], []

    @staticmethod
    def _pools_last_token(model_dir: Path) -> bool:
        return bool(_read_json(model_dir / "1_Pooling" / "config.json").get("pooling_mode_lasttoken"))

    def _eos_id(self, model_dir: Path) -> int | None:
        eos = _read_json(model_dir / "tokenizer_config.json").get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        return self._tok.token_to_id(eos) if isinstance(eos, str) else None

    def token_text(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id) or str(token_id)

    def encode_texts(
        self, texts: list[str], max_seq_len: int | None = None, whole: bool = False,
        from_start: bool = False, keep_head: int = 0,
    ) -> list[TokenizedInput]:
        """Batched (parallel in Rust, releases the GIL); truncates every input to the cap (or to
        ``max_seq_len``, when a request asks for less), cutting its end, or with ``from_start``
        its start but for the first ``keep_head`` content tokens (a query's instruction).
        ``whole``: a cut input keeps all its content ids too, and its unknown tokens are counted
        over all of them (it is embedded whole, in windows: ``gateway/long_inputs.py``)."""
        cap = self.max_seq_len if max_seq_len is None else min(self.max_seq_len, max_seq_len)
        budget = max(cap - len(self.prefix) - len(self.suffix), 1)
        frame = len(self.prefix) + len(self.suffix)
        out: list[TokenizedInput] = []
        for group in char_groups(texts, GROUP_CHARS):
            encodings, with_offsets = self.unknowns.encode(group)
            cut: list[tuple[list[int], list[int]]] = []  # each input's ids and the ids it keeps
            seen: list[list[int]] = []
            where: list[list[tuple[int, int]] | None] = []
            for enc in encodings:
                ids = enc.ids
                kept = ids[:budget]
                spans = [(0, len(kept))]
                if from_start and len(ids) > budget:
                    head = min(keep_head, budget)
                    spans = [(0, head), (len(ids) - (budget - head), len(ids))]
                    kept = ids[:head] + ids[spans[1][0]:]
                cut.append((ids, kept))
                seen.append(ids if whole else kept)
                where.append([(0, len(ids))] if whole else spans)
            own = encodings if with_offsets else None
            del encodings  # fast ones: before any text is encoded again
            unknown = self.unknowns.count(group, seen, own, where)
            del own  # before the next group's are made
            for (ids, kept), unk in zip(cut, unknown, strict=True):
                content = ids if whole and len(ids) > budget else None
                out.append(TokenizedInput(self.prefix + kept + self.suffix, len(ids) + frame, unk, content))
        return out

    def offsets(self, texts: list[str]) -> list[list[tuple[int, int]]]:
        """Each text's content tokens (as ``encode_texts`` makes them), as character spans
        ``[start, end)``: what late chunking maps its chunks onto."""
        return [
            enc.offsets
            for group in char_groups(texts, GROUP_CHARS)
            for enc in self._tok.encode_batch(group, add_special_tokens=False)
        ]

    def count(self, text: str) -> int:
        """Content tokens of ``text`` (no special tokens)."""
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def frame_token_ids(self, ids: list[int], from_start: bool = False) -> TokenizedInput:
        """Client-sent ids are embedded as sent; when over-long, a leading prefix and a
        trailing suffix of special tokens that the client included are kept, and the rest cut
        at its end (or its start)."""
        if len(ids) <= self.max_seq_len:
            return TokenizedInput(ids, len(ids))
        head = self.prefix if self.prefix and ids[: len(self.prefix)] == self.prefix else []
        tail = self.suffix if self.suffix and ids[-len(self.suffix) :] == self.suffix else []
        body = ids[len(head) : len(ids) - len(tail)]
        keep = self.max_seq_len - len(head) - len(tail)
        kept = body[len(body) - keep :] if from_start else body[:keep]
        return TokenizedInput(head + kept + tail, len(ids))
