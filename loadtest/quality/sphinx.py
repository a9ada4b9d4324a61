"""Sections of a Sphinx HTML page: each ``<section id>``'s heading and its own text.

Sphinx (the Python documentation, python3-doc) writes every section as ``<section id=...>``
opening with an ``<h1>``..``<h6>``; subsections nest inside. A section's own text is what
lies in it outside its heading and outside its subsections, so each passage is written once.
Code blocks (``<pre>``), scripts and the headings' permalink marks are left out: the corpus
is prose, and a heading's words appear in no passage through its own markup.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from html import unescape
from html.parser import HTMLParser

HEADINGS = frozenset({"h1", "h2", "h3", "h4", "h5", "h6"})
SKIPPED = frozenset({"pre", "script", "style", "template"})
# elements that end a run of words: without a space here, "</p><p>" would glue two words
BREAKS = frozenset({"p", "li", "dt", "dd", "div", "br", "tr", "td", "th", "table", "ul", "ol",
                    "dl", "blockquote", "section", *HEADINGS})
VOID = frozenset({"br", "img", "hr", "meta", "link", "input", "wbr", "col", "area", "base", "source"})
SECTION_NUMBER = re.compile(r"^\s*(?:\d+\.)+\d*\s+")  # "3.1.2. Strings" -> "Strings"


@dataclass
class Section:
    """One section of one page: its anchor, heading, and own words."""

    anchor: str
    heading: str = ""
    words: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return " ".join(self.words)


def clean_heading(text: str) -> str:
    """A heading as a reader says it: whitespace collapsed, no section number, no pilcrow."""
    return SECTION_NUMBER.sub("", " ".join(text.replace("\u00b6", " ").split()))


class SectionParser(HTMLParser):
    """Collects :class:`Section` objects in document order (parents before children)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.sections: list[Section] = []
        self._open: list[Section] = []  # innermost last
        self._heading: list[str] | None = None  # words of a heading being read
        self._heading_tag = ""
        self._skip_tag = ""  # an element whose content is dropped, and its nesting depth
        self._skip_depth = 0
        self._pending = ""  # a word cut by an inline tag ("re<em>use</em>d")

    # -- text ---------------------------------------------------------------------------
    def _flush(self) -> None:
        if self._pending and self._open:
            target = self._heading if self._heading is not None else self._open[-1].words
            target.append(self._pending)
        self._pending = ""

    def handle_data(self, data: str) -> None:
        if self._skip_depth or not self._open:
            return
        parts = data.split()
        if not parts:
            if data:
                self._flush()
            return
        if data[0].isspace():
            self._flush()
        parts[0] = self._pending + parts[0]
        self._pending = "" if data[-1].isspace() else parts.pop()
        target = self._heading if self._heading is not None else self._open[-1].words
        target.extend(parts)

    # -- structure ----------------------------------------------------------------------
    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self._skip_depth:
            self._skip_depth += tag == self._skip_tag and tag not in VOID
            return
        classes = (dict(attrs).get("class") or "").split()
        if tag in SKIPPED or (tag == "a" and "headerlink" in classes):
            self._flush()
            self._skip_tag, self._skip_depth = tag, 1
            return
        if tag in BREAKS:
            self._flush()
        if tag == "section":
            section = Section(anchor=dict(attrs).get("id") or "")
            self.sections.append(section)
            self._open.append(section)
        elif tag in HEADINGS and self._open and not self._open[-1].heading and self._heading is None:
            self._heading, self._heading_tag = [], tag

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in BREAKS and not self._skip_depth:
            self._flush()

    def handle_endtag(self, tag: str) -> None:
        if self._skip_depth:
            if tag == self._skip_tag:
                self._skip_depth -= 1
            return
        if tag in BREAKS:
            self._flush()
        if tag == self._heading_tag and self._heading is not None:
            self._open[-1].heading = clean_heading(" ".join(self._heading))
            self._heading, self._heading_tag = None, ""
        elif tag == "section" and self._open:
            self._open.pop()


def page_sections(html: str) -> list[Section]:
    """Every section of a page with a heading, in document order."""
    parser = SectionParser()
    parser.feed(html)
    parser.close()
    return [s for s in parser.sections if s.heading]


def page_title(html: str) -> str:
    """The page's ``<title>`` text (the documentation's version is in the index page's)."""
    found = re.search(r"<title>(.*?)</title>", html, re.S | re.I)
    return " ".join(unescape(found.group(1)).split()) if found else ""
