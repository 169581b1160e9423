"""``POST /v1/compress``: the compress-only sidecar. A gateway sends a question and its retrieved documents and
gets the optimized documents back (kept text, kept spans as character offsets into the input, scores, tokens
before and after, the tier that ran, timings, how the proxy model read the context and, under parallel encoding
with ``--expose-cache-hits``, the request's encoding cache hits and misses), then makes its own LLM call. The
encoding cache is read in the request's tenant namespace (``--cache-namespace``:
:func:`rag_opt.server.tenancy.request_namespace`).

The request and response are the pydantic models below; their JSON schema is served at
``GET /v1/compress/schema`` and committed as ``docs/compress.schema.json`` (:func:`compress_schema`). The route
only translates: the optimization runs through the same :class:`~rag_opt.server.engine.Engine` as chat
completions (worker pool, micro-batching, the lexical tier when the model is saturated, time budget, work
limits), behind the same key check, body limit and metrics.

With ``explain: true`` the answer adds ``explanation``: every document's units with why each was kept or dropped
(:func:`rag_opt.explanation.explain_result`, at most :data:`~rag_opt.types.MAX_EXPLAINED_UNITS` listed). With
``--otel`` each request is an OpenTelemetry span (:mod:`rag_opt.telemetry`).

Outcomes: ``optimized`` / ``optimized_lexical`` (by the proxy model / the lexical tier), ``unchanged`` (the
budget asked for no compression), ``fail_open`` (the optimizer could not help: the documents come back as sent,
with ``reason``, as the proxy forwards a chat request unoptimized). Invalid input is a 400 whose OpenAI-style
error names the field (``param``); with ``--on-overload reject`` an overload is a 429.

The request is read strictly: JSON types are not coerced (``"ratio": "0.5"`` and ``"target_tokens": true`` are
400s), a key given twice in one object or a string holding a lone UTF-16 surrogate anywhere in the body is a 400
(``duplicate_key``, ``lone_surrogate``: the rule of every route, :mod:`rag_opt.server.request`), and a
``budget`` must give one of its limits (``{}`` is a 400: leave ``budget`` out for the server's). A
body sent with ``Content-Encoding: gzip`` or ``deflate`` is decoded (at most ``--max-body-bytes`` once decoded,
else a 413). More than ``--max-documents`` documents is a 413 (``too_many_documents``), answered once the body
is parsed and before any document is validated or built. Reading the request and building the answer (the
documents as sent, on fail-open) run off the event loop for large bodies.

A body with ``messages`` is in the other contract this route answers, Headroom's (``{"messages": [...],
"model"?, "config"?}``, which gateways call): :mod:`rag_opt.server.compress_messages`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Literal

import anyio.to_thread
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from rag_opt.errors import InvalidInputError
from rag_opt.explanation import explain_result
from rag_opt.inputs import check_documents
from rag_opt.server.compress_messages import MessagesCompressor, is_messages_body, messages_schemas
from rag_opt.server.compress_protocol import (
    COMPRESS_PATH,
    SCHEMA_PATH,
    CompressBudget,
    CompressDocument,
    CompressRequest,
    CompressResponse,
    CompressTimings,
    OutputDocument,
)
from rag_opt.server.engine import Attempt, Engine, Job, overloaded_response
from rag_opt.server.errors import Overloaded, RequestError, error_response
from rag_opt.server.pool import off_loop
from rag_opt.server.request import check_readable, decode_body, load_object
from rag_opt.server.state import ProxyState
from rag_opt.server.tenancy import request_namespace
from rag_opt.types import OptimizeResult

__all__ = [
    "COMPRESS_PATH",
    "SCHEMA_PATH",
    "CompressBudget",
    "CompressDocument",
    "CompressRequest",
    "CompressResponse",
    "CompressTimings",
    "Compressor",
    "OutputDocument",
    "compress_schema",
    "schema_json",
]

logger = logging.getLogger(__name__)

_DOC_MODEL = CompressDocument.__name__  # the tag of a document object's errors


def compress_schema() -> dict[str, Any]:
    """The JSON schemas of the request and the response of both contracts (``docs/compress.schema.json``): the
    documents contract's (``request``, ``response``) and the messages contract's (``messages_request``,
    ``messages_response``); a body with ``messages`` is in the messages contract."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "rag-opt POST /v1/compress",
        "request": CompressRequest.model_json_schema(),
        "response": CompressResponse.model_json_schema(),
        **messages_schemas(),  # the messages contract (a body with messages), Headroom's
    }


def _load(raw: bytes) -> dict[str, Any]:
    """The request body, parsed as the chat routes parse it (duplicate keys marked); raises RequestError."""
    try:
        return load_object(raw)
    except RequestError:
        raise
    except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise RequestError(
            "the request body is not valid JSON (a number too long to read)", code="invalid_json"
        ) from None


def _output(result: OptimizeResult) -> tuple[list[OutputDocument], list[str]]:
    docs = [
        OutputDocument.model_validate(d.model_dump(include=set(OutputDocument.model_fields))) for d in result.documents
    ]
    return docs, [d.id for d in result.dropped]


def _invalid(exc: ValidationError) -> RequestError:
    """The 400 for the first problem pydantic found, named by its place (``documents.2.text``)."""
    errors = exc.errors()
    # a document is a string or an object: for an object, its own problem (not "should be a string")
    inside = [e for e in errors if _DOC_MODEL in e["loc"] and e["loc"][-1] != _DOC_MODEL]
    err = inside[0] if inside else errors[0]
    where = ".".join(str(p) for p in err["loc"] if p not in ("str", _DOC_MODEL)) or None
    if err["type"] == "extra_forbidden":
        msg, code = "unknown field", "unknown_parameter"
    elif err["type"] == "missing":
        msg, code = "missing (required)", "missing_required_parameter"
    elif "str" in err["loc"] or _DOC_MODEL in err["loc"]:
        msg, code = "a document must be a string or an object {text, id?, title?, metadata?}", "invalid_type"
    else:
        msg, code = err["msg"].removeprefix("Value error, "), "invalid_value"
    return RequestError(f"{where}: {msg}" if where else msg, where, code)


def _as_sent(documents: list[dict[str, Any]]) -> list[OutputDocument]:
    """The documents as they came (fail-open)."""
    return [
        OutputDocument(
            id=str(d.get("id", i)),
            index=i,
            text=d["text"],
            title=d.get("title"),
            metadata=d.get("metadata", {}),
            kept_spans=[(0, len(d["text"]))],
        )
        for i, d in enumerate(documents)
    ]


class Compressor:
    """The ``/v1/compress`` flow of one app."""

    def __init__(self, state: ProxyState, engine: Engine) -> None:
        self.state = state
        self.engine = engine
        self.messages = MessagesCompressor(state, engine)  # the messages contract (Headroom's)

    def _refused(self, message: str, param: str | None, code: str = "invalid_request", status: int = 400) -> Response:
        self.state.metrics.compress_outcome("rejected")
        self.state.metrics.local_error("too_large" if status == 413 else "invalid_request")
        return error_response(status, message, "invalid_request_error", code, param)

    def _read(self, data: dict[str, Any]) -> tuple[CompressRequest, list[dict[str, Any]]]:
        """The request in ``data`` (the parsed body) and its documents as the optimizer takes them, checked; raises
        :class:`~rag_opt.server.errors.RequestError` (a 413 past ``--max-documents``, before any document is
        validated). Runs off the event loop for a large body."""
        limit = self.state.settings.max_documents
        docs = data.get("documents")
        if isinstance(docs, list) and len(docs) > limit:
            raise RequestError(
                f"documents: {len(docs)} documents, more than this server's limit of {limit} (--max-documents)",
                "documents",
                "too_many_documents",
                status=413,
            )
        check_readable(data)  # rag-opt reads the whole body: a duplicate key or a lone surrogate anywhere is a 400
        try:
            req = CompressRequest.model_validate(data)
        except ValidationError as exc:
            raise _invalid(exc) from None
        documents = req.as_documents()
        try:
            check_documents(documents)
        except InvalidInputError as exc:
            raise RequestError(str(exc), "documents", "invalid_request") from None
        return req, documents

    async def handle(self, request: Request, raw: bytes) -> Response:
        """Answer one compress request whose body is ``raw``."""
        s, t0 = self.state.settings, time.perf_counter()
        try:
            encoding = request.headers.get("content-encoding", "")
            if encoding.strip().lower() not in ("", "identity"):
                raw = await off_loop(len(raw), lambda: decode_body(raw, encoding, s.max_body_bytes))
            data = await off_loop(len(raw), lambda: _load(raw))
            if is_messages_body(data):  # Headroom's contract: {"messages": [...], "model"?, "config"?}
                return await self.messages.handle(request, data, len(raw))
            req, documents = await off_loop(len(raw), lambda: self._read(data))
        except RequestError as exc:
            return self._refused(exc.message, exc.param, exc.code, exc.status)
        job = Job(
            req.question,
            documents,
            req.budget.budget() if req.budget is not None else s.budget,
            req.ordering or s.options.ordering,
            language=req.language,
            target=req.target,
            tier=req.tier,
            namespace=request_namespace(s, request.headers),
        )
        if req.tier == "lexical" and not self.engine.lexical_available(job.ordering):
            why = self.engine.no_lexical_note(job.ordering) or "the lexical tier is off on this server"
            return self._refused(f"tier: {why}", "tier")
        if req.target is not None and (refused := await self._check_target(req.target)) is not None:
            return refused
        try:
            attempt = await self.engine.run(job)
        except Overloaded as exc:  # --on-overload reject, and no lexical tier
            self.state.metrics.compress_outcome("overloaded")
            return overloaded_response(exc, s.time_budget_ms)

        def answer() -> bytes:  # with its span (--otel), under the status it answers
            out = self._answer(job, attempt, req.explain)
            self.state.tracing.record(request.headers, out.status, out.reason, attempt.result, t0, COMPRESS_PATH)
            return out.model_dump_json().encode()

        # the answer holds every document (all of them, as sent, on fail-open): built off the loop when large
        body = await off_loop(len(raw), answer)
        return Response(body, media_type="application/json")

    async def _check_target(self, target: str) -> Response | None:
        """A 400 for a target tokenizer this server does not allow (``--allowed-targets``), or that could not be
        loaded (None: it is loaded). Only an allowed one is ever loaded; the message names no server path."""
        try:
            await anyio.to_thread.run_sync(self.state.targets.load, target)
        except InvalidInputError as exc:
            return self._refused(f"target: {exc}", "target")
        return None

    def _answer(self, job: Job, attempt: Attempt, explain: bool = False) -> CompressResponse:
        s = self.state.settings
        # the language used: the request's, else the optimizer's own (the server's --language, for the one it built)
        language = job.language or getattr(self.state.optimizer, "language", None) or s.options.language
        common: dict[str, Any] = {"ordering": job.ordering, "language": language}
        result = attempt.result
        if result is None:
            self.state.metrics.compress_outcome("fail_open")
            return CompressResponse(
                status="fail_open",
                reason=attempt.told,
                tier="none",
                documents=_as_sent(job.documents),
                tokens_before=None,
                tokens_after=None,
                target_tokenizer=job.target,
                timings=CompressTimings(total_ms=attempt.elapsed_ms()),
                **common,
            )
        lexical = attempt.tier == "lexical"
        if result.tier == "none":
            status: Literal["optimized", "optimized_lexical", "unchanged"] = "unchanged"
        else:
            status = "optimized_lexical" if lexical else "optimized"
        ms = self.engine.record(attempt, len(job.documents), job.target or result.target_tokenizer)
        self.state.metrics.compress_outcome(status)
        docs, dropped = _output(result)
        reading: dict[str, Any] = {}
        if not lexical and result.tier == "model" and result.encoding is not None:
            reading["encoding"] = result.encoding
            if s.expose_cache_hits and result.encoding == "parallel":
                reading.update(cache_hits=result.cache_hits, cache_misses=result.cache_misses)
        return CompressResponse(
            status=status,
            reason=attempt.reason if lexical else None,
            tier=result.tier,
            documents=docs,
            dropped=dropped,
            tokens_before=result.tokens_before,
            tokens_after=result.tokens_after,
            token_budget=result.token_budget,
            target_tokenizer=result.target_tokenizer,
            timings=CompressTimings(total_ms=ms, optimizer=result.timings),
            warnings=result.warnings,
            placement_profile=result.placement_profile,
            explanation=explain_result(result) if explain else None,
            **common,
            **reading,
        )


def schema_json() -> str:
    """:func:`compress_schema` as the committed file's text."""
    return json.dumps(compress_schema(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":  # python -m rag_opt.server.compress > docs/compress.schema.json
    sys.stdout.write(schema_json())
