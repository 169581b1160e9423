"""Titles found where users keep them: the title field, metadata keys, a file name's stem, a leading heading line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rag_opt import ContextOptimizer
from rag_opt.errors import InvalidInputError, InvalidInputTypeError
from rag_opt.text.titles import file_stem_title, find_title, leading_heading
from rag_opt.text.units import UnitTable
from rag_opt.types import Document

TEXT = "Oak Island is a 57 ha island in Nova Scotia. It is privately owned."


@pytest.mark.parametrize(
    ("text", "title"),
    [
        ("# Oak Island\n\n" + TEXT, "Oak Island"),
        ("## Oak Island ##\n" + TEXT, "Oak Island"),
        ("Oak Island\n" + TEXT, "Oak Island"),
        ("\n\nOak Island (Nova Scotia)\n\n" + TEXT, "Oak Island (Nova Scotia)"),
        ("Oak Island\r\n" + TEXT, "Oak Island"),
    ],
)
def test_a_leading_heading_line_is_a_title(text: str, title: str) -> None:
    found = leading_heading(text)
    assert found is not None and found[0] == title
    start, end = found[1]
    assert start == 0 and text[end:].startswith("Oak Island is")  # the span takes the blank lines after it


@pytest.mark.parametrize(
    "text",
    [
        TEXT,  # no line break
        "Oak Island.\n" + TEXT,  # end punctuation: a sentence
        "Where is it filmed?\n" + TEXT,
        "Note:\n" + TEXT,
        "Oak Island",  # nothing after it
        "Oak Island\n   \n",
        "- Oak Island\n" + TEXT,  # a list item
        "1. Oak Island\n" + TEXT,
        "> Oak Island\n" + TEXT,  # a quote
        "| a | b |\n|---|---|\n| 1 | 2 |\n",  # a Markdown table
        "id,name,price\n1,a,2.5\n2,b,3.5\n",  # a CSV header row
        '{"title": "Oak Island"}\n' + TEXT,  # JSON
        "```python\nprint(1)\n```\n",  # code
        "https://example.org/oak\n" + TEXT,  # a URL
        "12345\n" + TEXT,  # no letter
        " ".join(["word"] * 13) + "\n" + TEXT,  # too many words
        "#\n" + TEXT,  # an empty Markdown heading
    ],
)
def test_what_is_not_a_heading_line(text: str) -> None:
    assert leading_heading(text) is None


@pytest.mark.parametrize(
    ("value", "title"),
    [
        ("docs/Oak_Island.md", "Oak Island"),
        ("/data/reports/q3 results.pdf", "q3 results"),
        ("C:\\files\\Nova_Scotia.txt", "Nova Scotia"),
        ("https://example.org/wiki/Oak_Island.html?x=1#top", "Oak Island"),
        ("notes.txt", "notes"),
        ("a1b2c3d4e5f60718.json", None),  # a hex hash
        ("3f2504e0-4f89-11d3-9a0c-0305e82c3301.txt", None),  # a UUID
        ("000123.txt", None),  # a number
        ("https://example.org/wiki/Oak_Island", None),  # no file name: no extension
        ("chunk-17", None),
    ],
)
def test_a_file_name_gives_its_stem_unless_it_is_an_opaque_id(value: str, title: str | None) -> None:
    assert file_stem_title(value) == title


def test_the_sources_are_read_in_order_and_an_id_never_is() -> None:
    both = Document(text="Oak Island\n" + TEXT, title="Field", metadata={"title": "Meta"})
    assert (find_title(both).title, find_title(both).label) == ("Field", "field")  # type: ignore[union-attr]
    meta = Document(text="Oak Island\n" + TEXT, metadata={"heading": "H", "doc_title": "D"})
    assert (find_title(meta).title, find_title(meta).label) == ("D", "metadata.doc_title")  # type: ignore[union-attr]
    source = Document(text=TEXT, metadata={"source": "x/Oak_Island.md"})
    assert find_title(source).label == "metadata.source"  # type: ignore[union-attr]
    opaque = Document(text=TEXT, id="Oak Island", metadata={"source": "9f86d081884c7d65.txt", "id": "Oak"})
    assert find_title(opaque) is None
    heading = Document(text="Oak Island\n" + TEXT, metadata={"name": "  "})  # a blank value is skipped
    assert find_title(heading).label == "text"  # type: ignore[union-attr]
    assert find_title(heading, from_text=False) is None
    assert find_title(Document(text=TEXT, metadata={"label": "L"}), ["label"]).title == "L"  # type: ignore[union-attr]


def test_a_heading_line_becomes_a_unit_of_the_text_not_a_title_row() -> None:
    docs = [Document(text="Oak Island\n" + TEXT), Document(text=TEXT, title="Nova Scotia")]
    units = UnitTable.build(docs, lambda s: len(s.split()))
    first = units.rows(0)
    assert units.kind[first[0]] == "heading" and units.texts[first[0]] == "Oak Island\n"
    assert (units.start[first[0]], units.end[first[0]]) == (0, len("Oak Island\n"))
    assert not units.candidate[first[0]]
    assert units.titles == ("Oak Island", "Nova Scotia") and units.title_sources == ("text", "field")
    assert units.title_tokens is not None and units.title_tokens[0] == 0 and units.title_tokens[1] > 0
    # the proxy reads the same text as for a title field: the title line, then the sentences
    assert units.document_texts()[0] == "Oak Island\n" + TEXT
    off = UnitTable.build(docs, lambda s: len(s.split()), title_from_text=False)
    assert off.titles[0] is None and "heading" not in {off.kind[r] for r in off.rows(0)}


def test_results_say_which_title_was_used_and_keep_the_heading_verbatim() -> None:
    docs = [
        {"id": "a", "text": "Oak Island\n" + TEXT + " Tourists visit it in summer. The weather is mild there."},
        {"id": "b", "text": "Halifax is the capital of Nova Scotia. It is a port.", "metadata": {"source": "Hx.md"}},
        {"id": "c", "text": "Unrelated text about cooking pasta. Boil water first.", "title": "Pasta"},
    ]
    result = ContextOptimizer(tier="lexical").optimize("Where is Oak Island?", docs, ratio=1.0, ordering="relevance")
    by_id = {d.id: d for d in result.documents}
    assert (by_id["a"].title, by_id["a"].title_source) == ("Oak Island", "text")
    assert (by_id["b"].title, by_id["b"].title_source) == ("Hx", "metadata.source")
    assert (by_id["c"].title, by_id["c"].title_source) == ("Pasta", "field")
    context = result.context()
    assert context.count("Oak Island\nOak Island is") == 1  # the heading is not rendered twice
    assert "Hx\nHalifax is" in context and "Pasta\nUnrelated" in context
    squeezed = ContextOptimizer(tier="lexical").optimize("Who owns Oak Island?", docs, ratio=0.3)
    kept = {d.id: d.text for d in squeezed.documents}
    assert kept.get("a", "").startswith("Oak Island\n")  # kept with the sentences of its document


def test_title_keys_override_and_bad_values_are_refused() -> None:
    docs = [{"text": TEXT, "metadata": {"headline": "Oak Island", "title": "ignored"}}]
    opt = ContextOptimizer(tier="lexical", title_keys=["headline"])
    doc = opt.optimize("Where is Oak Island?", docs, ratio=1.0, ordering="relevance").documents[0]
    assert (doc.title, doc.title_source) == ("Oak Island", "metadata.headline")
    with pytest.raises(InvalidInputTypeError, match=r"did you mean \['title'\]"):
        ContextOptimizer(title_keys="title")
    with pytest.raises(InvalidInputError, match=r"title_keys\[1\]"):
        ContextOptimizer(title_keys=["title", ""])
    with pytest.raises(InvalidInputTypeError, match="title_from_text"):
        ContextOptimizer(title_from_text="yes")  # type: ignore[arg-type]


@pytest.mark.model
def test_the_command_line_takes_the_title_options(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import json

    from rag_opt.cli import main

    path = tmp_path / "docs.jsonl"
    rows = [
        {"id": "a", "text": "Oak Island\nOak Island is an island in Nova Scotia. It is privately owned."},
        {"id": "b", "text": "Cooking pasta needs water. Salt it well.", "metadata": {"headline": "Pasta"}},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["optimize", "-q", "Where is Oak Island?", "-i", str(path), "--ratio", "1", "--ordering", "relevance"]
    assert main([*args, "--title-keys", "headline", "--json"]) == 0
    got = {d["id"]: (d["title"], d["title_source"]) for d in json.loads(capsys.readouterr().out)["documents"]}
    assert got == {"a": ("Oak Island", "text"), "b": ("Pasta", "metadata.headline")}
    assert main([*args, "--title-keys", "", "--no-title-from-text", "--json"]) == 0
    got = {d["id"]: (d["title"], d["title_source"]) for d in json.loads(capsys.readouterr().out)["documents"]}
    assert got == {"a": (None, None), "b": (None, None)}


@pytest.mark.parametrize(
    ("text", "subject"),
    [
        ("Dark Horse Records is a record label founded by George Harrison.", "Dark Horse Records"),
        ('"Can\'t Stop Thinking About You" is a song by George Harrison.', "Can't Stop Thinking About You"),
        ("Kim Hyung-jun (born August 3, 1987) is a South Korean entertainer.", "Kim Hyung-jun"),
        ("Bank of America is a bank.", "Bank of America"),
        ("Ludwig van Beethoven was a composer.", "Ludwig van Beethoven"),
        # a quoted title of a work keeps its own words; a title keeps its small words in lower case
        ('"When the Levee Breaks" is a blues song.', "When the Levee Breaks"),
        ("Bastard out of Carolina is a 1996 film.", "Bastard out of Carolina"),
        ("Gone with the Wind is a novel.", "Gone with the Wind"),
        ("The band was formed in 1990.", None),  # not a name
        ("It is a song.", None),  # a pronoun
        ("In 1990, the band split.", None),
        ("the lowercase start is no name.", None),
        ("A very long subject with many capitalised Words That Goes On And On is here.", None),
    ],
)
def test_the_leading_subject_is_a_link_name_for_a_document_without_a_title(text: str, subject: str | None) -> None:
    from rag_opt.text.titles import leading_subject

    assert leading_subject(text) == subject


def test_link_names_let_documents_without_titles_be_named_by_others() -> None:
    """A sentence of one document that names another document's subject links the two, as a title would; the
    subject is never shown as a title."""
    docs = [
        Document(text="Dark Horse Records is a record label. It was founded in 1974."),
        Document(text="The album was released on Dark Horse Records in 1976. It sold well."),
        Document(text="Dark Horse Records is a record label.", title="Label"),
    ]
    units = UnitTable.build(docs, lambda s: len(s.split()))
    assert units.link_names == ("Dark Horse Records", None, "Label") and units.titles == (None, None, "Label")
    from rag_opt.compressors.context_features import CONTEXT_FEATURES, context_features

    logits = np.linspace(-1.0, 1.0, units.n_units)
    feats = context_features(logits, units)
    named = feats[:, CONTEXT_FEATURES.index("named_by_other")]
    first = units.rows(0)
    assert named[[r for r in first if units.candidate[r]]].max() > named[[r for r in units.rows(1)]].max()
