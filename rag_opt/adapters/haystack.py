"""Haystack adapter: rag-opt as a Haystack 3 component (the ``haystack`` extra: ``pip install -e '.[haystack]'``
from the checkout).

:class:`RagOptDocumentCompressor` takes ``query`` and ``documents`` (Haystack ``Document`` s, e.g. a retriever's)
and returns ``{"documents": [...]}``: each document with text optimized as one rag-opt document (documents are
never joined), in rag-opt's output order. Each returned document is a copy of its input (``dataclasses.replace``)
with only the kept sentences, verbatim, as ``content``; its ``id``, ``meta``, retriever ``score``, ``blob`` and
embeddings are kept as they were, and rag-opt's information is added under ``meta["rag_opt"]`` (see
:func:`~rag_opt.adapters.metadata.document_info`, with ``index`` the position in the component's input, plus
``tier``). Rules:

- the ``id`` is the input's, although the content changed (Haystack's default id is a hash of the content): the
  compressed document stays identifiable as the retrieved one; embeddings still describe the original text;
- documents with nothing kept (none of their sentences earned a place in the budget) are left out, as a ranker
  with ``top_k`` leaves documents out (``keep_best_per_doc=True`` keeps each document's best sentence while the
  budget allows);
- documents without text (``content`` None or blank: blob-only, e.g. images) are passed through unchanged after
  the optimized ones;
- the document's title for rag-opt is found in ``meta`` by rag-opt's title rules (:mod:`rag_opt.text.titles`:
  ``title``, ..., a converter's ``file_path`` as its file's stem; the ``title_keys`` option), else a leading heading
  line of ``content``; a title from ``meta`` never becomes part of ``content``.

Serialisation: the component's type is ``haystack_integrations.components.compressors.rag_opt.
RagOptDocumentCompressor``, under the ``haystack_integrations`` namespace that Haystack's pipeline loader trusts
by default (``Pipeline.loads`` refuses classes outside ``haystack``, ``haystack_integrations`` and
``haystack_experimental`` unless the caller extends its allowlist). The class is defined here with its
``__module__`` set to that path (as ``numpy`` sets its public module on its functions): Haystack registers and
serialises it under that name, and the thin namespace module ``haystack_integrations/components/compressors/
rag_opt``, which re-exports it, is what a fresh process imports when it loads a pipeline.

The adapter only translates: scoring, selection and ordering are the optimizer's. Importing it or building the
component loads no model (Haystack itself imports torch when it is installed); the proxy model loads in
:meth:`~RagOptDocumentCompressor.warm_up` (or on the first run).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from rag_opt.install import install_hint

try:
    from haystack import Document, component, default_from_dict, default_to_dict
except ImportError as exc:  # pragma: no cover - exercised in a subprocess without haystack-ai
    raise ImportError(f"rag_opt.adapters.haystack needs haystack-ai: {install_hint('haystack')}") from exc

from rag_opt.adapters.metadata import METADATA_KEY, document_info
from rag_opt.adapters.options import optimizer_options, split_options
from rag_opt.errors import ConfigurationError, InvalidInputError, InvalidInputTypeError, RagOptError
from rag_opt.options import BUDGET_FIELDS
from rag_opt.pipeline import ContextOptimizer
from rag_opt.types import Budget, OptimizeResult, check_ordering
from rag_opt.types import Document as RagDocument

logger = logging.getLogger(__name__)

__all__ = ["COMPONENT_MODULE", "METADATA_KEY", "RagOptDocumentCompressor"]

COMPONENT_MODULE = "haystack_integrations.components.compressors.rag_opt"
"""The module the component is registered and serialised under (a namespace Haystack trusts by default)."""

_OWN = (*BUDGET_FIELDS, "ordering", "metadata_key")  # serialised init parameters (the per-call options, its key)
_PLAIN = (str, int, float, bool)


def _plain(value: Any) -> bool:
    """A value that serialises as it is: None, a string, number or boolean, or a list/tuple of those."""
    if isinstance(value, (list, tuple)):
        return all(v is None or isinstance(v, _PLAIN) for v in value)
    return value is None or isinstance(value, _PLAIN)


def _serialisable(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value  # a copy; YAML and JSON have no tuples


def _settings_error(exc: TypeError | ValueError) -> RagOptError:
    if isinstance(exc, RagOptError):
        return exc
    return InvalidInputTypeError(str(exc)) if isinstance(exc, TypeError) else InvalidInputError(str(exc))


@component
class RagOptDocumentCompressor:
    """Compress and reorder retrieved documents with rag-opt (sync and async).

    In a pipeline, between a retriever and a prompt builder::

        pipe.add_component("retriever", InMemoryBM25Retriever(document_store=store))
        pipe.add_component("compressor", RagOptDocumentCompressor(ratio=0.5, ordering="lost_in_the_middle"))
        pipe.add_component("prompt_builder", PromptBuilder(template=template))
        pipe.connect("retriever.documents", "compressor.documents")
        pipe.connect("compressor.documents", "prompt_builder.documents")
        pipe.run({"retriever": {"query": q}, "compressor": {"query": q}, "prompt_builder": {"question": q}})

    Args:
        ratio / target_tokens / threshold: the budget (at most one; none = the optimizer's, by default
            ``ratio=0.5``); ``run`` may override it per call.
        ordering: document ordering (``input``, ``promote_clear_best``, ``lost_in_the_middle``, ``relevance``,
            ``promote_best``, ``calibrated``, ``attention_sort``; None = the optimizer's); ``run`` may override it
            per call.
        metadata_key: where rag-opt's scores and kept offsets go in each output document's ``meta``.
        optimizer: a ready :class:`~rag_opt.ContextOptimizer` (the component then cannot be serialised).
        **options: instead of ``optimizer``, any :class:`~rag_opt.ContextOptimizer` option (``model``,
            ``keep_best_per_doc``, ``tier``, ``language``, ``target``, ...): they build the optimizer, and plain
            values (strings, numbers, booleans, None, lists of those) serialise with the component. A
            ``budget=rag_opt.Budget(...)`` is spread into ``ratio``/``target_tokens``/``threshold``. Unknown names
            are refused, naming the closest known one.

    Raises:
        InvalidInputError: an unknown option, two budgets, a budget or ordering out of range.
    """

    __module__ = COMPONENT_MODULE  # registered and serialised under the trusted namespace (see the module doc)

    def __init__(
        self,
        *,
        ratio: float | None = None,
        target_tokens: int | None = None,
        threshold: float | None = None,
        ordering: str | None = None,
        metadata_key: str = METADATA_KEY,
        optimizer: ContextOptimizer | None = None,
        **options: Any,
    ) -> None:
        data = {
            "ratio": ratio,
            "target_tokens": target_tokens,
            "threshold": threshold,
            "ordering": ordering,
            "metadata_key": metadata_key,
            "optimizer": optimizer,
            **options,
        }
        try:
            data = split_options(data, (*_OWN, "optimizer"), type(self).__name__)
        except (TypeError, ValueError) as exc:
            raise _settings_error(exc) from None
        Budget(ratio=data["ratio"], target_tokens=data["target_tokens"], threshold=data["threshold"])
        if data["ordering"] is not None:
            check_ordering(data["ordering"])
        if not isinstance(data["metadata_key"], str) or not data["metadata_key"]:
            raise InvalidInputTypeError(f"metadata_key must be a non-empty string, got {data['metadata_key']!r}")
        self.ratio: float | None = data["ratio"]
        self.target_tokens: int | None = data["target_tokens"]
        self.threshold: float | None = data["threshold"]
        self.ordering: str | None = data["ordering"]
        self.metadata_key: str = data["metadata_key"]
        names = optimizer_options()
        self._options: dict[str, Any] = {k: v for k, v in options.items() if k in names}
        self._given_optimizer = optimizer is not None
        self._optimizer: ContextOptimizer = data["optimizer"] if data["optimizer"] is not None else ContextOptimizer()
        self._warm = False

    @property
    def optimizer(self) -> ContextOptimizer:
        """The :class:`~rag_opt.ContextOptimizer` this component runs."""
        return self._optimizer

    # -- Haystack's lifecycle -------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Load what the optimizer needs (the proxy model and probes, or the lexical scorer; the target
        tokenizer). Idempotent and cheap after the first call: Haystack calls it before every pipeline run, and
        :meth:`run` calls it too."""
        if self._warm:
            return
        optimizer = self._optimizer
        optimizer.counter  # noqa: B018 - loads the target tokenizer
        if optimizer.tier == "lexical":
            optimizer.lexical_scorer()
        else:
            optimizer.scorer()
        self._warm = True
        logger.debug("rag-opt component warmed up (tier %s)", optimizer.tier)

    async def warm_up_async(self) -> None:
        """:meth:`warm_up` in a worker thread: loading the model never blocks the event loop."""
        if not self._warm:
            await asyncio.to_thread(self.warm_up)

    def to_dict(self) -> dict[str, Any]:
        """The component as Haystack's ``{"type", "init_parameters"}``: its own parameters and the
        :class:`~rag_opt.ContextOptimizer` options it was built with.

        Raises:
            ConfigurationError: it was built with ``optimizer=`` or with an option that is not a plain value
                (e.g. ``scorer=BM25Scorer()``): build it from plain options to serialise it.
        """
        if self._given_optimizer:
            raise ConfigurationError(
                f"{type(self).__name__} built with optimizer= cannot be serialised: build it from ContextOptimizer "
                "options instead (model=..., tier=..., keep_best_per_doc=..., ...)"
            )
        objects = sorted(k for k, v in self._options.items() if not _plain(v))
        if objects:
            raise ConfigurationError(
                f"{type(self).__name__} cannot be serialised: option(s) {', '.join(objects)} are objects, not "
                "plain values (strings, numbers, booleans, None, lists of those)"
            )
        own = {k: getattr(self, k) for k in _OWN}
        return default_to_dict(self, **own, **{k: _serialisable(v) for k, v in self._options.items()})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RagOptDocumentCompressor:
        """The component :meth:`to_dict` described. Only plain values are accepted as init parameters (nothing
        is imported while reading them); unknown names are refused, naming the closest known one."""
        params = data.get("init_parameters") or {}
        if not isinstance(params, Mapping):
            raise InvalidInputTypeError(f"init_parameters must be a mapping, got {type(params).__name__}")
        objects = sorted(str(k) for k, v in params.items() if not _plain(v))
        if objects:
            raise InvalidInputTypeError(
                f"{cls.__name__}: init parameter(s) {', '.join(objects)} must be plain values (strings, numbers, "
                "booleans, None, lists of those)"
            )
        return default_from_dict(cls, data)

    # -- running ---------------------------------------------------------------------------------------------
    @component.output_types(documents=list[Document])
    def run(
        self,
        query: str,
        documents: list[Document],
        ratio: float | None = None,
        target_tokens: int | None = None,
        threshold: float | None = None,
        ordering: str | None = None,
    ) -> dict[str, list[Document]]:
        """Optimize ``documents`` for ``query``.

        Args:
            query: the question the context is for.
            documents: the retrieved documents.
            ratio / target_tokens / threshold: this call's budget instead of the component's (at most one).
            ordering: this call's ordering instead of the component's.

        Returns:
            ``{"documents": [...]}``: the optimized documents in rag-opt's output order, then those without text.

        Raises:
            InvalidInputTypeError: ``query`` is not a string, ``documents`` not a list of Haystack ``Document`` s.
            InvalidInputError: an empty query, two budgets, a budget or ordering out of range.
        """
        query, textual, docs, passthrough, settings = self._prepare(
            query, documents, ratio, target_tokens, threshold, ordering
        )
        if not docs:
            return {"documents": list(documents)}
        self.warm_up()
        result = self._optimizer.optimize(query, docs, **settings)
        return {"documents": self._translate(documents, textual, result) + passthrough}

    @component.output_types(documents=list[Document])
    async def run_async(
        self,
        query: str,
        documents: list[Document],
        ratio: float | None = None,
        target_tokens: int | None = None,
        threshold: float | None = None,
        ordering: str | None = None,
    ) -> dict[str, list[Document]]:
        """:meth:`run` for async pipelines: the model runs off the event loop, and concurrent calls are
        micro-batched (:meth:`~rag_opt.ContextOptimizer.batcher`), so questions arriving together share the
        proxy's forward passes."""
        query, textual, docs, passthrough, settings = self._prepare(
            query, documents, ratio, target_tokens, threshold, ordering
        )
        if not docs:
            return {"documents": list(documents)}
        await self.warm_up_async()
        result = await self._optimizer.batcher().optimize(query, docs, **settings)
        return {"documents": self._translate(documents, textual, result) + passthrough}

    # -- translation -----------------------------------------------------------------------------------------
    def _prepare(
        self,
        query: Any,
        documents: Any,
        ratio: float | None,
        target_tokens: int | None,
        threshold: float | None,
        ordering: str | None,
    ) -> tuple[str, list[int], list[RagDocument], list[Document], dict[str, Any]]:
        """Check the input; returns the query, the positions of the documents with text, those documents as
        rag-opt's, the documents passed through, and the settings of this call."""
        name = type(self).__name__
        if not isinstance(query, str):
            raise InvalidInputTypeError(f"{name}: query must be a string, got {type(query).__name__}")
        if isinstance(documents, (str, bytes, Mapping)) or not isinstance(documents, Sequence):
            raise InvalidInputTypeError(
                f"{name}: documents must be a list of Haystack Documents, got {type(documents).__name__}"
            )
        if any(v is not None for v in (ratio, target_tokens, threshold)):
            budget = Budget(ratio=ratio, target_tokens=target_tokens, threshold=threshold)
        else:
            budget = Budget(ratio=self.ratio, target_tokens=self.target_tokens, threshold=self.threshold)
        if ordering is not None:
            check_ordering(ordering)
        textual: list[int] = []
        docs: list[RagDocument] = []
        passthrough: list[Document] = []
        for i, doc in enumerate(documents):
            if not isinstance(doc, Document):
                raise InvalidInputTypeError(
                    f"{name}: documents[{i}]: expected a Haystack Document, got {type(doc).__name__}"
                )
            if doc.content is None or not doc.content.strip():
                passthrough.append(doc)
                continue
            score = doc.score
            finite = isinstance(score, (int, float)) and not isinstance(score, bool) and math.isfinite(score)
            textual.append(i)
            docs.append(
                RagDocument(  # the metadata gives rag-opt the title (meta["title"], or the optimizer's title_keys)
                    text=doc.content,
                    id=doc.id,
                    metadata=dict(doc.meta),
                    score=float(score) if finite and score is not None else None,
                )
            )
        settings = {
            "ratio": budget.ratio,
            "target_tokens": budget.target_tokens,
            "threshold": budget.threshold,
            "ordering": ordering or self.ordering,
        }
        return query, textual, docs, passthrough, settings

    def _translate(self, documents: Sequence[Document], textual: list[int], result: OptimizeResult) -> list[Document]:
        logger.debug(
            "rag-opt: %d -> %d tokens, %d of %d documents kept (%s)",
            result.tokens_before,
            result.tokens_after,
            len(result.documents),
            len(textual),
            "; ".join(result.warnings) or "no warnings",
        )
        out: list[Document] = []
        for rank, doc in enumerate(result.documents):
            original = documents[textual[doc.index]]
            if self.metadata_key in original.meta:
                logger.debug("replacing existing meta[%r] of document %s", self.metadata_key, original.id)
            # ``index``: the position in the component's input (documents without text included)
            info = {**document_info(doc, rank, result), "index": textual[doc.index], "tier": result.tier}
            out.append(dataclasses.replace(original, content=doc.text, meta={**original.meta, self.metadata_key: info}))
        return out
