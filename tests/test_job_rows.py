"""The row readers of ``rag-opt batch`` and ``rag-opt index``: one row never stops a job (issue 52, A4).

Whatever one JSONL line holds (bytes that are not UTF-8, a lone surrogate, a 5,000-digit integer, nesting past
the recursion limit, NaN, a JSON value that is not an object...), the reader gives that line its own error and
reads the others. Hypothesis fuzzes both readers; no model is loaded.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rag_opt.batch.job import jsonl_columns, jsonl_row
from rag_opt.cli.common import UserError
from rag_opt.cli.index_rows import RowResult, batches, parse_row

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HUGE = "9" * 5000  # past Python's int-from-string limit (4,300 digits): json.loads raises ValueError
DEEP = "[" * 100_000 + "]" * 100_000  # past the recursion limit: json.loads raises RecursionError

# -- what one line may hold ----------------------------------------------------------------------------------------
_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)  # dumped as NaN / Infinity, which json.loads reads back
    | st.text()  # lone surrogates included: dumped as \ud800-style escapes
)
_values = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4)
)
_rows = st.fixed_dictionaries(
    {"question": _values, "documents": _values},
    optional={"id": _values, "query": _values, "text": _values, "title": _values, "metadata": _values},
)
_special = st.sampled_from(
    [
        HUGE,
        f'{{"id": {HUGE}, "question": "q?", "documents": ["d."]}}',
        f'{{"question": "q?", "documents": [{{"text": "d.", "title": {HUGE}}}]}}',
        f'{{"text": "d.", "title": {HUGE}}}',
        f'{{"text": "d.", "metadata": {{"n": -{HUGE}}}}}',
        DEEP,
        '{"question": "q?", "documents": ' + DEEP + "}",
        '{"text": "d.", "metadata": ' + DEEP + "}",
        "NaN",
        "-Infinity",
        '{"question": NaN, "documents": [Infinity]}',
        '{"text": NaN}',
        '{"question": "q \\ud800", "documents": ["d."]}',
        '{"text": "d \\udfff."}',
        '{"\\udc00": 1, "text": "d."}',
        '"just a string"',
        "[1, 2, 3]",
        "true",
        "null",
        '{"text": "d."',
        "\ufeff{}",
    ]
)


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=True, allow_nan=True)


_lines = st.one_of(
    st.binary(max_size=200),  # anything: invalid UTF-8 included
    st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),  # raw surrogates: not UTF-8
    _values.map(lambda v: _dump(v).encode()),
    _rows.map(lambda v: _dump(v).encode()),
    _special.map(str.encode),
)


def _write(tmp: Path, lines: list[bytes]) -> Path:
    path = tmp / "rows.jsonl"
    path.write_bytes(b"\n".join(line.replace(b"\n", b" ") for line in lines) + b"\n")
    return path


# -- rag-opt batch -------------------------------------------------------------------------------------------------
@FUZZ
@given(raw=_lines)
def test_the_batch_row_reader_never_raises(raw: bytes) -> None:
    row_id, question, documents, error = jsonl_row(raw, 7)
    for value in (row_id, question, documents, error):
        assert value is None or isinstance(value, str)
        if value is not None:
            value.encode("utf-8")  # Unicode text (no lone surrogate): it can be written to Parquet
    if error is None:
        assert isinstance(question, str) and documents is not None
        json.loads(documents)  # the optimizer reads it back
    else:
        assert error.startswith("line 7: ")


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (f'{{"id": {HUGE}, "question": "q?", "documents": ["d."]}}', "a number too long to read"),
        (f'{{"id": "x", "question": "q?", "documents": [{{"text": "d.", "title": {HUGE}}}]}}', "too long to read"),
        ('{"id": "x", "question": "q?", "documents": ' + DEEP + "}", "nested too deeply"),
    ],
    ids=["huge-id", "huge-title", "deep"],
)
def test_a_batch_file_with_an_unreadable_row_reads_the_others(tmp_path: Path, bad: str, why: str) -> None:
    good = [json.dumps({"id": i, "question": "Who?", "documents": [f"Document {i}."]}) for i in ("a", "c")]
    cols = jsonl_columns(_write(tmp_path, [good[0].encode(), bad.encode(), good[1].encode()]))
    assert cols["row"] == [0, 1, 2] and cols["id"] == ["a", None, "c"]
    assert cols["error"][0] is None and cols["error"][2] is None
    assert cols["error"][1].startswith("line 2: invalid JSON (") and why in cols["error"][1]
    assert [json.loads(d) for d in (cols["documents"][0], cols["documents"][2])] == [["Document a."], ["Document c."]]


def test_a_batch_file_with_an_unreadable_row_becomes_a_table_of_every_row(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow", reason="pyarrow (from the ray extra) is not installed")
    from rag_opt.batch.job import read_rows

    lines = [
        b'{"id": "a", "question": "q?", "documents": ["d."]}',
        f'{{"id": {HUGE}, "question": "q?", "documents": ["d."]}}'.encode(),
        b"\xff\xfe",
        b'{"id": "d", "question": NaN, "documents": ["d."]}',
        b'{"id": "e", "question": "q?", "documents": [NaN, "d."]}',
    ]
    table = read_rows(_write(tmp_path, lines)).to_pylist()
    assert [r["row"] for r in table] == [0, 1, 2, 3, 4]
    assert [r["error"] is None for r in table] == [True, False, False, False, True]
    assert table[3]["error"] == "line 4: 'question' must be a string"
    assert math.isnan(json.loads(table[4]["documents"])[0])


# -- rag-opt index -------------------------------------------------------------------------------------------------
@FUZZ
@given(raw=_lines)
def test_the_index_row_reader_raises_only_a_row_error(raw: bytes) -> None:
    try:
        doc = parse_row(raw, 7)
    except UserError as exc:
        assert str(exc).startswith("line 7: ")
    else:
        assert isinstance(doc["text"], str) and doc["text"].strip()
        assert set(doc) <= {"text", "title", "metadata"}
        json.dumps(doc, ensure_ascii=False).encode("utf-8")  # Unicode text: it can be hashed, encoded, sent to Ray


@FUZZ
@given(raw=_lines)
def test_the_index_reader_reads_the_rows_around_any_row(tmp_path_factory: pytest.TempPathFactory, raw: bytes) -> None:
    path = _write(tmp_path_factory.mktemp("rows"), [b'"First document."', raw, b'{"text": "Last document."}'])
    failed: list[RowResult] = []
    rows = [row for batch in batches(str(path), 2, failed) for row in batch]
    texts = [doc["text"] for _, doc in rows]
    assert texts[0] == "First document." and texts[-1] == "Last document."
    assert len(rows) + len(failed) == (3 if raw.replace(b"\n", b" ").strip() else 2)  # a blank line is no row
    assert all(r.status == "failed" and r.line == 2 and r.error and r.error.startswith("line 2: ") for r in failed)


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (f'{{"text": "Middle.", "title": {HUGE}}}', f"a number too long to read: over {sys.get_int_max_str_digits()}"),
        (f'{{"id": {HUGE}, "text": "Middle."}}', "a number too long to read"),
        ('{"text": "Middle.", "metadata": ' + DEEP + "}", "nested too deeply"),
        ('{"text": "Middle \\ud800."}', "lone UTF-16 surrogate"),
    ],
    ids=["huge-title", "huge-id", "deep", "surrogate"],
)
def test_an_index_file_with_an_unreadable_row_reads_the_others(tmp_path: Path, bad: str, why: str) -> None:
    lines = [b'{"text": "First.", "title": "One"}', bad.encode(), b'{"text": "Third."}', b'"Fourth."']
    failed: list[RowResult] = []
    got = list(batches(str(_write(tmp_path, lines)), 2, failed))
    assert [[line for line, _ in b] for b in got] == [[1, 3], [4]]
    assert [doc["text"] for b in got for _, doc in b] == ["First.", "Third.", "Fourth."]
    assert len(failed) == 1 and failed[0].line == 2 and failed[0].status == "failed"
    assert failed[0].error is not None and failed[0].error.startswith("line 2: ") and why in failed[0].error
