"""Token ids of query-document pairs for rerankers, truncated to the cap as Hugging Face does it.

- ``CrossEncoderPairs``: ``[CLS] query [SEP] document [SEP]`` (or the model's own pair frame,
  ``<s> q </s></s> d </s>`` for XLM-R), cut with ``longest_first`` (a token off the longer side
  until the pair fits), what ``tokenizer(query, document, truncation=True)`` gives;
- ``YesNoPrompts``: Qwen3-Reranker's prompt (its system line, then ``<Instruct>: ... <Query>:
  ... <Document>: ...`` and the assistant turn), its middle cut at the end to fit, as the model
  card's code does.

Text is tokenised with its special tokens taken as plain text (``encode_special_tokens``): a
document that spells ``[SEP]`` or ``<|im_end|>`` cannot move the pair's frame. That frame is
what the CPU engine reads a BERT pair's segments from (type 1 after the first ``[SEP]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from embedserve.core.tokenize import UnknownCounter, UnknownTokens, unknown_id

#: Qwen3-Reranker's prompt, from its model card.
QWEN3_RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
QWEN3_RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANK_TEMPLATE = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
#: The template up to its document, tokenised once per query: Qwen3's pre-tokenizer always splits
#: between that colon and the space after it, so a prompt's ids are the head's, then " {document}"'s.
QWEN3_RERANK_HEAD = QWEN3_RERANK_TEMPLATE.split(" {document}")[0]
QWEN3_RERANK_TASK = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass(frozen=True)
class PairIds:
    ids: list[int]
    original_tokens: int
    unknown: UnknownTokens | None = None  # among the query's and the document's kept tokens


def load_tokenizer(model_dir: Path, plain_specials: bool) -> Tokenizer:
    """The model's ``tokenizer.json`` without its own truncation and padding; with
    ``plain_specials``, special tokens in the text are split as text."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = plain_specials
    return tok


def label_ids(model_dir: Path) -> tuple[int, int]:
    """Qwen3-Reranker's "no" and "yes" token ids, as its model card looks them up."""
    tok = load_tokenizer(model_dir, plain_specials=False)
    no, yes = tok.token_to_id("no"), tok.token_to_id("yes")
    if no is None or yes is None:
        raise ValueError(f"{model_dir}'s tokenizer has no single 'yes' and 'no' tokens")
    return no, yes


def longest_first(a: int, b: int, budget: int) -> tuple[int, int]:
    """How many tokens of each side Hugging Face's ``longest_first`` keeps of a pair over its
    ``budget`` (the tokenizers library's rule): the shorter side keeps what it has when the longer
    one can give up the rest, else each keeps about half."""
    if a + b <= budget:
        return a, b
    swap = a > b
    n1, n2 = (b, a) if swap else (a, b)  # n1: the shorter side
    n2 = n1 if n1 > budget else max(n1, budget - n1)
    if n1 + n2 > budget:
        n1 = budget // 2
        n2 = n1 + budget % 2
    if swap:
        n1, n2 = n2, n1
    return min(a, n1), min(b, n2)


class CrossEncoderPairs:
    """Thread-safe after construction; CPU-heavy: call off the event loop."""

    def __init__(self, model_dir: Path, max_seq_len: int) -> None:
        self._tok = load_tokenizer(model_dir, plain_specials=True)
        self.max_seq_len = max_seq_len
        self.prefix, self.middle, self.suffix = self._pair_frame()
        self.unknowns = UnknownCounter(self._tok, unknown_id(self._tok))

    def _pair_frame(self) -> tuple[list[int], list[int], list[int]]:
        a = self._tok.encode("a", add_special_tokens=False).ids
        b = self._tok.encode("b", add_special_tokens=False).ids
        full = self._tok.encode("a", "b").ids
        at_a = next(i for i in range(len(full)) if full[i : i + len(a)] == a)
        at_b = next(i for i in range(at_a + len(a), len(full)) if full[i : i + len(b)] == b)
        return full[:at_a], full[at_a + len(a) : at_b], full[at_b + len(b) :]

    @property
    def frame(self) -> int:
        return len(self.prefix) + len(self.middle) + len(self.suffix)

    def encode(
        self,
        queries: list[str],
        documents: list[str],
        query_of: list[int],
        cap: int | None = None,
        document_cap: int | None = None,
    ) -> list[PairIds]:
        """``cap``: a request's own, lower limit for a pair (special tokens included);
        ``document_cap``: for a document's own tokens."""
        limit = min(self.max_seq_len, cap or self.max_seq_len)
        budget = max(limit - self.frame, 2)
        unknowns = self.unknowns
        q_ids = [e.ids for e in self._tok.encode_batch_fast(queries, add_special_tokens=False)]
        cut = []  # each pair's query and document ids as kept, and its length uncut
        encoded, with_offsets = unknowns.encode(documents)
        for enc, qi in zip(encoded, query_of, strict=True):
            q, d = q_ids[qi], enc.ids
            original = len(q) + len(d) + self.frame
            d = d[:document_cap] if document_cap else d
            nq, nd = longest_first(len(q), len(d), budget)
            cut.append((qi, q[:nq], d[:nd], original))
        kept_queries = sorted({(qi, len(q)) for qi, q, _, _ in cut})  # a query once per length kept
        found = unknowns.count([queries[qi] for qi, _ in kept_queries],
                               [q_ids[qi][:n] for qi, n in kept_queries])
        of_query = dict(zip(kept_queries, found, strict=True))
        in_queries = [of_query[(qi, len(q))] for qi, q, _, _ in cut]
        in_documents = unknowns.count(documents, [c[2] for c in cut], encoded if with_offsets else None)
        return [
            PairIds(self.prefix + q + self.middle + d + self.suffix, original, UnknownTokens.of(uq, ud))
            for (_, q, d, original), uq, ud in zip(cut, in_queries, in_documents, strict=True)
        ]


class YesNoPrompts:
    """Qwen3-Reranker's prompts as token ids; thread-safe after construction."""

    def __init__(self, model_dir: Path, max_seq_len: int) -> None:
        plain = load_tokenizer(model_dir, plain_specials=False)
        self._tok = load_tokenizer(model_dir, plain_specials=True)
        self.prefix = plain.encode(QWEN3_RERANK_PREFIX, add_special_tokens=False).ids
        self.suffix = plain.encode(QWEN3_RERANK_SUFFIX, add_special_tokens=False).ids
        self.max_seq_len = max_seq_len
        if len(self.prefix) + len(self.suffix) >= max_seq_len:
            raise ValueError(f"max_seq_len {max_seq_len} leaves no room for Qwen3-Reranker's prompt")

    def _cut_documents(self, documents: list[str], tokens: int) -> tuple[list[str], list[int]]:
        """Each document cut to its first ``tokens`` tokens (at the end of the last one's
        characters), and how many tokens each lost."""
        cut, lost = [], []
        for text, enc in zip(
            documents, self._tok.encode_batch(documents, add_special_tokens=False), strict=True
        ):
            over = len(enc.ids) > tokens
            cut.append(text[: enc.offsets[tokens - 1][1]] if over else text)
            lost.append(len(enc.ids) - tokens if over else 0)
        return cut, lost

    def encode(
        self,
        queries: list[str],
        documents: list[str],
        query_of: list[int],
        instruction: str | None,
        cap: int | None = None,
        document_cap: int | None = None,
    ) -> list[PairIds]:
        """``cap``: a request's own, lower limit for a prompt; ``document_cap``: for a document."""
        lost = [0] * len(documents)
        if document_cap:
            documents, lost = self._cut_documents(documents, document_cap)
        task = instruction or QWEN3_RERANK_TASK
        asked = sorted(set(query_of))
        heads = [QWEN3_RERANK_HEAD.format(instruction=task, query=queries[q]) for q in asked]
        encoded = self._tok.encode_batch_fast(heads, add_special_tokens=False)
        head_ids = {q: e.ids for q, e in zip(asked, encoded, strict=True)}
        limit = min(self.max_seq_len, cap or self.max_seq_len)
        frame = len(self.prefix) + len(self.suffix)
        budget = max(limit - frame, 1)
        bodies = self._tok.encode_batch_fast([" " + d for d in documents], add_special_tokens=False)
        prompts = [head_ids[q] + e.ids for q, e in zip(query_of, bodies, strict=True)]
        return [
            PairIds(self.prefix + ids[:budget] + self.suffix, len(ids) + frame + extra)
            for ids, extra in zip(prompts, lost, strict=True)
        ]
