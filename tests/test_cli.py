from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from rag_opt.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_via_console_entry_point():
    out = subprocess.run([sys.executable, "-m", "rag_opt.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "optimize" in out.stdout and "models" in out.stdout


def test_missing_file(capsys, tmp_path):
    code, _, err = run(capsys, "optimize", "-q", "who?", "-i", str(tmp_path / "nope.jsonl"))
    assert code == 2
    assert "input file not found" in err and "Traceback" not in err


def test_bad_json_line_number(capsys, tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_text('{"text": "fine"}\n\n{"text": broken}\n')
    code, _, err = run(capsys, "optimize", "-q", "who?", "-i", str(f))
    assert code == 2 and "line 3: invalid JSON" in err


def test_a_number_too_long_or_nesting_too_deep_is_the_line_s_error_not_a_traceback(capsys, tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_text('{"text": "fine"}\n{"id": ' + "7" * 5000 + ', "text": "x"}\n')
    code, _, err = run(capsys, "optimize", "-q", "who?", "-i", str(f))
    assert code == 2 and "line 2: invalid JSON (a number too long to read" in err and "Traceback" not in err
    f.write_text('{"text": "fine"}\n' + "[" * 100_000 + "\n")
    code, _, err = run(capsys, "optimize", "-q", "who?", "-i", str(f))
    assert code == 2 and "line 2: invalid JSON" in err and "Traceback" not in err


def test_line_without_text(capsys, tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_text('{"id": "a"}\n')
    code, _, err = run(capsys, "optimize", "-q", "who?", "-i", str(f))
    assert code == 2 and "line 1: missing string field 'text'" in err


def test_empty_query(capsys, tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_text('{"text": "fine"}\n')
    code, _, err = run(capsys, "optimize", "-q", "  ", "-i", str(f))
    assert code == 2 and "--query is empty" in err


@pytest.mark.parametrize("ratio", ["0", "1.5", "-0.2", "abc"])
def test_ratio_out_of_range(capsys, ratio):
    with pytest.raises(SystemExit) as exc:
        main(["optimize", "-q", "who?", "-i", "x.jsonl", "--ratio", ratio])
    assert exc.value.code == 2
    assert "ratio must be" in capsys.readouterr().err


def test_ratio_and_target_tokens_together(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["optimize", "-q", "who?", "-i", "x.jsonl", "--ratio", "0.5", "--target-tokens", "100"])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_models_reports_the_embedded_model(capsys):
    code, out, _ = run(capsys, "models")
    assert code == 0
    assert "embedded:smollm2-135m" in out and "SmolLM2-135M-Instruct" in out and ".gguf" in out
    # each encoding's shipped sentence probe, by its kind: the default (parallel) one has a hidden layer
    parallel = next(line for line in out.splitlines() if "probe, parallel (the default):" in line)
    joint = next(line for line in out.splitlines() if "probe, joint:" in line)
    assert "shipped, one hidden layer of 192 units, lexical features around it" in parallel
    assert "shipped, logistic" in joint


@pytest.mark.model
def test_optimize_prints_context_and_savings(capsys):
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "examples"
    question = (root / "hotpotqa_question.txt").read_text().strip()
    code, out, err = run(capsys, "optimize", "-q", question, "-i", str(root / "hotpotqa_docs.jsonl"), "--ratio", "0.33")
    assert code == 0
    assert "saved" in err and "tokens" in err
    assert out.strip()
    # the time it took, and how much of it loading the model was (the first call's, in this process)
    summary = next(line for line in err.splitlines() if line.startswith("--- rag-opt: "))
    assert re.search(r"; \d+ ms(, \d+ ms of it loading the proxy model)?$", summary), summary
    code, out, _ = run(
        capsys,
        "optimize",
        "-q",
        question,
        "-i",
        str(root / "hotpotqa_docs.jsonl"),
        "--ratio",
        "0.33",
        "--json",
    )
    data = json.loads(out)
    assert data["tokens_after"] <= data["token_budget"] < data["tokens_before"]


@pytest.mark.model
def test_drop_below_best_from_the_command_line(capsys):
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "examples"
    question = (root / "hotpotqa_question.txt").read_text().strip()
    args = ["optimize", "-q", question, "-i", str(root / "hotpotqa_docs.jsonl"), "--ratio", "0.5"]
    code, _, err = run(capsys, *args, "--drop-below-best", "0")
    assert code == 2 and "drop_below_best must be in (0, 1]" in err
    code, out, _ = run(capsys, *args, "--drop-below-best", "0.5", "--json")
    data = json.loads(out)
    assert code == 0 and data["dropped"]
    assert any("far below the best" in w for w in data["warnings"])


def test_optimize_on_the_lexical_tier_loads_no_model(capsys):
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "examples"
    question = (root / "hotpotqa_question.txt").read_text().strip()
    args = ["optimize", "-q", question, "-i", str(root / "hotpotqa_docs.jsonl"), "--ratio", "0.5", "--json"]
    code, out, _ = run(capsys, *args, "--tier", "lexical", "--drop-below-best", "0.5")
    data = json.loads(out)
    assert code == 0 and data["tier"] == "lexical" and data["proxy_model"] is None
    assert data["tokens_after"] <= data["token_budget"] and data["dropped"]
    assert any("far below the best" in w for w in data["warnings"])


def test_optimize_help_says_what_it_does_the_input_format_and_an_example_that_runs(capsys, tmp_path, monkeypatch):
    import shlex

    with pytest.raises(SystemExit):
        main(["optimize", "--help"])
    out = capsys.readouterr().out
    assert "Compress and reorder retrieved documents" in out and "JSON lines, one document per" in out
    assert '"text"' in out and "standard output" in out
    example = out[out.index("example:") :].splitlines()[1:]
    monkeypatch.chdir(tmp_path)
    for line in example[:-1]:  # echo '{...}' >(>) docs.jsonl
        words = shlex.split(line)
        assert words[0] == "echo" and words[-1] == "docs.jsonl"
        with open("docs.jsonl", "a" if words[-2] == ">>" else "w", encoding="utf-8") as fh:
            fh.write(words[1] + "\n")
    command = shlex.split(example[-1])
    assert command[0] == "rag-opt"
    code, context, err = run(capsys, *command[1:])
    assert code == 0 and "Bees make honey from nectar." in context and "--- rag-opt:" in err


@pytest.mark.parametrize(
    ("argv", "flag", "what", "where"),
    [
        (
            ["train-probe", "--out", "p.json"],
            "--data",
            "HotpotQA questions with sentence-level supporting facts",
            "https://hotpotqa.github.io",
        ),
        (["train-lexical-probe", "--out", "p.json"], "--data", "supporting facts", "https://hotpotqa.github.io"),
        (
            ["train-doc-probe", "--out", "p.json"],
            "--data",
            "the NQ multi-document file",
            "github.com/nelson-liu/lost-in-the-middle",
        ),
        (
            ["calibrate", "--reader", "some-llm", "--n-docs", "5"],
            "--data",
            "the NQ multi-document file",
            "github.com/nelson-liu/lost-in-the-middle",
        ),
    ],
)
def test_training_commands_say_what_a_missing_data_file_is_and_where_to_get_it(
    capsys, tmp_path, monkeypatch, argv, flag, what, where
):
    monkeypatch.setenv("RAG_OPT_DATA_DIR", str(tmp_path))  # an empty data folder
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, *argv)
    assert code == 2 and "Traceback" not in err
    assert f"data not found: {tmp_path}/" in err and "$RAG_OPT_DATA_DIR" in err and what in err and where in err
    code, _, err = run(capsys, *argv, flag, str(tmp_path / "elsewhere.jsonl.gz"))  # a path given: named as given
    assert code == 2 and "elsewhere.jsonl.gz" in err and what in err and where in err
    with pytest.raises(SystemExit):
        main([argv[0], "--help"])
    help_text = "".join(capsys.readouterr().out.split())  # argparse wraps lines (a URL at its hyphens too)
    assert all("".join(s.split()) in help_text for s in (what, where, "$RAG_OPT_DATA_DIR"))


def test_train_probe_names_its_nq_file_too(capsys, tmp_path, monkeypatch):
    (tmp_path / "hotpotqa").mkdir()
    (tmp_path / "hotpotqa" / "train.jsonl.gz").write_bytes(b"")
    monkeypatch.setenv("RAG_OPT_DATA_DIR", str(tmp_path))
    code, _, err = run(capsys, "train-probe", "--out", str(tmp_path / "p.json"), "--nq", "5", "--cached-only")
    assert code == 2 and "--nq-data is the NQ multi-document file" in err and "nq_multidoc" in err
