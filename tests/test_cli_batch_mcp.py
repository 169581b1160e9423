"""``rag-opt mcp`` and ``rag-opt batch`` on the command line: help, missing extras, bad input (no model, no Ray)."""

from __future__ import annotations

import json
import sys

import pytest

from rag_opt.cli import build_parser, main
from rag_opt.install import install_hint


def test_the_new_subcommands_are_listed_with_their_options(capsys):
    help_text = build_parser().format_help()
    assert "mcp" in help_text and "batch" in help_text
    with pytest.raises(SystemExit):
        main(["batch", "--help"])
    out = capsys.readouterr().out
    for flag in ("--input", "--output", "--ray-address", "--actors", "--ratio", "--target-tokens", "--ordering"):
        assert flag in out
    assert "--language" in out
    with pytest.raises(SystemExit):
        main(["mcp", "--help"])
    out = capsys.readouterr().out
    assert "--ratio" in out and "--language" in out and "stdio" in out


@pytest.mark.parametrize(
    ("argv", "module", "message"),
    [
        (["mcp"], "mcp.server.mcpserver", "rag-opt mcp needs the mcp extra"),
        (["batch", "-i", "rows.jsonl", "-o", "out.parquet"], "ray", "rag-opt batch needs the ray extra"),
    ],
)
def test_a_missing_extra_is_a_clear_error(capsys, monkeypatch, argv, module, message):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if the package were not installed
    assert main(argv) == 2
    err = capsys.readouterr().err
    extra = "mcp" if argv == ["mcp"] else "ray"
    assert message in err and install_hint(extra) in err and "Traceback" not in err


def test_batch_input_errors_exit_with_status_2(capsys, tmp_path):
    pytest.importorskip("pyarrow", reason="pyarrow (from the ray extra) is not installed")
    pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]'")
    out = str(tmp_path / "out.parquet")
    assert main(["batch", "-i", str(tmp_path / "nope.jsonl"), "-o", out]) == 2
    assert "input file not found" in capsys.readouterr().err
    (tmp_path / "rows.csv").write_text("question,documents\n")
    assert main(["batch", "-i", str(tmp_path / "rows.csv"), "-o", out]) == 2
    assert "must be a .jsonl or .parquet file" in capsys.readouterr().err
    (tmp_path / "rows.jsonl").write_text('{"question": "q", "documents": ["d"]}\n')
    assert main(["batch", "-i", str(tmp_path / "rows.jsonl"), "-o", out, "--language", "??"]) == 2
    assert "language must be an ISO 639 code" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["batch", "-i", str(tmp_path / "rows.jsonl"), "-o", out, "--actors", "0"])
    assert "expected an integer >= 1" in capsys.readouterr().err


def _bad_rows(tmp_path):
    """A JSONL file with good rows around one invalid UTF-8 byte, one lone surrogate and a surrogate pair."""
    good = '{"id": "a", "question": "q?", "documents": ["Some text."]}\n'
    path = tmp_path / "rows.jsonl"
    path.write_bytes(
        good.encode()
        + b'{"id": "b", "question": "q?", "documents": ["bad \xff byte"]}\n'
        + b'{"id": "c", "question": "q \\ud800?", "documents": ["x"]}\n'
        + b'{"id": "d", "question": "q?", "documents": [{"text": "a pair \\ud83d\\ude00 is fine"}]}\n'
        + b'{"id": "e\\udfff", "question": "q?", "documents": ["x"]}\n'
        + good.replace('"a"', '"f"').encode()
    )
    return path


def test_batch_rows_not_utf8_or_with_a_lone_surrogate_get_their_own_error(tmp_path):
    from rag_opt.batch.job import jsonl_columns

    cols = jsonl_columns(_bad_rows(tmp_path))
    assert cols["row"] == [0, 1, 2, 3, 4, 5]
    assert cols["id"] == ["a", None, None, "d", None, "f"]
    errors = cols["error"]
    assert errors[0] is None and errors[3] is None and errors[5] is None
    assert errors[1] == "line 2: not UTF-8 text (invalid start byte at byte 49)"
    for i in (2, 4):
        assert errors[i] == (
            f"line {i + 1}: holds a lone UTF-16 surrogate (a \\ud800-style escape without its pair), which is not "
            "Unicode text"
        )
    assert json.loads(cols["documents"][3]) == [{"text": "a pair \U0001f600 is fine"}]
    for value in cols["id"] + cols["question"] + cols["documents"] + errors:  # every value can be written out
        assert value is None or value.encode("utf-8")


def test_batch_reads_bad_rows_into_an_arrow_table(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow (from the ray extra) is not installed")
    import pyarrow.parquet as pq

    from rag_opt.batch.job import read_rows

    table = read_rows(_bad_rows(tmp_path))  # before: UnicodeDecodeError / UnicodeEncodeError, the job died
    assert table.num_rows == 6
    assert [e is None for e in table.column("error").to_pylist()] == [True, False, False, True, False, True]
    # Parquet input with a binary question column: the row that is not UTF-8 gets its error
    binary = tmp_path / "rows.parquet"
    pq.write_table(
        pa.table(
            {
                "question": pa.array([b"q?", b"bad \xff", b"q?"], pa.binary()),
                "documents": pa.array([b'["a."]', b'["b."]', b'["c \xfe"]'], pa.binary()),
                "id": pa.array([b"1", b"2\xff", b"3"], pa.binary()),
            }
        ),
        binary,
    )
    table = read_rows(binary)
    assert table.column("error").to_pylist() == [
        None,
        "row 2: 'question' is not UTF-8 text (invalid start byte at byte 4)",
        "row 3: 'documents' is not UTF-8 text (invalid start byte at byte 4)",
    ]
    assert table.column("id").to_pylist() == ["1", "2\ufffd", "3"]


def test_mcp_limits_are_the_servers_settings(capsys):
    from rag_opt.server.service_limits import SERVICE_LIMITS, ServiceLimits
    from rag_opt.server.settings import ProxySettings

    with pytest.raises(SystemExit):
        main(["mcp", "--help"])
    out = capsys.readouterr().out
    for name in SERVICE_LIMITS:
        assert "--" + name.replace("_", "-") in out
    defaults = ProxySettings(upstream="http://x/v1")
    assert ServiceLimits.from_sources({}, {}) == ServiceLimits.of(defaults)
    limits = ServiceLimits.from_sources({"max_documents": 5}, {"RAG_OPT_TIME_BUDGET_MS": "500", "RAG_OPT_RATIO": "x"})
    assert (limits.max_documents, limits.time_budget_ms) == (5, 500.0)  # only the limits' variables are read
    with pytest.raises(ValueError, match="max_question_tokens"):
        ServiceLimits.from_sources({}, {"RAG_OPT_MAX_QUESTION_TOKENS": "0"})


def test_batch_rows_take_query_as_the_alias_of_question(tmp_path):
    """One vocabulary: a batch row may name its question 'query', as the Python API does; both at once is an
    error of that row only."""
    from rag_opt.batch.job import jsonl_columns

    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        json.dumps({"id": "a", "question": "Who?", "documents": ["x."]})
        + "\n"
        + json.dumps({"id": "b", "query": "Where?", "documents": ["y."]})
        + "\n"
        + json.dumps({"id": "c", "query": "When?", "question": "When?", "documents": ["z."]})
        + "\n"
    )
    cols = jsonl_columns(rows)
    assert cols["question"][:2] == ["Who?", "Where?"] and cols["error"][:2] == [None, None]
    assert "as 'question' or as 'query'" in cols["error"][2]
