"""``rag-opt mcp`` and ``rag-opt batch`` on the command line: help, missing extras, bad input (no model, no Ray)."""

from __future__ import annotations

import sys

import pytest

from rag_opt.cli import build_parser, main


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
    assert message in err and "pip install 'rag-opt[" in err and "Traceback" not in err


def test_batch_input_errors_exit_with_status_2(capsys, tmp_path):
    pytest.importorskip("pyarrow", reason="pyarrow (from the ray extra) is not installed")
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'rag-opt[ray]'")
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
