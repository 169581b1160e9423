"""rag-opt in a LlamaIndex query engine: BM25 over the example HotpotQA paragraphs → rag-opt → LLM.

Run from the repository root (needs ``pip install -e '.[llamaindex]'``)::

    python examples/llamaindex_example.py

The LLM is LlamaIndex's ``MockLLM``, which answers with the prompt it receives, so the example runs offline and
shows exactly what the LLM would read: the kept sentences of each node, per node, in rag-opt's order.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import bm25s
from llama_index.core.llms import MockLLM
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(HERE.parent))

from rag_opt.adapters.llamaindex import RagOptNodePostprocessor  # noqa: E402


class BM25NodeRetriever(BaseRetriever):
    """BM25 (bm25s) over in-memory TextNodes."""

    def __init__(self, nodes: list[TextNode], k: int = 6) -> None:
        self._nodes, self._k = nodes, k
        texts = [f"{n.metadata.get('title', '')}. {n.text}" for n in nodes]
        self._index = bm25s.BM25()
        self._index.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
        super().__init__()

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        words = bm25s.tokenize([query_bundle.query_str], stopwords="en", return_ids=False, show_progress=False)[0]
        known = [w for w in words if w in self._index.vocab_dict]
        if not known:
            return []
        ids, scores = self._index.retrieve([known], k=min(self._k, len(self._nodes)), show_progress=False)
        return [NodeWithScore(node=self._nodes[int(i)], score=float(s)) for i, s in zip(ids[0], scores[0], strict=True)]


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("bm25s").setLevel(logging.WARNING)
    question = (HERE / "hotpotqa_question.txt").read_text(encoding="utf-8").strip()
    records = [json.loads(line) for line in (HERE / "hotpotqa_docs.jsonl").read_text(encoding="utf-8").splitlines()]
    nodes = [TextNode(text=r["text"], id_=r["id"], metadata={"title": r["title"]}) for r in records]

    engine = RetrieverQueryEngine.from_args(
        BM25NodeRetriever(nodes, k=6),
        llm=MockLLM(),
        node_postprocessors=[RagOptNodePostprocessor(ratio=0.4, ordering="lost_in_the_middle")],
    )
    response = engine.query(question)
    for n in response.source_nodes:
        info = n.node.metadata["rag_opt"]
        print(
            f"#{info['rank'] + 1} {n.node.metadata['title']!r}: bm25 {n.score:.2f}, rag-opt {info['score']:.3f}, "
            f"{info['tokens_before']} → {info['tokens_after']} tokens"
        )
    print(f"\nThe prompt the LLM receives (MockLLM echoes it):\n\n{response}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
