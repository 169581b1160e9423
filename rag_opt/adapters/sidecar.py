"""LangChain over HTTP: rag-opt as a remote sidecar (``rag-opt serve``'s ``POST /v1/compress``), for applications
that keep the proxy model out of their own process.

- :class:`SidecarCompressor` is a ``langchain_core`` ``BaseDocumentCompressor`` (sync and async): drop it into
  ``ContextualCompressionRetriever``.
- :class:`RemoteContextOptimizer` is an LCEL runnable taking ``{"question": ..., "documents": [...]}`` and
  returning the optimized ``Document`` s (``invoke`` / ``ainvoke`` / ``batch`` / ``abatch``).

Both send the documents (LangChain ``Document`` s, strings or ``{text, id?, title?, metadata?}`` dicts) with
``httpx`` and return LangChain ``Document`` s in rag-opt's output order: the kept text verbatim as
``page_content``, the input's ``id`` and metadata, and rag-opt's information (``status``, ``tier``, ``score``,
``kept_spans`` as character offsets into the input text, token counts) under ``metadata["rag_opt"]``.

A sidecar that cannot be reached or answers 5xx does not fail the chain (``fail_open=True``, the default): the
documents come back unchanged and a warning is logged. A 4xx is the caller's error: :class:`SidecarError`. The
adapter only translates; scoring and selection are the server's.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
from langchain_core.callbacks import Callbacks
from langchain_core.documents import BaseDocumentCompressor
from langchain_core.documents import Document as LCDocument
from langchain_core.runnables import RunnableConfig, RunnableSerializable
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from rag_opt.adapters.metadata import METADATA_KEY
from rag_opt.errors import InvalidInputTypeError, RagOptError

__all__ = ["COMPRESS_PATH", "RemoteContextOptimizer", "SidecarCompressor", "SidecarError"]

logger = logging.getLogger(__name__)

COMPRESS_PATH = "/v1/compress"
_SETTINGS = ("budget", "ordering", "target", "language", "tier")


class SidecarError(RagOptError, RuntimeError):
    """The sidecar refused the request (a 4xx), or failed with ``fail_open=False``; ``status`` is the HTTP
    status (0: no answer) and ``message`` the server's error message."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def _wire_document(doc: Any, i: int) -> str | dict[str, Any]:
    """One input document as ``/v1/compress`` takes it."""
    if isinstance(doc, LCDocument):
        out: dict[str, Any] = {"text": doc.page_content, "metadata": dict(doc.metadata or {})}
        if doc.id is not None:
            out["id"] = str(doc.id)
        return out
    if isinstance(doc, (str, Mapping)):
        return doc if isinstance(doc, str) else dict(doc)
    raise InvalidInputTypeError(
        f"documents[{i}]: expected a LangChain Document, a string or a dict, got {type(doc).__name__}"
    )


def _unchanged(documents: Sequence[Any]) -> list[LCDocument]:
    """The inputs as LangChain ``Document`` s (what a failed-open call returns)."""
    out: list[LCDocument] = []
    for i, doc in enumerate(documents):
        wire = _wire_document(doc, i)
        if isinstance(doc, LCDocument):
            out.append(doc)
        elif isinstance(wire, str):
            out.append(LCDocument(page_content=wire))
        else:
            out.append(LCDocument(page_content=wire["text"], metadata=wire.get("metadata", {}), id=wire.get("id")))
    return out


class _SidecarSettings(BaseModel):
    """Where the sidecar is and what to ask it (validated by the server: an invalid value is a SidecarError)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    url: str = Field(description="the rag-opt server's base URL, e.g. http://127.0.0.1:8000")
    api_key: SecretStr | None = Field(default=None, description="the server's --api-key, if it has one")
    budget: dict[str, float | int] | None = Field(
        default=None, description="{'ratio': r} | {'target_tokens': n} | {'threshold': p}; None: the server's"
    )
    ordering: str | None = None
    target: str | None = Field(default=None, description="the LLM whose tokenizer budgets are counted in")
    language: str | None = Field(default=None, description="ISO 639 code of the documents' language")
    tier: str | None = Field(default=None, description="auto, model or lexical (None: the server's default, auto)")
    timeout: float = Field(default=30.0, gt=0, description="seconds for one call")
    fail_open: bool = Field(default=True, description="return the documents unchanged when the sidecar fails")
    metadata_key: str = METADATA_KEY
    client: httpx.Client | None = Field(default=None, exclude=True, description="a client to use (sync calls)")
    async_client: httpx.AsyncClient | None = Field(default=None, exclude=True, description="the same, async")

    def _request(self, question: str, documents: Sequence[Any]) -> dict[str, Any]:
        if isinstance(documents, (str, bytes, Mapping)) or not isinstance(documents, Sequence):
            raise InvalidInputTypeError(f"documents must be a list of documents, got {type(documents).__name__}")
        body: dict[str, Any] = {
            "question": question,
            "documents": [_wire_document(d, i) for i, d in enumerate(documents)],
        }
        body.update({k: getattr(self, k) for k in _SETTINGS if getattr(self, k) is not None})
        return body

    def _headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key.get_secret_value()}"} if self.api_key is not None else {}

    def _answer(self, response: httpx.Response | Exception, documents: Sequence[Any]) -> list[LCDocument]:
        """The sidecar's answer as LangChain documents (the inputs unchanged when it failed and ``fail_open``)."""
        if isinstance(response, Exception) or response.status_code >= 500:
            why = type(response).__name__ if isinstance(response, Exception) else f"HTTP {response.status_code}"
            if not self.fail_open:
                raise SidecarError(f"the rag-opt sidecar failed ({why})", getattr(response, "status_code", 0))
            logger.warning("the rag-opt sidecar failed (%s): using the documents unchanged", why)
            return _unchanged(documents)
        data = response.json()
        if response.status_code >= 400:
            message = data.get("error", {}).get("message", response.text) if isinstance(data, dict) else response.text
            raise SidecarError(f"the rag-opt sidecar refused the request: {message}", response.status_code)
        out: list[LCDocument] = []
        for rank, doc in enumerate(data["documents"]):
            original = documents[doc["index"]]
            metadata = dict(original.metadata or {}) if isinstance(original, LCDocument) else dict(doc["metadata"])
            if doc.get("title") and "title" not in metadata:
                metadata["title"] = doc["title"]
            metadata[self.metadata_key] = {
                "index": doc["index"],
                "rank": rank,
                "status": data["status"],
                "tier": data["tier"],
                "score": doc["score"],
                "kept_spans": doc["kept_spans"],
                "tokens_before": doc["tokens_before"],
                "tokens_after": doc["tokens_after"],
            }
            doc_id = original.id if isinstance(original, LCDocument) else doc["id"]
            out.append(LCDocument(page_content=doc["text"], metadata=metadata, id=doc_id))
        return out

    def compress(self, question: str, documents: Sequence[Any]) -> list[LCDocument]:
        """One sync call of the sidecar."""
        body, headers = self._request(question, documents), self._headers()
        response: httpx.Response | Exception
        try:
            if self.client is not None:
                response = self.client.post(COMPRESS_PATH, json=body, headers=headers)
            else:
                url = self.url.rstrip("/") + COMPRESS_PATH
                response = httpx.post(url, json=body, headers=headers, timeout=self.timeout)
        except httpx.HTTPError as exc:
            response = exc
        return self._answer(response, documents)

    async def acompress(self, question: str, documents: Sequence[Any]) -> list[LCDocument]:
        """One async call of the sidecar."""
        body = self._request(question, documents)
        async with contextlib.AsyncExitStack() as stack:
            client = self.async_client
            if client is None:
                client = await stack.enter_async_context(httpx.AsyncClient(base_url=self.url, timeout=self.timeout))
            try:
                answer: httpx.Response | Exception = await client.post(
                    COMPRESS_PATH, json=body, headers=self._headers()
                )
            except httpx.HTTPError as exc:
                answer = exc
        return self._answer(answer, documents)


class SidecarCompressor(_SidecarSettings, BaseDocumentCompressor):
    """The rag-opt sidecar as a LangChain document compressor (sync and async).

    ``ContextualCompressionRetriever(base_compressor=SidecarCompressor(url="http://127.0.0.1:8000",
    budget={"ratio": 0.5}), base_retriever=retriever)``
    """

    def compress_documents(
        self, documents: Sequence[LCDocument], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[LCDocument]:
        return self.compress(query, documents)

    async def acompress_documents(
        self, documents: Sequence[LCDocument], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[LCDocument]:
        return await self.acompress(query, documents)


def _split(input: Any) -> tuple[str, Sequence[Any]]:
    if not isinstance(input, Mapping) or "documents" not in input or "question" not in input:
        raise InvalidInputTypeError("RemoteContextOptimizer expects {'question': ..., 'documents': [...]}")
    return input["question"], input["documents"]


class RemoteContextOptimizer(_SidecarSettings, RunnableSerializable[dict[str, Any], list[LCDocument]]):
    """The rag-opt sidecar as an LCEL runnable: ``{"question", "documents"}`` → the optimized ``Document`` s.

    ``{"question": RunnablePassthrough(), "documents": retriever} | RemoteContextOptimizer(url=...) |
    format_documents``; the runs are traced as chain runs named ``RemoteContextOptimizer``.
    """

    def invoke(self, input: dict[str, Any], config: RunnableConfig | None = None, **kwargs: Any) -> list[LCDocument]:
        return self._call_with_config(lambda x: self.compress(*_split(x)), input, config, **kwargs)

    async def ainvoke(
        self, input: dict[str, Any], config: RunnableConfig | None = None, **kwargs: Any
    ) -> list[LCDocument]:
        async def run(x: dict[str, Any]) -> list[LCDocument]:
            return await self.acompress(*_split(x))

        return await self._acall_with_config(run, input, config, **kwargs)
