"""``embedserve quality-corpus``: a retrieval corpus with ground truth, from real
documentation available offline (Debian's python3-doc: the Python documentation as HTML).

    apt-get install python3-doc
    embedserve quality-corpus --out python-docs.json                  # every usable section
    embedserve quality-corpus --out small.json --max-passages 300     # a small one, for CI

Each section of each page gives one passage and one query:

- **query**: the section's heading ("Decimal objects", "Using Python as a Calculator");
- **passage**: the section's own text (not its subsections', not its code blocks), its first
  ``--max-passage-words`` words, with the heading taken out, so retrieving it takes more
  than finding the heading's string;
- **dropped**: a heading that two sections share ("Examples", "Functions"), whose right
  answer would be ambiguous; a heading shorter than ``--min-query-words``; a passage shorter
  than ``--min-passage-words``, or one whose text another section has too.

Pages are read in path order and sections in document order, so the same HTML gives the same
corpus, byte for byte. ``--max-passages N`` keeps N usable sections chosen by a hash of their
ids (spread over all pages, the same on every run); a smaller corpus is an easier one, so
compare figures only between results with the same corpus fingerprint.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from embedserve.contracts.quality import Corpus, CorpusInfo, Passage, Query
from embedserve.loadtest.quality.flags import OneLineParser, at_least, parse
from embedserve.loadtest.quality.sphinx import page_sections, page_title

DEFAULT_HTML = Path("/usr/share/doc/python3-doc/html")
# pages that index or list other pages (their sections are links, not text) or log changes
EXCLUDED_PAGES = ("contents.html", "search.html", "py-modindex.html", "download.html",
                  "whatsnew/changelog.html")


@dataclass(frozen=True)
class CutRules:
    """What makes a section a passage and its heading a query."""

    min_passage_words: int = 20
    max_passage_words: int = 200
    min_query_words: int = 2
    max_passages: int | None = None


@dataclass(frozen=True)
class _Candidate:
    id: str
    heading: str
    text: str
    words: int


def html_pages(root: Path) -> list[Path]:
    """The documentation's pages in path order: no index pages, nothing under ``_*``."""
    found = []
    for path in sorted(root.rglob("*.html")):
        rel = path.relative_to(root).as_posix()
        if any(part.startswith("_") for part in rel.split("/")):
            continue
        if rel in EXCLUDED_PAGES or rel.startswith("genindex"):
            continue
        found.append(path)
    return found


def _spread(ident: str) -> str:
    return hashlib.sha256(ident.encode()).hexdigest()


def build_corpus(root: Path, rules: CutRules = CutRules()) -> Corpus:
    """The corpus of the Sphinx HTML tree at ``root``; ValueError when nothing usable is there."""
    pages = html_pages(root)
    if not pages:
        raise ValueError(f"{root}: no HTML pages")
    sections: list[_Candidate] = []
    for path in pages:
        rel = path.relative_to(root).as_posix()
        for found in page_sections(path.read_text(encoding="utf-8", errors="replace")):
            sections.append(_Candidate(f"{rel}#{found.anchor}", found.heading,
                                       " ".join(found.words[: rules.max_passage_words]), len(found.words)))
    headings = Counter(s.heading.casefold() for s in sections)
    texts = Counter(s.text for s in sections)
    ids = Counter(s.id for s in sections)
    dropped: Counter[str] = Counter()
    kept: list[_Candidate] = []
    for s in sections:
        why = ("id_not_unique" if ids[s.id] > 1 else
               "heading_shared" if headings[s.heading.casefold()] > 1 else
               "query_too_short" if len(s.heading.split()) < rules.min_query_words else
               "passage_too_short" if s.words < rules.min_passage_words else
               "passage_shared" if texts[s.text] > 1 else None)
        if why:
            dropped[why] += 1
        else:
            kept.append(s)
    if rules.max_passages is not None and len(kept) > rules.max_passages:
        chosen = set(sorted((s.id for s in kept), key=_spread)[: rules.max_passages])
        dropped["over_max_passages"] = len(kept) - len(chosen)
        kept = [s for s in kept if s.id in chosen]
    if len(kept) < 2:
        raise ValueError(f"{root}: fewer than 2 sections have a unique heading and a passage of "
                         f"at least {rules.min_passage_words} words")
    index = root / "index.html"
    info = CorpusInfo(
        source=str(root),
        source_title=page_title(index.read_text(errors="replace")) if index.exists() else "",
        builder={"min_passage_words": rules.min_passage_words,
                 "max_passage_words": rules.max_passage_words,
                 "min_query_words": rules.min_query_words,
                 "max_passages": rules.max_passages or 0},
        pages=len(pages),
        sections_seen=len(sections),
        dropped=dict(sorted(dropped.items())),
        passage_words_median=statistics.median(len(s.text.split()) for s in kept),
        query_words_median=statistics.median(len(s.heading.split()) for s in kept),
        queries_verbatim_in_passage=sum(s.heading.casefold() in s.text.casefold() for s in kept),
    )
    return Corpus(info=info,
                  passages=[Passage(id=s.id, text=s.text) for s in kept],
                  queries=[Query(id=s.id, text=s.heading, relevant=[s.id]) for s in kept])


def load_corpus(path: Path) -> Corpus:
    """A corpus file written by :func:`write_corpus`; ValueError naming the file otherwise."""
    try:
        return Corpus.model_validate_json(path.read_bytes())
    except OSError as exc:
        raise ValueError(f"--corpus {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        first = str(exc).splitlines()[0]
        raise ValueError(f"--corpus {path} is not a corpus written by embedserve quality-corpus "
                         f"({first})") from None


def write_corpus(corpus: Corpus, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(corpus.model_dump_json(indent=None) + "\n")


def describe(corpus: Corpus) -> str:
    """One line of what is in it."""
    i = corpus.info
    topics = len({p.id.split("#", 1)[0] for p in corpus.passages})
    passage_words = statistics.median(len(p.text.split()) for p in corpus.passages)
    query_words = statistics.median(len(q.text.split()) for q in corpus.queries)
    return (f"{len(corpus.passages)} passages from {topics} pages ({i.source_title or i.source}), "
            f"{len(corpus.queries)} queries; median {passage_words:g} words a passage, "
            f"{query_words:g} a query; fingerprint {corpus.fingerprint()}")


def build_parser() -> OneLineParser:
    ap = OneLineParser(prog="embedserve quality-corpus", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--html", type=Path, default=DEFAULT_HTML,
                    help=f"a Sphinx HTML tree (default: python3-doc's, {DEFAULT_HTML})")
    ap.add_argument("--out", type=Path, required=True, help="the corpus file to write (JSON)")
    ap.add_argument("--max-passages", type=at_least(2), help="keep this many (hash-chosen)")
    ap.add_argument("--min-passage-words", type=at_least(1), default=CutRules.min_passage_words)
    ap.add_argument("--max-passage-words", type=at_least(1), default=CutRules.max_passage_words)
    ap.add_argument("--min-query-words", type=at_least(1), default=CutRules.min_query_words)
    return ap


def main(argv: list[str] | None = None) -> int:
    """0 when the corpus is written, 2 on a bad flag or a folder without usable pages."""
    a = parse(build_parser(), argv)
    if isinstance(a, int):
        return a
    if not a.html.is_dir():
        hint = " (apt-get install python3-doc)" if a.html == DEFAULT_HTML else ""
        print(f"embedserve quality-corpus: --html {a.html} is not a folder{hint}", file=sys.stderr)
        return 2
    rules = CutRules(a.min_passage_words, a.max_passage_words, a.min_query_words, a.max_passages)
    try:
        corpus = build_corpus(a.html, rules)
    except ValueError as exc:
        print(f"embedserve quality-corpus: {exc}", file=sys.stderr)
        return 2
    write_corpus(corpus, a.out)
    print(f"{a.out}: {describe(corpus)}")
    return 0
