"""Units at their own grain (issue 21, defects 1 and 6): JSON items, table rows and code lines of a large structured
block, and overlong sentences cut at a length limit; the kept text of a structured block stays valid."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from rag_opt.text.json_tree import json_tree
from rag_opt.text.segment import segment
from rag_opt.text.structure import MAX_UNIT_BYTES, split_points, unit_pieces
from rag_opt.text.tokens import get_token_counter
from rag_opt.text.units import UnitTable
from rag_opt.types import Document

COUNT = get_token_counter("o200k_base").count
RECORDS = [{"id": i, "name": f"item {i}", "tags": ["a]b", 'q"uote'], "price": i * 1.25} for i in range(1, 61)]


def table(text: str) -> UnitTable:
    return UnitTable.build([Document(text=text)], COUNT)


def keep_with_needs(units: UnitTable, chosen: np.ndarray) -> np.ndarray:
    """The keep-mask selection makes of ``chosen`` candidates: each with the structure rows it needs."""
    keep = chosen & units.candidate
    for r in np.flatnonzero(keep):
        keep[list(units.enclosing(int(r)))] = True
    return keep


def random_masks(units: UnitTable, n: int = 200) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [keep_with_needs(units, rng.random(units.n_units) < rng.random()) for _ in range(n)]


def utf8(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))  # a lone surrogate (text from broken JSON): 3 bytes


def test_the_json_tree_has_the_offsets_of_items_members_and_commas() -> None:
    text = '  {"a": [1, "x]\\"y", {"b": null}], "c": true}\n'
    root = json_tree(text, 0)
    assert text[root.start : root.end] == text.strip() and text[root.close] == "}"
    a, c = root.items
    assert text[a.start : a.value.end] == '"a": [1, "x]\\"y", {"b": null}]' and a.comma == -1
    assert text[c.start : c.value.end] == '"c": true' and text[c.comma] == ","
    assert [text[i.value.start : i.value.end] for i in a.value.items] == ["1", '"x]\\"y"', '{"b": null}']


@pytest.mark.parametrize("indent", [None, 2])
@pytest.mark.parametrize("shape", ["array", "wrapped"])
def test_a_large_json_value_is_cut_into_records_and_any_selection_of_them_renders_valid_json(
    indent: int | None, shape: str
) -> None:
    value = RECORDS if shape == "array" else {"results": RECORDS, "total": 60}
    text = "The items:\n" + json.dumps(value, indent=indent) + "\n\nThat is all."
    units = table(text)
    records = [
        r for r in range(units.n_units) if units.candidate[r] and units.kind[r] == "json" and "id" in units.texts[r]
    ]
    assert len(records) == 60  # one unit per record
    assert all(units.parent[r] >= 0 for r in records) and not units.candidate[units.parent[records[0]]]
    for keep in random_masks(units):
        kept = [r for r in records if keep[r]]
        rendered = units.render(0, keep)
        block = rendered[rendered.find("[") if shape == "array" else rendered.find("{") :]
        block = block[: block.rfind("]" if shape == "array" else "}") + 1]
        if not kept:
            continue
        got = json.loads(block)
        ids = [int(json.loads(units.texts[r].lstrip(", \n"))["id"]) for r in kept]
        want = [RECORDS[i - 1] for i in ids]
        assert (got if shape == "array" else got["results"]) == want


def test_json_items_larger_than_the_limit_are_cut_further_and_an_indivisible_one_stays_whole() -> None:
    big = {"meta": {"source": "x"}, "rows": [list(range(i, i + 300)) for i in range(4)], "blob": "w " * 3000}
    text = json.dumps(big)
    units = table(text)
    assert all(units.tokens[r] > 0 for r in range(units.n_units))
    # the rows array is cut into its lists; the 6,000-byte string cannot be cut: one unit, read in part
    blob = next(r for r in range(units.n_units) if units.texts[r].lstrip(", ").startswith('"blob"'))
    assert units.end[blob] - units.start[blob] > 6000 and utf8(units.texts[blob]) <= MAX_UNIT_BYTES
    assert all(utf8(t) <= MAX_UNIT_BYTES for t in units.texts)
    for keep in random_masks(units, 100):
        if keep.any():
            json.loads(units.render(0, keep))


def test_a_markdown_table_and_a_csv_are_cut_into_rows_kept_with_their_header() -> None:
    md = "| id | name |\n|---|---|\n" + "".join(f"| {i} | item {i} |\n" for i in range(40))
    csv_text = "id,name,price\n" + "".join(f"{i},item {i},{i}.5\n" for i in range(40))
    for text, head in ((md, "| id | name |\n|---|---|\n"), (csv_text, "id,name,price\n")):
        units = table(text)
        assert units.texts[0] == head and not units.candidate[0]
        assert units.candidate[1:].all() and len(units.texts) == 41 and (units.parent[1:] == 0).all()
        keep = keep_with_needs(units, np.isin(np.arange(units.n_units), [5, 17]))
        assert units.render(0, keep) == head + units.texts[5] + units.texts[17].rstrip()  # no trailing newline


def test_delimited_values_are_a_table_but_prose_with_commas_is_not() -> None:
    assert [s.kind for s in segment("id\tname\n1\tAnn\n2\tBob\n")] == ["table"]
    assert [s.kind for s in segment('a;b\n1;"x;y"\n2;z\n')] == ["table"]
    kinds = [
        s.kind for s in segment("Then, after the war, he moved to Paris, France.\nHe was, by all accounts, happy.\n")
    ]
    assert "table" not in kinds
    csv_text = "Here is the data:\nid,name\n1,Ann\n2,Bob\n"
    assert [(s.kind, csv_text[s.start : s.end]) for s in segment(csv_text)][-1] == ("table", "id,name\n1,Ann\n2,Bob\n")


def test_a_large_code_block_is_cut_into_line_chunks_between_its_fences() -> None:
    code = "```python\n" + "".join(f"value_{i} = compute({i}) + offset  # step {i}\n" for i in range(200)) + "```\n"
    units = table("Run it:\n\n" + code)
    fence_open = units.texts.index("```python\n")
    chunks = [r for r in range(units.n_units) if units.candidate[r] and units.kind[r] == "code"]
    assert len(chunks) > 1 and all(utf8(units.texts[r]) <= MAX_UNIT_BYTES for r in chunks)
    assert all(t.endswith("\n") for t in (units.texts[r] for r in chunks))  # whole lines
    keep = keep_with_needs(units, np.isin(np.arange(units.n_units), [chunks[3]]))
    assert units.render(0, keep) == "```python\n" + units.texts[chunks[3]] + "```"  # no trailing newline
    assert units.closer[fence_open] == units.n_units - 1


def test_an_unpunctuated_sentence_is_cut_at_whitespace_into_bounded_units() -> None:
    rng = random.Random(0)
    words = "alpha beta gamma delta river stone market signal window garden copper silver".split()
    text = " ".join(rng.choice(words) for _ in range(8000))  # 8,000 words, one "sentence"
    assert len(segment(text)) == 1
    units = table(text)
    assert units.n_units > 40 and "".join(units.texts) == text
    assert all(utf8(t) <= MAX_UNIT_BYTES for t in units.texts)
    assert all(t[:1].strip() and t[-1] == " " for t in units.texts[:-1])  # cut after a space
    assert all(utf8(t) >= MAX_UNIT_BYTES // 2 for t in units.texts[:-1])  # at least half full
    assert set(units.kind) == {"sentence"} and units.candidate.all()


@pytest.mark.parametrize(
    "text", ["x" * 5000, "漢字" * 2000, "é" * 3000 + " " + "🙂" * 900, "a\ud800" * 2000, "\udfff" * 700]
)
def test_text_without_spaces_or_with_multibyte_characters_is_cut_at_the_byte_limit(text: str) -> None:
    bounds = [0, *split_points(text, 0, len(text)), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert "".join(pieces) == text and all(0 < utf8(p) <= MAX_UNIT_BYTES for p in pieces)
    assert all(utf8(p) >= MAX_UNIT_BYTES // 2 for p in pieces[:-1])


def test_small_structured_blocks_and_sentences_stay_one_unit() -> None:
    for text in ('{"a": 1, "b": [1, 2]}', "| a | b |\n|---|---|\n| 1 | 2 |\n", "A short sentence. Another one."):
        seg = segment(text)
        assert [(p.start, p.end, p.kind) for s in seg for p in unit_pieces(text, s)] == [
            (s.start, s.end, s.kind) for s in seg
        ]


@pytest.mark.model
def test_an_overlong_sentence_is_read_in_windows_no_longer_than_the_limit(proxy) -> None:
    """The work per forward pass is bounded: a 2,500-word unpunctuated text is read in windows of at most 1,024
    proxy tokens (an overlong unit used to get one window of its own, as long as the unit)."""
    from rag_opt.compressors.sentinel import SentinelCompressor

    rng = random.Random(1)
    words = "alpha beta gamma delta river stone market signal window garden copper silver".split()
    text = " ".join(rng.choice(words) for _ in range(2500))
    scorer = SentinelCompressor(proxy, max_tokens=1024, profiles=None)
    scores = scorer.score("Where is the copper market?", table(text))
    assert scores.attention is not None and scores.attention.windows > 1
    assert scores.attention.context_tokens <= 1024
