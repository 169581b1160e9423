"""The explain report: a self-contained, escaped HTML rendering of an OptimizeResult on real documents."""

from __future__ import annotations

import html
import json
import re
import shutil
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from rag_opt.cli import main
from rag_opt.compressors.baselines import BM25Scorer
from rag_opt.pipeline import ContextOptimizer
from rag_opt.report import explain, render_html, write_html
from rag_opt.types import DEFAULT_RATIO, OptimizeResult

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_DOCS = ROOT / "examples" / "hotpotqa_docs.jsonl"
QUESTION = (ROOT / "examples" / "hotpotqa_question.txt").read_text(encoding="utf-8").strip()


def _docs() -> list[dict[str, Any]]:
    return [json.loads(line) for line in EXAMPLE_DOCS.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def bm25_result() -> tuple[OptimizeResult, list[dict[str, Any]]]:
    docs = _docs()
    opt = ContextOptimizer(scorer=BM25Scorer())
    return opt.optimize(QUESTION, docs, ratio=0.35, ordering="relevance"), docs


class _Page(HTMLParser):
    """Collects tags, attributes and the text of each ``<p class="text">``."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str | None]] = []
        self.texts: list[str] = []
        self._in_text = 0
        self.open: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attrs.extend(attrs)
        if tag not in ("meta", "br"):
            self.open.append(tag)
        if tag == "p" and ("class", "text") in attrs:
            self._in_text = 1
            self.texts.append("")
        elif self._in_text:
            self._in_text += 1

    def handle_endtag(self, tag: str) -> None:
        assert self.open and self.open[-1] == tag, f"unbalanced </{tag}> (open: {self.open[-3:]})"
        self.open.pop()
        if self._in_text:
            self._in_text -= 1

    def handle_data(self, data: str) -> None:
        if self._in_text:
            self.texts[-1] += data


def _parse(page: str) -> _Page:
    parser = _Page()
    parser.feed(page)
    parser.close()
    assert parser.open == [], f"unclosed tags: {parser.open}"
    return parser


def test_report_shows_every_sentence_order_and_tokens(bm25_result) -> None:
    result, docs = bm25_result
    page = render_html(result, docs)
    parsed = _parse(page)
    all_docs = [*result.documents, *result.dropped]
    # every document's full original text, verbatim, in output order then the dropped ones
    order = [*result.documents, *sorted(result.dropped, key=lambda d: d.index)]
    assert parsed.texts == [docs[d.index]["text"] for d in order]
    # one highlighted span per unit, kept vs dropped
    kept = sum(u.kept for d in all_docs for u in d.units)
    assert page.count('class="u keep"') == kept
    assert page.count('class="u drop"') == sum(len(d.units) for d in all_docs) - kept
    assert 0 < kept < sum(len(d.units) for d in all_docs)
    # token counts and the order table (one row per input document, with its output position)
    assert f"{result.tokens_before:,}" in page and f"{result.tokens_after:,}" in page
    rows = re.findall(r'<tr class="(kept|dropped)"><td class="num">(\d+)</td>', page)
    assert [int(n) for _, n in rows] == list(range(1, len(docs) + 1))
    for rank, d in enumerate(result.documents):
        assert f"<b>{rank + 1}</b>{html.escape(d.title or d.id)}" in page
    # the two numbers per document, labelled, with a legend saying which is which (BM25: no document probe)
    assert "<th>Document relevance</th><th>Best sentence score</th>" in page
    legend = re.search(r'<p class="note legend-relevance">(.*?)</p>', page)
    assert legend and "<b>Document relevance</b> (its best sentence&#x27;s score: no document probe ran)" in legend[1]
    assert "the ordering ranks documents by it" in legend[1] and "<b>Best sentence score</b>" in legend[1]
    assert page.count("document relevance = best sentence score ") == len(docs)
    assert f"(document relevance {result.documents[0].score:.2f})" in page
    # why relevance is not position-calibrated: here no proxy model read the context (pointing at warnings only
    # when there are some)
    assert "no document relevance was computed by the proxy model" in page
    assert "(see the warnings)" not in page


def test_report_is_self_contained(bm25_result) -> None:
    result, docs = bm25_result
    page = render_html(result, docs)
    parsed = _parse(page)
    assert "script" not in parsed.tags and "link" not in parsed.tags and "img" not in parsed.tags
    assert not [v for k, v in parsed.attrs if k in ("src", "href")]
    assert "http://" not in page and "https://" not in page and "@import" not in page and "url(" not in page
    assert page.startswith("<!DOCTYPE html>") and '<meta charset="utf-8">' in page


def test_report_escapes_all_text() -> None:
    evil = '<script>alert("x")</script> & <img src=x onerror=alert(1)>'
    docs = [
        {
            "id": 'id"><b>',
            "title": "<i>Title</i>",
            "text": f"Paris is the capital of France. {evil} It has the Louvre.",
            "metadata": {"note": "</pre><script>bad()</script>"},
        },
        {"text": "Berlin is the capital of Germany. It is large."},
    ]
    query = "Which <b>city</b> is the capital of France?"
    result = ContextOptimizer(scorer=BM25Scorer()).optimize(query, docs, ratio=0.6)
    page = render_html(result, docs)
    parsed = _parse(page)
    assert "script" not in parsed.tags and "img" not in parsed.tags
    assert "<script>" not in page and "<img" not in page and "<i>Title" not in page and "<b>city" not in page
    assert html.escape(evil) in page and "&lt;i&gt;Title&lt;/i&gt;" in page
    assert docs[0]["text"] in parsed.texts  # unescaped by the parser: the text is shown verbatim


def test_report_shows_calibrated_relevance(bm25_result) -> None:
    result, docs = bm25_result
    first = result.documents[0].model_copy(update={"score": 0.123456, "raw_score": 0.654321})
    calibrated = result.model_copy(update={"calibrated": True, "documents": [first, *result.documents[1:]]})
    page = render_html(calibrated, docs)
    assert "0.123" in page and "0.654" in page and "calibrated against" in page
    assert "<b>Document relevance</b> (document probe, position-calibrated)" in page
    assert "document relevance 0.123 (document probe, position-calibrated) · best sentence score 0.654" in page


def test_report_rejects_documents_that_do_not_match(bm25_result) -> None:
    result, docs = bm25_result
    with pytest.raises(ValueError, match="covers 10 input documents but 9"):
        render_html(result, docs[:9])
    shortened = [dict(d, text=d["text"][:20]) for d in docs]
    with pytest.raises(ValueError, match="does not match the result"):
        render_html(result, shortened)


def test_explain_defaults_to_a_ratio_and_writes_the_page(tmp_path: Path) -> None:
    docs = _docs()[:4]
    out = tmp_path / "report.html"
    page = explain(QUESTION, docs, optimizer=ContextOptimizer(scorer=BM25Scorer()), out=out)
    assert out.read_text(encoding="utf-8") == page
    tokens = [int(x.replace(",", "")) for x in re.findall(r'<div class="stat"><b>([\d,]+)</b>', page)[:3]]
    before, after, saved = tokens
    assert 0 < after <= DEFAULT_RATIO * before and saved == before - after
    kept_all = ContextOptimizer(scorer=BM25Scorer(), ratio=1.0, ordering="input").optimize(QUESTION, docs)
    written = write_html(kept_all, docs, tmp_path / "w.html").read_text(encoding="utf-8")
    assert "none scorer" in written  # ratio 1: nothing scored, everything kept, and the page says why
    assert "nothing compressed: the budget (ratio 1" in written


def test_cli_explain_bad_input(capsys, tmp_path: Path) -> None:
    assert main(["explain", "-q", "who?", "-i", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "r.html")]) == 2
    assert "input file not found" in capsys.readouterr().err
    assert main(["explain", "-q", " ", "-i", str(EXAMPLE_DOCS), "-o", str(tmp_path / "r.html")]) == 2
    assert "--query is empty" in capsys.readouterr().err
    assert main(["explain", "-q", "who?", "-i", str(EXAMPLE_DOCS), "-o", str(tmp_path / "no" / "r.html")]) == 2
    assert "output folder not found" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # the orderings are argparse choices, as for optimize
        main(["explain", "-q", "who?", "-i", str(EXAMPLE_DOCS), "-o", str(tmp_path / "r.html"), "--ordering", "x"])
    assert exc.value.code == 2 and "invalid choice: 'x'" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()


@pytest.mark.model
def test_cli_explain_with_the_proxy_model(capsys, tmp_path: Path) -> None:
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(EXAMPLE_DOCS.read_text(encoding="utf-8").splitlines()[:5]) + "\n", encoding="utf-8")
    out = tmp_path / "report.html"
    assert main(["explain", "--query", QUESTION, "--input", str(docs), "--out", str(out), "--ratio", "0.4"]) == 0
    err = capsys.readouterr().err
    assert f"wrote {out}" in err and "scorer: " in err
    page = out.read_text(encoding="utf-8")
    _parse(page)
    assert "raw-attention scorer" in page or "probe scorer" in page
    # the proxy's document probe and the best sentence score: two different numbers, each labelled
    assert "<b>Document relevance</b> (document probe" in page and "best sentence score" in page
    assert 'class="u keep"' in page and 'class="u drop"' in page
    assert "score —" not in page  # every sentence was scored


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_report_renders_in_headless_chromium(bm25_result, tmp_path: Path) -> None:
    chromium = _chromium()
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    result, docs = bm25_result
    report = write_html(result, docs, tmp_path / "report.html")
    png = tmp_path / "report.png"
    cmd = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1280,1800",
        f"--screenshot={png}",
        report.resolve().as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)  # a bound on the browser, not a budget
    assert proc.returncode == 0 and png.is_file(), proc.stderr[-2000:]
    data = png.read_bytes()
    assert _png_size(data) == (1280, 1800)
    image_mod = pytest.importorskip("PIL.Image")
    with image_mod.open(png) as img:
        raw = img.convert("RGB").resize((320, 450)).tobytes()
    pixels = [(raw[i], raw[i + 1], raw[i + 2]) for i in range(0, len(raw), 3)]
    green = sum(1 for r, g, b in pixels if g > r + 25 and g > b + 15)  # kept sentences
    red = sum(1 for r, g, b in pixels if r > g + 12 and r > b + 12)  # dropped sentences' tint
    white = sum(1 for r, g, b in pixels if min(r, g, b) > 240)
    assert green > 500 and red > 300, (green, red)
    assert white > len(pixels) // 4  # a page, not a blank or error screen
