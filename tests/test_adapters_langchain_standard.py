"""LangChain's own standard retriever tests (``langchain-tests``) on a compression retriever built with rag-opt.

The retriever is what a LangChain user builds: ``ContextualCompressionRetriever`` with
``RagOptCompressor`` in front of a base retriever (here BM25 over the 10 paragraphs of real HotpotQA dev questions),
read by the real embedded proxy model. A compressor may drop whole documents, which breaks a retriever's "``k``
documents" contract; ``keep_best_per_doc=True`` keeps every document (at least its best sentence), and with it the
standard tests pass.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("langchain_tests", reason="langchain-tests is not installed (pip install -e '.[dev]')")
pytest.importorskip("langchain_classic", reason="langchain-classic is not installed (pip install -e '.[dev]')")

from langchain_classic.retrievers import ContextualCompressionRetriever  # noqa: E402
from langchain_core.callbacks import CallbackManagerForRetrieverRun  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.retrievers import BaseRetriever  # noqa: E402
from langchain_tests.integration_tests import RetrieversIntegrationTests  # noqa: E402

from rag_opt import ContextOptimizer  # noqa: E402
from rag_opt.adapters.langchain import RagOptCompressor  # noqa: E402
from rag_opt.compressors.lexical import bm25_scores  # noqa: E402
from tests.helpers import hotpot_dev, hotpot_docs  # noqa: E402

# LangChain's async standard test runs on pytest-asyncio (a langchain-tests dependency, strict mode: rag-opt's own
# async tests run on anyio): marked on the inherited function itself, so nothing is overridden
pytest.mark.asyncio(RetrieversIntegrationTests.test_ainvoke_returns_documents)

_OPTIMIZER: ContextOptimizer | None = None


def _optimizer() -> ContextOptimizer:
    global _OPTIMIZER
    if _OPTIMIZER is None:  # one proxy model for every retriever the standard tests build
        _OPTIMIZER = ContextOptimizer(keep_best_per_doc=True)
    return _OPTIMIZER


class HotpotBM25Retriever(BaseRetriever):
    """The base retriever: BM25 over the paragraphs of the first HotpotQA dev questions, top ``k``."""

    k: int = 4
    documents: list[Document]

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, k: int | None = None
    ) -> list[Document]:
        scores = bm25_scores(query, [d.page_content for d in self.documents])
        top = sorted(range(len(scores)), key=lambda i: -float(scores[i]))[: k or self.k]
        return [self.documents[i] for i in top]


class RagOptRetriever(ContextualCompressionRetriever):
    """A compression retriever with rag-opt (ratio 1/2, every document kept) over :class:`HotpotBM25Retriever`."""

    def __init__(self, k: int = 4, **kwargs: Any) -> None:
        docs = [
            Document(page_content=d["text"], metadata={"title": d["title"]}, id=f"{i}-{d['id']}")
            for i, ex in enumerate(hotpot_dev(3))
            for d in hotpot_docs(ex)
        ]
        super().__init__(
            base_compressor=RagOptCompressor(optimizer=_optimizer(), ratio=0.5),
            base_retriever=HotpotBM25Retriever(k=k, documents=docs),
            **kwargs,
        )


@pytest.mark.model
class TestRagOptRetrieverStandard(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[RagOptRetriever]:
        return RagOptRetriever

    @property
    def retriever_query_example(self) -> str:
        return hotpot_dev(1)[0]["question"]


@pytest.mark.model
def test_without_keep_best_per_doc_a_document_can_be_dropped() -> None:
    """The contract a compressor changes: at a tight budget a whole document may go (why the standard tests run
    with keep_best_per_doc=True, which keeps each document's best sentence while the budget allows)."""
    ex = hotpot_dev(2)[1]
    docs = [Document(page_content=d["text"], id=d["id"]) for d in hotpot_docs(ex)][:4]
    plain = RagOptCompressor(optimizer=ContextOptimizer(), ratio=0.3).compress_documents(docs, ex["question"])
    kept_all = RagOptCompressor(optimizer=_optimizer(), ratio=0.3).compress_documents(docs, ex["question"])
    assert len(plain) < len(docs) == len(kept_all)
    # the same option through the adapter's own keywords (it builds the optimizer), not silently dropped
    direct = RagOptCompressor(ratio=0.3, keep_best_per_doc=True).compress_documents(docs, ex["question"])
    assert [d.page_content for d in direct] == [d.page_content for d in kept_all]
