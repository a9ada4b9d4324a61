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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class UnknownTokens:
    """The unknown tokens among an input's embedded ids and the characters they stand for."""

    tokens: int
    chars: int


@dataclass(frozen=True, slots=True)
class TokenizedInput:
    ids: list[int]
    original_tokens: int
    unknown: UnknownTokens | None = None

    @property
    def truncated(self) -> bool:
        return self.original_tokens > len(self.ids)


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
        unk = getattr(self._tok.model, "unk_token", None)
        self.unknown_id = self._tok.token_to_id(unk) if isinstance(unk, str) else None
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

    def encode_texts(self, texts: list[str], max_seq_len: int | None = None) -> list[TokenizedInput]:
        """Batched (parallel in Rust, releases the GIL); truncates every input to the cap (or to
        ``max_seq_len``, when a request asks for less)."""
        cap = self.max_seq_len if max_seq_len is None else min(self.max_seq_len, max_seq_len)
        budget = max(cap - len(self.prefix) - len(self.suffix), 1)
        frame = len(self.prefix) + len(self.suffix)
        unk = self.unknown_id
        out: list[TokenizedInput] = []
        for group in char_groups(texts, GROUP_CHARS):
            encodings = self._tok.encode_batch_fast(group, add_special_tokens=False)
            for text, enc in zip(group, encodings, strict=True):
                kept = enc.ids[:budget]
                unknown = self._unknown(text, len(kept)) if unk is not None and unk in kept else None
                out.append(TokenizedInput(self.prefix + kept + self.suffix, len(enc) + frame, unknown))
            del encodings  # before the next group's are made
        return out

    def _unknown(self, text: str, kept: int) -> UnknownTokens:
        """The unknown tokens among the first ``kept`` of ``text`` and the characters they
        cover (the fast batch encoding has no offsets, so this input is encoded again)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        spans = [end - start for t, (start, end) in zip(enc.ids[:kept], enc.offsets, strict=False)
                 if t == self.unknown_id]
        return UnknownTokens(len(spans), sum(spans))

    def frame_token_ids(self, ids: list[int]) -> TokenizedInput:
        """Client-sent ids are embedded as sent; when over-long, a leading prefix and a
        trailing suffix of special tokens that the client included are kept."""
        if len(ids) <= self.max_seq_len:
            return TokenizedInput(ids, len(ids))
        head = self.prefix if self.prefix and ids[: len(self.prefix)] == self.prefix else []
        tail = self.suffix if self.suffix and ids[-len(self.suffix) :] == self.suffix else []
        body = ids[len(head) : len(ids) - len(tail)]
        keep = self.max_seq_len - len(head) - len(tail)
        return TokenizedInput(head + body[:keep] + tail, len(ids))
