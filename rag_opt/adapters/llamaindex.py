"""LlamaIndex adapter: rag-opt as a node postprocessor (the ``llamaindex`` extra: ``pip install -e
'.[llamaindex]'`` from the checkout).

``RagOptNodePostprocessor`` optimizes the retrieved nodes *per node*: each node's text is one document for
:meth:`~rag_opt.ContextOptimizer.optimize` (nodes are never joined into one string). Each returned node is a
copy of its input with only the kept sentences as text, its metadata, relationships and retriever score kept,
and rag-opt's scores and kept character offsets added under ``metadata["rag_opt"]`` (excluded from the LLM and
embedding views of the node, so it never reaches the prompt). Nodes are returned in rag-opt's output order;
nodes with nothing kept are left out; nodes without text (e.g. image-only) are passed through after them.

Use it like any postprocessor::

    index.as_query_engine(node_postprocessors=[RagOptNodePostprocessor(ratio=0.5)])

The adapter only translates: scoring, selection and ordering are the optimizer's.
"""

from __future__ import annotations

import logging
from typing import Any

from rag_opt.install import install_hint

try:
    from llama_index.core.bridge.pydantic import ConfigDict, Field, model_validator
    from llama_index.core.postprocessor.types import BaseNodePostprocessor
    from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"rag_opt.adapters.llamaindex needs llama-index-core: {install_hint('llamaindex')}") from exc

from rag_opt.adapters.metadata import METADATA_KEY, document_info
from rag_opt.adapters.options import split_options
from rag_opt.errors import InvalidInputError, InvalidInputTypeError
from rag_opt.pipeline import ContextOptimizer
from rag_opt.types import Budget, Document, OptimizeResult, check_ordering

logger = logging.getLogger(__name__)

__all__ = ["METADATA_KEY", "RagOptNodePostprocessor"]


class RagOptNodePostprocessor(BaseNodePostprocessor):
    """Compress and reorder retrieved nodes with rag-opt (sync and async).

    Args:
        optimizer: the :class:`~rag_opt.ContextOptimizer` (default: a new one; the proxy model is shared).
        ratio / target_tokens / threshold: compression for each call (at most one; none = the optimizer's).
        ordering: document ordering (None = the optimizer's).
        metadata_key: where rag-opt's scores and kept offsets go in each node's metadata.
        Any :class:`~rag_opt.ContextOptimizer` option (``keep_best_per_doc``, ``tier``, ...) instead of
        ``optimizer``: they build it. Unknown options are refused.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    optimizer: ContextOptimizer = Field(default_factory=ContextOptimizer, exclude=True)
    ratio: float | None = None
    target_tokens: int | None = None
    threshold: float | None = None
    ordering: str | None = None
    metadata_key: str = METADATA_KEY

    @model_validator(mode="before")
    @classmethod
    def _options(cls, data: Any) -> Any:
        return split_options(data, cls.model_fields, cls.__name__)

    @model_validator(mode="after")
    def _validate(self) -> RagOptNodePostprocessor:
        Budget(ratio=self.ratio, target_tokens=self.target_tokens, threshold=self.threshold)
        if self.ordering is not None:
            check_ordering(self.ordering)
        return self

    @classmethod
    def class_name(cls) -> str:
        return "RagOptNodePostprocessor"

    def _postprocess_nodes(
        self,
        nodes: list[NodeWithScore],
        query_bundle: QueryBundle | None = None,
    ) -> list[NodeWithScore]:
        query, textual, docs, passthrough = self._prepare(nodes, query_bundle)
        if not docs:
            return list(nodes)
        result = self.optimizer.optimize(query, docs, **self._settings())
        return self._translate(nodes, textual, docs, result) + passthrough

    async def _apostprocess_nodes(
        self,
        nodes: list[NodeWithScore],
        query_bundle: QueryBundle | None = None,
    ) -> list[NodeWithScore]:
        """Async: concurrent calls are micro-batched (:meth:`~rag_opt.ContextOptimizer.batcher`), so questions
        arriving together share the proxy's forward passes."""
        query, textual, docs, passthrough = self._prepare(nodes, query_bundle)
        if not docs:
            return list(nodes)
        result = await self.optimizer.batcher().optimize(query, docs, **self._settings())
        return self._translate(nodes, textual, docs, result) + passthrough

    def _settings(self) -> dict[str, Any]:
        return {
            "ratio": self.ratio,
            "target_tokens": self.target_tokens,
            "threshold": self.threshold,
            "ordering": self.ordering,
        }

    @staticmethod
    def _prepare(
        nodes: list[NodeWithScore], query_bundle: QueryBundle | None
    ) -> tuple[str, list[int], list[Document], list[NodeWithScore]]:
        if query_bundle is None or not isinstance(query_bundle.query_str, str):
            raise InvalidInputError("RagOptNodePostprocessor needs the query: pass query_bundle or query_str")
        textual: list[int] = []
        docs: list[Document] = []
        for i, nws in enumerate(nodes):
            if not isinstance(nws, NodeWithScore):
                raise InvalidInputTypeError(f"nodes[{i}]: expected a NodeWithScore, got {type(nws).__name__}")
            text = nws.node.get_content(metadata_mode=MetadataMode.NONE)
            if not text.strip():
                continue
            textual.append(i)
            docs.append(Document(text=text, id=nws.node.node_id, metadata=dict(nws.node.metadata), score=nws.score))
        textual_set = set(textual)
        passthrough = [nodes[i] for i in range(len(nodes)) if i not in textual_set]
        return query_bundle.query_str, textual, docs, passthrough

    def _translate(
        self, nodes: list[NodeWithScore], textual: list[int], docs: list[Document], result: OptimizeResult
    ) -> list[NodeWithScore]:
        logger.debug(
            "rag-opt: %d -> %d tokens, %d of %d nodes kept",
            result.tokens_before,
            result.tokens_after,
            len(result.documents),
            len(docs),
        )
        out: list[NodeWithScore] = []
        for rank, doc in enumerate(result.documents):
            original = nodes[textual[doc.index]]
            node = original.node.model_copy()
            node.metadata = {**original.node.metadata, self.metadata_key: document_info(doc, rank, result)}
            for attr in ("excluded_llm_metadata_keys", "excluded_embed_metadata_keys"):
                keys = list(getattr(node, attr))
                if self.metadata_key not in keys:
                    keys.append(self.metadata_key)
                setattr(node, attr, keys)
            if doc.text != docs[doc.index].text:
                node.set_content(doc.text)
            out.append(NodeWithScore(node=node, score=original.score))
        return out
