"""The LlamaIndex node postprocessor, per node, inside a real query engine over HotpotQA paragraphs.

Skipped when llama-index-core (the ``llamaindex`` extra) is not installed.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_index.core", reason="llama-index-core is not installed (pip install -e '.[llamaindex]')")

from llama_index.core.llms import MockLLM  # noqa: E402
from llama_index.core.query_engine import RetrieverQueryEngine  # noqa: E402
from llama_index.core.retrievers import BaseRetriever  # noqa: E402
from llama_index.core.schema import ImageNode, NodeWithScore, QueryBundle, TextNode  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from rag_opt.adapters.llamaindex import METADATA_KEY, RagOptNodePostprocessor  # noqa: E402
from rag_opt.compressors.baselines import BM25Scorer  # noqa: E402
from rag_opt.pipeline import ContextOptimizer  # noqa: E402
from tests.helpers import hotpot_dev  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class BM25NodeRetriever(BaseRetriever):
    """BM25 (bm25s) over TextNodes: a real retriever without embeddings."""

    def __init__(self, nodes: list[TextNode], k: int = 4) -> None:
        import bm25s

        self._nodes = nodes
        self._k = k
        texts = [f"{n.metadata.get('title', '')}. {n.text}" for n in nodes]
        self._index = bm25s.BM25()
        self._index.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
        super().__init__()

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        import bm25s

        words = bm25s.tokenize([query_bundle.query_str], stopwords="en", return_ids=False, show_progress=False)[0]
        known = [w for w in words if w in self._index.vocab_dict]
        if not known:
            return []
        ids, scores = self._index.retrieve([known], k=min(self._k, len(self._nodes)), show_progress=False)
        return [NodeWithScore(node=self._nodes[int(i)], score=float(s)) for i, s in zip(ids[0], scores[0], strict=True)]


@pytest.fixture(scope="module")
def examples() -> list[dict[str, Any]]:
    return hotpot_dev(40)


@pytest.fixture(scope="module")
def retriever(examples: list[dict[str, Any]]) -> BM25NodeRetriever:
    seen: dict[str, TextNode] = {}
    for ex in examples:
        for title, sentences in ex["context"]:
            if title not in seen:
                seen[title] = TextNode(
                    text="".join(sentences),
                    id_=f"hotpot:{title}",
                    metadata={"title": title, "source": "hotpotqa/dev"},
                    excluded_embed_metadata_keys=["source"],
                )
    return BM25NodeRetriever(list(seen.values()), k=4)


def _check_nodes(retrieved: list[NodeWithScore], out: list[NodeWithScore]) -> None:
    by_id = {n.node.node_id: n for n in retrieved}
    assert len({n.node.node_id for n in out}) == len(out) <= len(retrieved)
    for rank, nws in enumerate(out):
        original = by_id[nws.node.node_id]
        info = nws.node.metadata[METADATA_KEY]
        assert info["rank"] == rank and retrieved[info["index"]].node.node_id == nws.node.node_id
        assert nws.score == original.score  # the retriever's score is kept
        assert {k: v for k, v in nws.node.metadata.items() if k != METADATA_KEY} == original.node.metadata
        assert METADATA_KEY in nws.node.excluded_llm_metadata_keys
        assert METADATA_KEY in nws.node.excluded_embed_metadata_keys
        assert "source" in nws.node.excluded_embed_metadata_keys  # the node's own settings are kept
        text = original.node.get_content()
        assert "".join(text[s:e] for s, e in info["kept_spans"]) == nws.node.get_content()
        assert METADATA_KEY not in original.node.metadata  # inputs are not modified


def test_import_does_not_load_torch() -> None:
    code = (
        "import sys, rag_opt.adapters.llamaindex as m; m.RagOptNodePostprocessor(ratio=0.5); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_postprocessor_in_a_query_engine(retriever: BM25NodeRetriever, examples: list[dict[str, Any]]) -> None:
    pp = RagOptNodePostprocessor(optimizer=ContextOptimizer(scorer=BM25Scorer()), ratio=0.4)
    engine = RetrieverQueryEngine.from_args(retriever, llm=MockLLM(), node_postprocessors=[pp])
    q = examples[5]["question"]
    retrieved = retriever.retrieve(q)
    response = engine.query(q)
    out = response.source_nodes
    _check_nodes(retrieved, out)
    assert sum(len(n.node.get_content()) for n in out) < sum(len(n.node.get_content()) for n in retrieved)
    prompt = str(response)  # MockLLM answers with the prompt it was given
    assert all(n.node.get_content().strip() in prompt for n in out)  # per node, verbatim
    assert "kept_spans" not in prompt and "raw_score" not in prompt  # rag-opt's metadata stays out of the prompt
    dropped = [n for n in retrieved if n.node.node_id not in {o.node.node_id for o in out}]
    assert all(n.node.get_content().strip() not in prompt for n in dropped)


def test_postprocess_sync_and_async_agree(retriever: BM25NodeRetriever, examples: list[dict[str, Any]]) -> None:
    pp = RagOptNodePostprocessor(optimizer=ContextOptimizer(scorer=BM25Scorer()), target_tokens=150)
    q = examples[7]["question"]
    nodes = retriever.retrieve(q)
    sync = pp.postprocess_nodes(nodes, query_str=q)
    asynchronous = asyncio.run(pp.apostprocess_nodes(nodes, query_bundle=QueryBundle(q)))
    assert [(n.node.node_id, n.node.get_content(), n.score) for n in sync] == [
        (n.node.node_id, n.node.get_content(), n.score) for n in asynchronous
    ]
    assert sum(n.node.metadata[METADATA_KEY]["tokens_after"] for n in sync) <= 150
    _check_nodes(nodes, sync)


def test_nodes_without_text_pass_through_and_ratio_one_keeps_all() -> None:
    text_nodes = [
        NodeWithScore(node=TextNode(text="Paris is the capital of France.", id_="p"), score=0.5),
        NodeWithScore(node=TextNode(text="Berlin is in Germany.", id_="b"), score=0.2),
    ]
    image = NodeWithScore(node=ImageNode(image="aGVsbG8=", id_="img"), score=0.9)
    out = RagOptNodePostprocessor(ratio=1.0).postprocess_nodes(
        [text_nodes[0], image, text_nodes[1]], query_str="Capital?"
    )
    assert [n.node.node_id for n in out] == ["p", "b", "img"]
    assert [n.node.get_content() for n in out[:2]] == [n.node.get_content() for n in text_nodes]
    assert out[2] is image


def test_bad_input() -> None:
    pp = RagOptNodePostprocessor(optimizer=ContextOptimizer(scorer=BM25Scorer()), ratio=0.5)
    node = NodeWithScore(node=TextNode(text="Paris is the capital of France."), score=1.0)
    with pytest.raises(ValueError, match="needs the query"):
        pp.postprocess_nodes([node])
    with pytest.raises(TypeError, match=r"nodes\[1\]"):
        pp.postprocess_nodes([node, "text"], query_str="Capital?")  # type: ignore[list-item]
    with pytest.raises(ValidationError, match="at most one of"):
        RagOptNodePostprocessor(ratio=0.5, threshold=0.5)
    with pytest.raises(ValidationError, match="unknown ordering"):
        RagOptNodePostprocessor(ordering="sideways")
    assert pp.postprocess_nodes([], query_str="Capital?") == []


@pytest.mark.model
def test_real_model_postprocessor(retriever: BM25NodeRetriever, examples: list[dict[str, Any]]) -> None:
    pp = RagOptNodePostprocessor(ratio=0.4, ordering="lost_in_the_middle")
    q = examples[5]["question"]
    nodes = retriever.retrieve(q)[:3]
    out = pp.postprocess_nodes(nodes, query_str=q)
    _check_nodes(nodes, out)
    info = [n.node.metadata[METADATA_KEY] for n in out]
    assert all(i["scorer"] in ("probe", "raw-attention") and i["score"] is not None for i in info)
