"""LangChain adapter: a document compressor and an LCEL runnable around :class:`~rag_opt.ContextOptimizer`.

- :class:`RagOptCompressor` is a ``langchain_core`` ``BaseDocumentCompressor``: drop it into
  ``ContextualCompressionRetriever`` or ``DocumentCompressorPipeline``.
- :class:`RagOptRunnable` is an LCEL runnable taking ``{"question": ..., "documents": [...]}`` (or a plain
  list of documents, the question then coming from ``config={"configurable": {"question": ...}}``) and
  returning the optimized ``Document`` s.
- :func:`format_documents` renders optimized documents into the prompt's context string.

Both return LangChain ``Document`` s in rag-opt's output order, with the kept sentences (verbatim) as
``page_content``, the input ``id`` and metadata preserved, and rag-opt's scores and kept character offsets
under one metadata key (``"rag_opt"`` by default, see :func:`to_langchain_documents`). Documents with nothing
kept are left out. The adapter only translates: scoring, selection and ordering are the optimizer's.

Importing this module imports ``langchain_core`` but not torch; the proxy model loads on the first optimize.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, cast

from rag_opt.install import install_hint

try:
    from langchain_core.callbacks import AsyncCallbackManagerForChainRun, CallbackManagerForChainRun, Callbacks
    from langchain_core.documents import BaseDocumentCompressor
    from langchain_core.documents import Document as LCDocument
    from langchain_core.runnables import RunnableConfig, RunnableSerializable, run_in_executor
except ImportError as exc:  # pragma: no cover - exercised in a subprocess without langchain-core
    raise ImportError(f"rag_opt.adapters.langchain needs langchain-core: {install_hint('langchain')}") from exc
from pydantic import BaseModel, ConfigDict, Field, model_validator
from typing_extensions import Self, TypedDict

from rag_opt.adapters.metadata import METADATA_KEY, document_info
from rag_opt.adapters.options import split_options
from rag_opt.errors import InvalidInputError, InvalidInputTypeError
from rag_opt.pipeline import ContextOptimizer
from rag_opt.types import Budget, Document, OptimizeResult, check_ordering, to_documents

logger = logging.getLogger(__name__)

__all__ = [
    "METADATA_KEY",
    "RagOptCompressor",
    "RagOptInput",
    "RagOptRunnable",
    "format_documents",
    "to_langchain_documents",
]

_QUESTION_KEYS = ("question", "query")


class RagOptInput(TypedDict):
    """The dict input of :class:`RagOptRunnable`."""

    question: str
    documents: list[LCDocument | str | dict[str, Any]]


# -- translation ----------------------------------------------------------------------------------------------
def _to_rag_documents(documents: Sequence[Any], score_key: str | None) -> list[Document]:
    """LangChain ``Document`` s (or anything :func:`rag_opt.types.to_documents` accepts) to ours."""
    if isinstance(documents, (str, bytes, Mapping)) or not isinstance(documents, Sequence):
        raise InvalidInputTypeError(f"documents must be a list of documents, got {type(documents).__name__}")
    out: list[Document] = []
    for i, doc in enumerate(documents):
        if isinstance(doc, LCDocument):
            metadata = dict(doc.metadata or {})
            score = metadata.get(score_key) if score_key else None
            if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float))):
                raise InvalidInputTypeError(f"documents[{i}]: metadata[{score_key!r}] must be a number, got {score!r}")
            out.append(
                Document(
                    text=doc.page_content,
                    id=None if doc.id is None else str(doc.id),
                    metadata=metadata,
                    score=None if score is None else float(score),
                )
            )
        else:
            try:
                (converted,) = to_documents([doc])
            except (TypeError, ValueError) as exc:
                raise type(exc)(str(exc).replace("documents[0]", f"documents[{i}]", 1)) from None
            out.append(converted)
    return out


def to_langchain_documents(
    result: OptimizeResult,
    documents: Sequence[Any] | None = None,
    *,
    metadata_key: str = METADATA_KEY,
) -> list[LCDocument]:
    """The result's documents (output order) as LangChain ``Document`` s.

    ``documents``: the inputs given to ``optimize``; when given, each output keeps its input's ``id`` and
    metadata object values as they were (otherwise the result's copies are used). rag-opt's information
    (:func:`document_info`) is added under ``metadata[metadata_key]``.
    """
    n_in = len(result.documents) + len(result.dropped)
    if documents is not None and len(documents) != n_in:
        raise InvalidInputError(f"the result covers {n_in} input documents but {len(documents)} were given")
    out: list[LCDocument] = []
    for rank, doc in enumerate(result.documents):
        original = documents[doc.index] if documents is not None else None
        if isinstance(original, LCDocument):
            metadata = dict(original.metadata or {})
            doc_id = original.id
        else:
            metadata = dict(doc.metadata)
            if doc.title and doc.title_source == "field" and "title" not in metadata:
                metadata["title"] = doc.title
            doc_id = doc.id if (original is None or _input_id(original) is not None) else None
        if metadata_key in metadata:
            logger.debug("replacing existing metadata[%r] of document %s", metadata_key, doc.id)
        metadata[metadata_key] = document_info(doc, rank, result)
        out.append(LCDocument(page_content=doc.text, metadata=metadata, id=doc_id))
    return out


def _input_id(original: Any) -> str | None:
    if isinstance(original, Document):
        return original.id
    if isinstance(original, Mapping) and original.get("id") is not None:
        return str(original["id"])
    return None


def format_documents(
    documents: Sequence[LCDocument],
    *,
    separator: str = "\n\n",
    with_titles: bool = True,
) -> str:
    """Render (optimized) documents into the context string of a prompt.

    Each document is its ``metadata["title"]`` line (when present and ``with_titles``) followed by its text,
    as :meth:`rag_opt.OptimizeResult.context` renders them. Usable directly in LCEL:
    ``optimizer | format_documents``.
    """
    if isinstance(documents, (str, bytes, Mapping)) or not isinstance(documents, Sequence):
        raise InvalidInputTypeError(f"format_documents expects a list of Documents, got {type(documents).__name__}")
    parts: list[str] = []
    for i, doc in enumerate(documents):
        if not isinstance(doc, LCDocument):
            raise InvalidInputTypeError(f"documents[{i}]: expected a LangChain Document, got {type(doc).__name__}")
        title = doc.metadata.get("title") if with_titles else None
        head = f"{title}\n" if isinstance(title, str) and title.strip() else ""
        parts.append(head + doc.page_content)
    return separator.join(parts)


# -- shared settings ------------------------------------------------------------------------------------------
def _run_optimize(
    optimizer: ContextOptimizer,
    query: Any,
    documents: Sequence[Any],
    *,
    budget: Budget | None,
    ordering: str | None,
    metadata_key: str,
    score_key: str | None,
) -> list[LCDocument]:
    query, docs = _prepare(query, documents, score_key)
    if not docs:
        return []
    result = optimizer.optimize(query, docs, budget=budget, ordering=ordering)
    return _translate(result, documents, metadata_key)


def _prepare(query: Any, documents: Sequence[Any], score_key: str | None) -> tuple[str, list[Document]]:
    if not isinstance(query, str):
        raise InvalidInputTypeError(f"the question must be a string, got {type(query).__name__}")
    return query, _to_rag_documents(documents, score_key)


def _translate(result: OptimizeResult, documents: Sequence[Any], metadata_key: str) -> list[LCDocument]:
    logger.debug(
        "rag-opt: %d -> %d tokens, %d of %d documents kept",
        result.tokens_before,
        result.tokens_after,
        len(result.documents),
        len(documents),
    )
    return to_langchain_documents(result, documents, metadata_key=metadata_key)


_OPTIMIZER_DOC = "the ContextOptimizer to use (default: a new ContextOptimizer(); the proxy model is shared)"


# -- the compressor -------------------------------------------------------------------------------------------
class _RagOptSettings(BaseModel):
    """The settings shared by the compressor and the runnable (validated when the object is built)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    optimizer: ContextOptimizer = Field(default_factory=ContextOptimizer, exclude=True, description=_OPTIMIZER_DOC)
    ratio: float | None = None
    target_tokens: int | None = None
    threshold: float | None = None
    ordering: str | None = None
    metadata_key: str = METADATA_KEY
    score_key: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _options(cls, data: Any) -> Any:
        """ContextOptimizer options build the optimizer; unknown names are refused (see
        :mod:`rag_opt.adapters.options`)."""
        return split_options(data, cls.model_fields, cls.__name__)

    @model_validator(mode="after")
    def _validate(self) -> Self:
        self._budget()  # at most one, in range
        if self.ordering is not None:
            check_ordering(self.ordering)
        return self

    def _budget(self) -> Budget | None:
        """The budget of each call (None: the optimizer's)."""
        budget = Budget(ratio=self.ratio, target_tokens=self.target_tokens, threshold=self.threshold)
        return budget if budget.compresses else None

    def _run_many(self, pairs: Sequence[tuple[Any, Any]]) -> list[list[LCDocument] | Exception]:
        """Several (question, documents) pairs through one ``optimize_batch`` (shared forward passes); a pair
        that is invalid gets its exception in its place."""
        out: list[list[LCDocument] | Exception] = []
        todo: list[tuple[int, str, list[Document]]] = []
        for i, (query, documents) in enumerate(pairs):
            try:
                q, docs = _prepare(query, documents, self.score_key)
            except (InvalidInputError, InvalidInputTypeError) as exc:
                out.append(exc)
                continue
            out.append([])
            if docs:
                todo.append((i, q, docs))
        if todo:
            results = self.optimizer.optimize_batch(
                [q for _, q, _ in todo],
                [d for _, _, d in todo],
                budget=self._budget(),
                ordering=self.ordering,
            )
            for (i, _, _), result in zip(todo, results, strict=True):
                out[i] = _translate(result, pairs[i][1], self.metadata_key)
        return out

    def _run(self, query: Any, documents: Any) -> list[LCDocument]:
        return _run_optimize(
            self.optimizer,
            query,
            documents,
            budget=self._budget(),
            ordering=self.ordering,
            metadata_key=self.metadata_key,
            score_key=self.score_key,
        )


class RagOptCompressor(_RagOptSettings, BaseDocumentCompressor):
    """rag-opt as a LangChain document compressor (sync and async).

    ``ContextualCompressionRetriever(base_compressor=RagOptCompressor(ratio=0.5), base_retriever=retriever)``

    Args:
        optimizer: the :class:`~rag_opt.ContextOptimizer` (holds model, target tokenizer and defaults).
        ratio / target_tokens / threshold: compression for each call (at most one; none = the optimizer's).
        ordering: document ordering (None = the optimizer's).
        metadata_key: where rag-opt's scores and kept offsets go in each output's metadata.
        score_key: a metadata key holding the retriever's score (used when ordering needs a fallback).
        Any :class:`~rag_opt.ContextOptimizer` option (``keep_best_per_doc``, ``tier``, ...) instead of
        ``optimizer``: they build it. Unknown options are refused, naming the closest known one.

    A compressor may drop whole documents (nothing of theirs fits the budget), which changes a retriever's
    contract of returning its ``k`` documents: ``keep_best_per_doc=True`` keeps every document (at least its
    best sentence).
    """

    def compress_documents(
        self,
        documents: Sequence[LCDocument],
        query: str,
        callbacks: Callbacks | None = None,
    ) -> Sequence[LCDocument]:
        """Optimize ``documents`` for ``query``; returns the kept documents in output order."""
        return self._run(query, documents)

    async def acompress_documents(
        self,
        documents: Sequence[LCDocument],
        query: str,
        callbacks: Callbacks | None = None,
    ) -> Sequence[LCDocument]:
        """Async :meth:`compress_documents` (the forward pass runs in an executor thread)."""
        return await run_in_executor(None, self.compress_documents, documents, query, callbacks)


# -- the LCEL runnable ----------------------------------------------------------------------------------------
class RagOptRunnable(_RagOptSettings, RunnableSerializable[RagOptInput | list[LCDocument], list[LCDocument]]):
    """rag-opt as an LCEL runnable: ``{"question", "documents"}`` (or a list of documents) → ``Document`` s.

    In a chain::

        {"question": RunnablePassthrough(), "documents": retriever}
        | RunnablePassthrough.assign(context=RagOptRunnable(ratio=0.5) | format_documents)
        | prompt | llm

    After a retriever, with the question from the config::

        (retriever | RagOptRunnable(ratio=0.5)).invoke(q, config={"configurable": {"question": q}})

    Supports ``invoke``/``ainvoke``/``batch``/``abatch``/``stream``, ``with_config`` (``run_name``, tags,
    callbacks) and ``configurable_fields`` on ``ratio``, ``target_tokens``, ``threshold`` and ``ordering``.
    Runs are traced as chain runs named ``RagOptRunnable`` unless renamed.
    """

    @property
    def InputType(self) -> Any:  # noqa: N802 - LangChain's name
        return RagOptInput | list[LCDocument]

    @property
    def OutputType(self) -> Any:  # noqa: N802 - LangChain's name
        return list[LCDocument]

    def _split_input(self, input: Any, config: RunnableConfig) -> tuple[Any, Any]:
        if isinstance(input, Mapping):
            if "documents" not in input:
                raise InvalidInputError(
                    f"RagOptRunnable input is missing 'documents' (got keys {sorted(map(str, input))}); "
                    "expected {'question': ..., 'documents': [...]}"
                )
            question = next((input[k] for k in _QUESTION_KEYS if k in input), None)
            if question is None:
                question = _config_question(config)
            if question is None:
                raise InvalidInputError(
                    f"RagOptRunnable input is missing 'question' (got keys {sorted(map(str, input))}); "
                    "expected {'question': ..., 'documents': [...]}"
                )
            return question, input["documents"]
        if isinstance(input, (str, bytes)) or not isinstance(input, Sequence):
            raise InvalidInputTypeError(
                "RagOptRunnable expects {'question': ..., 'documents': [...]} or a list of documents, got "
                f"{type(input).__name__}"
            )
        question = _config_question(config)
        if question is None:
            raise InvalidInputError(
                "RagOptRunnable got a list of documents but no question: pass {'question': ..., 'documents': "
                "[...]} or config={'configurable': {'question': ...}}"
            )
        return question, input

    def _optimize(
        self, input: Any, run_manager: CallbackManagerForChainRun, config: RunnableConfig
    ) -> list[LCDocument]:
        question, documents = self._split_input(input, config)
        return self._run(question, documents)

    async def _aoptimize(
        self, input: Any, run_manager: AsyncCallbackManagerForChainRun, config: RunnableConfig
    ) -> list[LCDocument]:
        return await run_in_executor(config, self._optimize, input, run_manager.get_sync(), config)

    def invoke(
        self, input: RagOptInput | list[LCDocument], config: RunnableConfig | None = None, **kwargs: Any
    ) -> list[LCDocument]:
        return self._call_with_config(self._optimize, input, config, **kwargs)

    async def ainvoke(
        self, input: RagOptInput | list[LCDocument], config: RunnableConfig | None = None, **kwargs: Any
    ) -> list[LCDocument]:
        return await self._acall_with_config(self._aoptimize, input, config, **kwargs)

    def _optimize_many(
        self, inputs: list[Any], run_manager: list[CallbackManagerForChainRun], config: list[RunnableConfig]
    ) -> list[list[LCDocument] | Exception]:
        pairs: list[tuple[Any, Any]] = []
        errors: dict[int, Exception] = {}
        for i, (item, cfg) in enumerate(zip(inputs, config, strict=True)):
            try:
                pairs.append(self._split_input(item, cfg))
            except (InvalidInputError, InvalidInputTypeError) as exc:
                errors[i] = exc
                pairs.append(("", []))
        out = self._run_many(pairs)
        return [errors.get(i, o) for i, o in enumerate(out)]

    def batch(
        self,
        inputs: list[RagOptInput | list[LCDocument]],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[list[LCDocument]]:
        """Optimize several inputs through one :meth:`~rag_opt.ContextOptimizer.optimize_batch` (the proxy scores
        them in shared forward passes); each input is traced as its own run."""
        return self._batch_with_config(
            self._optimize_many, inputs, config, return_exceptions=return_exceptions, **kwargs
        )

    async def abatch(
        self,
        inputs: list[RagOptInput | list[LCDocument]],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[list[LCDocument]]:
        """Async :meth:`batch` (the forward passes run in an executor thread)."""
        return await run_in_executor(
            None, lambda: self.batch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        )


def _config_question(config: RunnableConfig | None) -> Any:
    configurable = cast(Mapping[str, Any], (config or {}).get("configurable") or {})
    return next((configurable[k] for k in _QUESTION_KEYS if configurable.get(k) is not None), None)
