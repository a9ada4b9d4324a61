"""The corpus builder on a tiny Sphinx-like HTML tree written here, and on Debian's
python3-doc (the small corpus CI builds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from embedserve.loadtest.quality import corpus as qc
from embedserve.loadtest.quality.sphinx import page_sections
from tests.conftest import HOWTO_RULES, python3_doc_howto

WORDS = ["lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed", "do",
         "eiusmod", "tempor"]


def words(n: int, topic: str) -> str:
    return " ".join(f"{topic}{WORDS[i % len(WORDS)]}" for i in range(n))


PAGE_A = f"""<html><head><title>Alpha &#8212; docs</title></head><body>
<div class="sphinxsidebar"><p>{words(30, "side")}</p></div>
<div class="body" role="main">
<section id="alpha-module">
<h1><span class="section-number">1.2. </span>Alpha module guide<a class="headerlink"
 href="#alpha-module">¶</a></h1>
<p>The alpha module re<em>use</em>d {words(24, "a")}</p>
<div class="highlight"><pre><span>print</span>("code is left out")</pre></div>
<dl><dt>alpha.run(<em>x</em>)</dt><dd><p>Runs&nbsp;things.</p></dd></dl>
<section id="examples"><h2>Examples<a class="headerlink" href="#examples">¶</a></h2>
<p>{words(25, "ex")}</p></section>
<section id="tiny"><h2>Tiny section here</h2><p>only five words are here</p></section>
</section></div></body></html>"""

PAGE_B = f"""<html><body><div class="body">
<section id="beta-things"><h1>Beta things explained</h1>
<p>{words(30, "b")}</p>
<section id="examples"><h2>Examples</h2><p>{words(25, "exb")}</p></section>
<section id="word"><h2>Word</h2><p>{words(25, "w")}</p></section>
<section id="copy-one"><h2>First copy</h2><p>{words(22, "dup")}</p></section>
<section id="copy-two"><h2>Second copy</h2><p>{words(22, "dup")}</p></section>
<section id="gamma"><h2>Gamma extra notes</h2><p>{words(21, "g")}</p></section>
</section></div></body></html>"""


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "library").mkdir()
    (tmp_path / "library" / "alpha.html").write_text(PAGE_A)
    (tmp_path / "beta.html").write_text(PAGE_B)
    (tmp_path / "index.html").write_text("<html><head><title>Fake 1.0 Documentation</title></head></html>")
    for skipped in ("genindex-A.html", "contents.html", "_sources/x.html"):
        (tmp_path / skipped).parent.mkdir(exist_ok=True)
        (tmp_path / skipped).write_text(
            f'<section id="s"><h1>Listed everywhere</h1><p>{words(30, "x")}</p></section>')
    return tmp_path


def test_a_section_is_its_own_text_without_heading_code_or_subsections() -> None:
    sections = page_sections(PAGE_A)
    assert [(s.anchor, s.heading) for s in sections] == [
        ("alpha-module", "Alpha module guide"), ("examples", "Examples"), ("tiny", "Tiny section here")]
    alpha = sections[0].text
    assert alpha.startswith("The alpha module reused alorem")  # inline tags do not split words
    assert alpha.endswith("alpha.run(x) Runs things.")  # &nbsp; is a space
    for absent in ("code is left out", "print", "¶", "Alpha module guide", "exlorem", "side", "1.2."):
        assert absent not in alpha


def test_the_builder_keeps_unique_headings_with_enough_text(tree: Path) -> None:
    c = qc.build_corpus(tree)
    assert [p.id for p in c.passages] == ["beta.html#beta-things", "beta.html#gamma",
                                          "library/alpha.html#alpha-module"]
    assert [(q.text, q.relevant) for q in c.queries] == [
        ("Beta things explained", ["beta.html#beta-things"]),
        ("Gamma extra notes", ["beta.html#gamma"]),
        ("Alpha module guide", ["library/alpha.html#alpha-module"])]
    assert c.info.dropped == {"heading_shared": 2, "passage_shared": 2, "passage_too_short": 1,
                              "query_too_short": 1}
    assert c.info.pages == 3 and c.info.sections_seen == 9  # index.html has no sections
    assert c.info.source_title == "Fake 1.0 Documentation"
    for p, q in zip(c.passages, c.queries, strict=True):
        assert q.text.casefold() not in p.text.casefold()


def test_the_builder_is_deterministic_and_cuts_passages(tree: Path, tmp_path: Path) -> None:
    first, again = qc.build_corpus(tree), qc.build_corpus(tree)
    assert first.fingerprint() == again.fingerprint()
    qc.write_corpus(first, tmp_path / "c.json")
    assert qc.load_corpus(tmp_path / "c.json").fingerprint() == first.fingerprint()
    short = qc.build_corpus(tree, qc.CutRules(max_passage_words=5))
    assert all(len(p.text.split()) == 5 for p in short.passages)
    assert short.fingerprint() != first.fingerprint()
    two = qc.build_corpus(tree, qc.CutRules(max_passages=2))
    assert len(two.passages) == 2 and all(p in first.passages for p in two.passages)
    assert two.info.dropped["over_max_passages"] == 1


def test_nothing_usable_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no HTML pages"):
        qc.build_corpus(tmp_path)
    (tmp_path / "a.html").write_text("<section id='a'><h1>Two words</h1><p>few</p></section>")
    with pytest.raises(ValueError, match="at least 20 words"):
        qc.build_corpus(tmp_path)


def test_a_file_that_is_not_a_corpus_names_itself(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"passages": []}')
    with pytest.raises(ValueError, match=r"--corpus .*bad.json is not a corpus"):
        qc.load_corpus(bad)
    with pytest.raises(ValueError, match="No such file"):
        qc.load_corpus(tmp_path / "missing.json")


def test_the_command_writes_the_corpus_and_refuses_bad_flags(
    tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out" / "c.json"
    assert qc.main(["--html", str(tree), "--out", str(out)]) == 0
    assert len(qc.load_corpus(out).passages) == 3
    for argv, says in ((["--html", str(tree), "--out", str(out), "--max-passages", "1"], "--max-passages"),
                       (["--html", str(tree / "nope"), "--out", str(out)], "--html"),
                       (["--html", str(tree)], "--out")):
        capsys.readouterr()
        assert qc.main(argv) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_python3_doc_howtos_make_a_corpus_of_hundreds_of_sections(howto_corpus: Path) -> None:
    c = qc.load_corpus(howto_corpus)
    assert len(c.passages) == len(c.queries) == 200
    assert c.info.sections_seen - sum(c.info.dropped.values()) == 200
    assert c.info.dropped["over_max_passages"] >= 50  # the HOWTOs have more usable sections
    assert len({p.id.split("#")[0] for p in c.passages}) >= 10  # many topics
    assert c.info.passage_words_median >= 40
    rules = qc.CutRules(**HOWTO_RULES)
    assert qc.build_corpus(python3_doc_howto(), rules).fingerprint() == c.fingerprint()
