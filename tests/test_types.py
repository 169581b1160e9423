from __future__ import annotations

import json

import pytest
from langchain_core.documents import Document as LCDocument

from rag_opt.types import Document, OptimizeResult, OutputDocument, to_documents


def test_accepts_strings_dicts_documents_and_langchain():
    docs = to_documents(
        [
            "plain text",
            {"text": "dict text", "id": 7, "metadata": {"a": 1}, "score": 0.5, "title": "T"},
            Document(text="ours", id="x"),
            LCDocument(page_content="lc text", metadata={"source": "s"}, id="lc1"),
        ]
    )
    assert [d.text for d in docs] == ["plain text", "dict text", "ours", "lc text"]
    assert docs[1].id == "7" and docs[1].metadata == {"a": 1} and docs[1].score == 0.5 and docs[1].title == "T"
    assert docs[3].metadata == {"source": "s"} and docs[3].id == "lc1"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([{"txt": "x"}], r"documents\[0\]: unknown field"),
        ([{"text": 3}], r"documents\[0\]: 'text' must be a string"),
        (["ok", {"text": "x", "metadata": []}], r"documents\[1\]: 'metadata' must be an object"),
        (["ok", 42], r"documents\[1\]: unsupported document type int"),
        ([{"text": "x", "score": "high"}], r"'score' must be a number"),
        ([{"text": "x", "score": float("nan")}], r"finite"),
    ],
)
def test_bad_documents_name_the_problem(bad, message):
    with pytest.raises((TypeError, ValueError), match=message):
        to_documents(bad)


def test_single_string_is_not_a_document_list():
    with pytest.raises(TypeError, match="list of documents"):
        to_documents("just one string")


@pytest.mark.parametrize("bad", [None, 5, 3.5])
def test_documents_that_are_no_list_raise_a_rag_opt_error_naming_the_type(bad):
    from rag_opt.errors import InvalidInputTypeError

    with pytest.raises(InvalidInputTypeError, match=f"list of documents .* got {type(bad).__name__}"):
        to_documents(bad)


def test_result_json_round_trip():
    r = OptimizeResult(
        query="q",
        documents=[OutputDocument(id="0", index=0, text="kept", metadata={"k": "v"}, kept_spans=[(0, 4)])],
        tokens_before=10,
        tokens_after=4,
        target_tokenizer="o200k_base",
        scorer="probe",
    )
    data = json.loads(r.to_json())
    assert data["ratio"] == pytest.approx(0.4)
    assert data["documents"][0]["metadata"] == {"k": "v"}
    assert r.tokens_saved == 6
    assert OptimizeResult.model_validate({k: v for k, v in data.items() if k != "ratio"}) == r
