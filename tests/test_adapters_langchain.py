"""The LangChain adapter: compressor inside ContextualCompressionRetriever, LCEL runnable, the example chain.

Retrieval is real: the example's BM25 retriever over HotpotQA dev paragraphs. Most tests score with the BM25
scorer (the adapter only translates, so any scorer exercises it, in milliseconds); the ``model`` tests run the
real proxy model with a few small retrieved sets.
"""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from langchain_classic.retrievers import ContextualCompressionRetriever
from langchain_classic.retrievers.document_compressors import DocumentCompressorPipeline
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.runnables import ConfigurableField
from pydantic import ValidationError

from rag_opt.adapters.langchain import (
    METADATA_KEY,
    RagOptCompressor,
    RagOptRunnable,
    format_documents,
    to_langchain_documents,
)
from rag_opt.compressors.baselines import BM25Scorer
from rag_opt.pipeline import ContextOptimizer
from tests.helpers import data_path, hotpot_dev

ROOT = Path(__file__).resolve().parents[1]


def _load_example() -> Any:
    spec = importlib.util.spec_from_file_location("langchain_rag_example", ROOT / "examples" / "langchain_rag.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the retriever's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example() -> Any:
    return _load_example()


@pytest.fixture(scope="module")
def corpus(example: Any) -> list[Document]:
    data_path("hotpotqa", "dev.jsonl.gz")
    return example.load_corpus(corpus_questions=60)


@pytest.fixture(scope="module")
def retriever(example: Any, corpus: list[Document]) -> Any:
    return example.BM25Retriever(documents=corpus, k=4)


@pytest.fixture(scope="module")
def questions() -> list[str]:
    return [ex["question"] for ex in hotpot_dev(12)[8:12]]


@pytest.fixture()
def bm25_opt() -> ContextOptimizer:
    return ContextOptimizer(scorer=BM25Scorer())


def _doc_key(d: Document) -> tuple[Any, ...]:
    return (d.id, d.page_content, repr(sorted(d.metadata.items())))


def _check_outputs(retrieved: list[Document], outputs: list[Document]) -> None:
    """Outputs are kept parts of retrieved documents, with ids and original metadata preserved."""
    by_id = {d.id: d for d in retrieved}
    assert len({d.id for d in outputs}) == len(outputs)
    for rank, out in enumerate(outputs):
        original = by_id[out.id]
        info = out.metadata[METADATA_KEY]
        assert {k: v for k, v in out.metadata.items() if k != METADATA_KEY} == original.metadata
        assert retrieved[info["index"]] is original or retrieved[info["index"]].id == original.id
        assert info["rank"] == rank
        # the kept offsets point into the original text and rebuild the output text
        assert "".join(original.page_content[s:e] for s, e in info["kept_spans"]) == out.page_content
        kept_units = [u for u in info["units"] if u["kept"]]
        assert kept_units and all(
            original.page_content[u["start"] : u["end"]].rstrip() in out.page_content for u in kept_units
        )  # a unit's trailing space is not left at the end of the kept text
        assert 0 < info["tokens_after"] <= info["tokens_before"]


# -- import hygiene -------------------------------------------------------------------------------------------
def test_import_does_not_load_torch() -> None:
    code = (
        "import sys, rag_opt.adapters.langchain as m; m.RagOptRunnable(ratio=0.5); m.RagOptCompressor(ratio=0.5); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


# -- the compressor -------------------------------------------------------------------------------------------
def test_compressor_in_contextual_compression_retriever(retriever: Any, questions: list[str], bm25_opt) -> None:
    compressor = RagOptCompressor(optimizer=bm25_opt, ratio=0.4)
    ccr = ContextualCompressionRetriever(base_compressor=compressor, base_retriever=retriever)
    for q in questions[:2]:
        retrieved = retriever.invoke(q)
        assert len(retrieved) == 4 and all("bm25" in d.metadata and "title" in d.metadata for d in retrieved)
        outputs = ccr.invoke(q)
        _check_outputs(retrieved, outputs)
        # a thin adapter: exactly what the optimizer returns for the same documents
        direct = bm25_opt.optimize(q, retrieved, ratio=0.4)
        assert [d.page_content for d in outputs] == [d.text for d in direct.documents]
        assert sum(d.metadata[METADATA_KEY]["tokens_after"] for d in outputs) == direct.tokens_after
        assert direct.token_budget is not None and direct.tokens_after <= direct.token_budget < direct.tokens_before


def test_compressor_async_and_in_a_compressor_pipeline(retriever: Any, questions: list[str], bm25_opt) -> None:
    pipeline = DocumentCompressorPipeline(transformers=[RagOptCompressor(optimizer=bm25_opt, target_tokens=120)])
    ccr = ContextualCompressionRetriever(base_compressor=pipeline, base_retriever=retriever)
    q = questions[2]
    sync = ccr.invoke(q)
    asynchronous = asyncio.run(ccr.ainvoke(q))
    assert [_doc_key(d) for d in sync] == [_doc_key(d) for d in asynchronous]
    _check_outputs(retriever.invoke(q), sync)
    assert sum(d.metadata[METADATA_KEY]["tokens_after"] for d in sync) <= 120


def test_compressor_empty_and_bad_input(bm25_opt) -> None:
    compressor = RagOptCompressor(optimizer=bm25_opt, ratio=0.5)
    assert compressor.compress_documents([], "who?") == []
    with pytest.raises(TypeError, match=r"documents\[1\]"):
        compressor.compress_documents([Document(page_content="A sentence."), 42], "who?")  # type: ignore[list-item]
    with pytest.raises(ValueError, match="query is empty"):
        compressor.compress_documents([Document(page_content="A sentence.")], "  ")
    with pytest.raises(ValidationError, match="at most one of"):
        RagOptCompressor(ratio=0.5, target_tokens=10)
    with pytest.raises(ValidationError, match="unknown ordering"):
        RagOptCompressor(ordering="sideways")
    scored = RagOptCompressor(optimizer=bm25_opt, ratio=0.5, score_key="bm25")
    with pytest.raises(TypeError, match="must be a number"):
        scored.compress_documents([Document(page_content="A sentence.", metadata={"bm25": "high"})], "who?")


def test_relevance_ordering_without_compression_uses_our_scores() -> None:
    # ordering by relevance scores the documents (here with the BM25 scorer) and keeps every sentence;
    # the retriever's score (score_key) is carried along, not used, when our relevance exists
    texts = ["Rome is in Italy.", "Paris is the capital of France.", "France borders Spain."]
    docs = [
        Document(page_content=t, metadata={"s": s}, id=f"d{i}")
        for i, (t, s) in enumerate(zip(texts, [3, 1, 2], strict=True))
    ]
    opt = ContextOptimizer(scorer=BM25Scorer(), ratio=1.0)  # ratio 1: keep everything (the default is 0.5)
    out = RagOptCompressor(optimizer=opt, ordering="relevance", score_key="s").compress_documents(
        docs, "capital of France?"
    )
    assert [d.id for d in out] == ["d1", "d2", "d0"]
    assert [d.page_content for d in out] == [texts[1], texts[2], texts[0]]
    assert [d.metadata["s"] for d in out] == [1, 2, 3]


# -- the runnable ---------------------------------------------------------------------------------------------
def test_runnable_invoke_batch_and_async_are_identical(retriever: Any, questions: list[str], bm25_opt) -> None:
    runnable = RagOptRunnable(optimizer=bm25_opt, ratio=0.4, ordering="lost_in_the_middle")
    inputs = [{"question": q, "documents": retriever.invoke(q)} for q in questions]
    one_by_one = [runnable.invoke(x) for x in inputs]
    batched = runnable.batch(inputs)
    single_async = [asyncio.run(runnable.ainvoke(x)) for x in inputs]
    batched_async = asyncio.run(runnable.abatch(inputs))
    expected = [[_doc_key(d) for d in out] for out in one_by_one]
    for other in (batched, single_async, batched_async):
        assert [[_doc_key(d) for d in out] for out in other] == expected
    for x, out in zip(inputs, one_by_one, strict=True):
        _check_outputs(x["documents"], out)


def test_runnable_batch_shares_one_optimize_batch_and_keeps_errors_in_place(
    retriever: Any, questions: list[str], bm25_opt, monkeypatch
) -> None:
    runnable = RagOptRunnable(optimizer=bm25_opt, ratio=0.4)
    good = [{"question": q, "documents": retriever.invoke(q)} for q in questions[:2]]
    calls: list[int] = []
    real = bm25_opt.optimize_batch

    def spy(queries, documents, **kw):
        calls.append(len(queries))
        return real(queries, documents, **kw)

    monkeypatch.setattr(bm25_opt, "optimize_batch", spy)
    out = runnable.batch([good[0], {"documents": []}, good[1]], return_exceptions=True)
    assert calls == [2]  # the two valid inputs went through one batched call
    assert isinstance(out[1], ValueError) and "missing 'question'" in str(out[1])
    assert [_doc_key(d) for d in out[0]] == [_doc_key(d) for d in runnable.invoke(good[0])]
    with pytest.raises(ValueError, match="missing 'question'"):
        runnable.batch([good[0], {"documents": []}])


def test_runnable_after_a_retriever_with_the_question_in_config(retriever: Any, questions: list[str], bm25_opt):
    runnable = RagOptRunnable(optimizer=bm25_opt, ratio=0.4)
    q = questions[0]
    chained = (retriever | runnable).invoke(q, config={"configurable": {"question": q}})
    direct = runnable.invoke({"question": q, "documents": retriever.invoke(q)})
    assert [_doc_key(d) for d in chained] == [_doc_key(d) for d in direct]
    with pytest.raises(ValueError, match="no question"):
        (retriever | runnable).invoke(q)


def test_runnable_schemas(retriever: Any, questions: list[str], bm25_opt) -> None:
    runnable = RagOptRunnable(optimizer=bm25_opt, ratio=0.5)
    schema = runnable.get_input_jsonschema()
    assert schema["title"] == "RagOptRunnableInput"
    dict_form = schema["$defs"]["RagOptInput"]
    assert set(dict_form["required"]) == {"question", "documents"}
    assert dict_form["properties"]["question"]["type"] == "string"
    out_schema = runnable.get_output_jsonschema()
    assert out_schema["type"] == "array" and out_schema["items"]["$ref"].endswith("/Document")

    q = questions[1]
    docs = retriever.invoke(q)
    in_model = runnable.get_input_schema()
    in_model.model_validate({"question": q, "documents": docs})
    in_model.model_validate(docs)
    with pytest.raises(ValidationError):
        in_model.model_validate({"documents": docs})
    out = runnable.invoke({"question": q, "documents": docs})
    validated = runnable.get_output_schema().model_validate(out)
    assert [d.page_content for d in validated.root] == [d.page_content for d in out]
    assert runnable.get_config_jsonschema() is not None


class _Recorder(BaseCallbackHandler):
    def __init__(self) -> None:
        self.starts: list[tuple[str | None, list[str]]] = []
        self.ends: list[Any] = []

    def on_chain_start(self, serialized: Any, inputs: Any, *, name: str | None = None, tags=None, **kw: Any) -> None:
        self.starts.append((name, list(tags or [])))

    def on_chain_end(self, outputs: Any, **kw: Any) -> None:
        self.ends.append(outputs)


def test_runnable_callbacks_tracing_names_and_with_config(retriever: Any, questions: list[str], bm25_opt) -> None:
    runnable = RagOptRunnable(optimizer=bm25_opt, ratio=0.5)
    assert runnable.get_name() == "RagOptRunnable"
    q = questions[0]
    x = {"question": q, "documents": retriever.invoke(q)}

    rec = _Recorder()
    out = runnable.invoke(x, config={"callbacks": [rec], "tags": ["rag"]})
    assert rec.starts == [("RagOptRunnable", ["rag"])]
    assert len(rec.ends) == 1 and [d.page_content for d in rec.ends[0]] == [d.page_content for d in out]

    rec = _Recorder()
    renamed = runnable.with_config(run_name="compress_context", tags=["t1"])
    assert [_doc_key(d) for d in renamed.invoke(x, config={"callbacks": [rec]})] == [_doc_key(d) for d in out]
    assert rec.starts == [("compress_context", ["t1"])]

    rec = _Recorder()
    asyncio.run(renamed.ainvoke(x, config={"callbacks": [rec]}))
    assert rec.starts == [("compress_context", ["t1"])]


def test_runnable_configurable_fields(retriever: Any, questions: list[str], bm25_opt) -> None:
    runnable = RagOptRunnable(optimizer=bm25_opt, ratio=0.8).configurable_fields(
        ratio=ConfigurableField(id="rag_opt_ratio", name="rag-opt ratio")
    )
    q = questions[3]
    x = {"question": q, "documents": retriever.invoke(q)}

    def kept_tokens(docs: list[Document]) -> int:
        return sum(d.metadata[METADATA_KEY]["tokens_after"] for d in docs)

    loose = kept_tokens(runnable.invoke(x))
    tight = kept_tokens(runnable.with_config(configurable={"rag_opt_ratio": 0.2}).invoke(x))
    assert 0 < tight < loose
    assert "rag_opt_ratio" in str(runnable.get_config_jsonschema())


def test_runnable_accepts_strings_and_dicts_and_keeps_metadata(bm25_opt) -> None:
    # ratio 1: nothing dropped, everything kept verbatim; input order, so the checks read the documents as given
    runnable = RagOptRunnable(optimizer=bm25_opt, ratio=1.0, ordering="input")
    docs: list[Any] = [
        {"text": "Paris is the capital of France. It is large.", "title": "Paris", "id": "p", "metadata": {"k": 1}},
        "Berlin is the capital of Germany.",
        Document(page_content="Rome is in Italy.", metadata={"src": "wiki", "nested": {"a": [1, 2]}}, id="r"),
    ]
    out = runnable.invoke({"query": "What is the capital of France?", "documents": docs})
    assert [d.id for d in out] == ["p", None, "r"]
    assert out[0].metadata["k"] == 1 and out[0].metadata["title"] == "Paris"
    assert out[2].metadata["nested"] == {"a": [1, 2]} and out[2].metadata["src"] == "wiki"
    assert [d.page_content for d in out] == [docs[0]["text"], docs[1], "Rome is in Italy."]
    assert docs[2].metadata == {"src": "wiki", "nested": {"a": [1, 2]}}  # the input is not modified


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ("just a string", TypeError, "expects"),
        ({"documents": ["x."]}, ValueError, "missing 'question'"),
        ({"question": "q?"}, ValueError, "missing 'documents'"),
        ({"question": 3, "documents": ["x."]}, TypeError, "question must be a string"),
        ({"question": "q?", "documents": "x."}, TypeError, "list of documents"),
        ({"question": "q?", "documents": [{"txt": "x."}]}, ValueError, r"documents\[0\]"),
        (["x."], ValueError, "no question"),
    ],
)
def test_runnable_bad_input(value: Any, error: type[Exception], message: str, bm25_opt) -> None:
    with pytest.raises(error, match=message):
        RagOptRunnable(optimizer=bm25_opt, ratio=0.5).invoke(value)


def test_runnable_bad_settings() -> None:
    with pytest.raises(ValidationError, match=r"ratio must be in \(0, 1\]"):
        RagOptRunnable(ratio=1.5)
    with pytest.raises(ValidationError):
        RagOptRunnable(optimizer="not an optimizer")  # type: ignore[arg-type]


def test_format_documents_matches_the_result_context(retriever: Any, questions: list[str], bm25_opt) -> None:
    q = questions[2]
    docs = retriever.invoke(q)
    result = bm25_opt.optimize(q, docs, ratio=0.5, ordering="relevance")
    lc = to_langchain_documents(result, docs)
    assert format_documents(lc) == result.context()
    assert format_documents(lc, with_titles=False) == result.context(with_titles=False)
    with pytest.raises(TypeError, match="Documents"):
        format_documents("text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="covers"):
        to_langchain_documents(result, docs[:1])


# -- the example chain ----------------------------------------------------------------------------------------
def test_example_chain_with_a_chat_model(example: Any, retriever: Any, questions: list[str], bm25_opt) -> None:
    llm = FakeListChatModel(responses=["YG Entertainment"])
    chain = example.build_chain(retriever, RagOptRunnable(optimizer=bm25_opt, ratio=0.4), llm)
    q = questions[0]
    rec = _Recorder()
    out = chain.invoke(q, config={"callbacks": [rec]})
    assert out["answer"] == "YG Entertainment"
    assert out["context"] == format_documents(out["optimized"])
    human = out["prompt"].to_messages()[-1].content
    assert out["context"] in human and q in human
    names = [n for n, _ in rec.starts]
    assert names[0] == "rag_opt_rag_chain" and "RagOptRunnable" in names and "format_documents" in names
    counter = bm25_opt.counter
    assert counter.count(out["context"]) < counter.count(format_documents(out["documents"]))


@pytest.mark.model
def test_example_runs_offline_and_prints_the_prompt(example: Any, monkeypatch, capsys) -> None:
    data_path("hotpotqa", "dev.jsonl.gz")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert example.main(["--k", "3", "--corpus-questions", "60"]) == 0
    out = capsys.readouterr().out
    question = (ROOT / "examples" / "hotpotqa_question.txt").read_text().strip()
    assert "No chat model configured" in out and f"Question: {question}" in out
    assert "[human]" in out and "Context:" in out


# -- the real proxy model -------------------------------------------------------------------------------------
@pytest.mark.model
def test_real_model_compressor_and_runnable_agree_sync_async_batch(
    example: Any, corpus: list[Document], questions: list[str]
) -> None:
    """ContextualCompressionRetriever (async), runnable invoke and batch (thread pool): one proxy, same output."""
    retriever = example.BM25Retriever(documents=corpus, k=3)  # a small context keeps the forward passes short
    opt = ContextOptimizer()
    q = questions[2]
    docs = retriever.invoke(q)
    ccr = ContextualCompressionRetriever(
        base_compressor=RagOptCompressor(optimizer=opt, ratio=0.4), base_retriever=retriever
    )
    via_ccr_async = asyncio.run(ccr.ainvoke(q))
    runnable = RagOptRunnable(optimizer=opt, ratio=0.4)
    via_invoke = runnable.invoke({"question": q, "documents": docs})
    via_batch = runnable.batch([{"question": q, "documents": docs}])[0]
    expected = [_doc_key(d) for d in via_invoke]
    assert [_doc_key(d) for d in via_ccr_async] == expected == [_doc_key(d) for d in via_batch]
    _check_outputs(docs, via_invoke)
    info = [d.metadata[METADATA_KEY] for d in via_invoke]
    assert all(i["scorer"] in ("probe", "raw-attention") and i["score"] is not None for i in info)
    assert all(u["score"] is not None for i in info for u in i["units"] if u["kind"] != "heading")
    assert sum(i["tokens_after"] for i in info) < sum(opt.counter.count(d.page_content) for d in docs)


def test_unknown_options_are_refused_naming_the_closest(bm25_opt) -> None:
    with pytest.raises(ValidationError, match=r"unknown option\(s\) 'rati' \(did you mean 'ratio'\?\)"):
        RagOptCompressor(rati=0.5)
    with pytest.raises(ValidationError, match="either optimizer= or ContextOptimizer options"):
        RagOptRunnable(optimizer=bm25_opt, keep_best_per_doc=True)
    # every ContextOptimizer option builds the optimizer; a Budget is spread into the per-call fields
    from rag_opt import Budget

    c = RagOptCompressor(ratio=0.5, keep_best_per_doc=True, tier="lexical", language="de")
    assert c.optimizer.selection_options.keep_best_per_doc and c.optimizer.tier == "lexical"
    assert c.optimizer.language == "de"
    r = RagOptRunnable(budget=Budget(target_tokens=120), tier="lexical")
    assert (r.target_tokens, r.ratio) == (120, None)
    with pytest.raises(ValidationError, match="either as budget= or as ratio"):
        RagOptRunnable(budget=Budget(ratio=0.5), ratio=0.3)


def test_importing_without_langchain_core_names_what_to_install() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['langchain_core'] = None\n"
        "try:\n    import rag_opt.adapters.langchain\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "rag_opt.adapters.langchain needs langchain-core: pip install" in out.stdout and "[langchain]" in out.stdout
    assert "Traceback" not in out.stderr
