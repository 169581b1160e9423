"""The documents contract of ``POST /v1/compress`` without its transport: a body read and checked
(:func:`load_body`, :func:`read_request`), its :class:`~rag_opt.wire.job.Job` (:func:`request_job`), and an
attempt's answer as the response model (:func:`fail_open_response`, :func:`optimized_response`); the JSON schema of
both contracts (:func:`compress_schema`, committed as ``docs/compress.schema.json``:
``python -m rag_opt.wire.compress > docs/compress.schema.json``). The wire models are
:mod:`rag_opt.wire.compress_protocol`; ``rag-opt serve``'s route (:mod:`rag_opt.server.compress`) decodes the
body, runs the job on its engine, counts it and answers.

The request is read strictly: JSON types are not coerced, a key given twice in one object or a string holding a
lone UTF-16 surrogate anywhere in the body is a 400 (``duplicate_key``, ``lone_surrogate``: the rule of every
route, :mod:`rag_opt.wire.request`), and more than the server's ``--max-documents`` documents is a 413
(``too_many_documents``), refused once the body is parsed and before any document is validated or built. Outcomes:
``optimized`` / ``optimized_lexical`` (by the proxy model / the lexical tier), ``unchanged`` (the budget asked for
no compression), ``fail_open`` (the documents as sent, with ``reason``).
"""

from __future__ import annotations

import json
import sys
from typing import Any, Literal

from pydantic import ValidationError

from rag_opt.errors import InvalidInputError
from rag_opt.explanation import explain_result
from rag_opt.inputs import check_documents
from rag_opt.types import OptimizeResult
from rag_opt.wire.compress_messages_protocol import messages_schemas
from rag_opt.wire.compress_protocol import (
    CompressDocument,
    CompressRequest,
    CompressResponse,
    CompressTimings,
    OutputDocument,
)
from rag_opt.wire.errors import RequestError
from rag_opt.wire.job import Attempt, Job
from rag_opt.wire.request import check_readable, load_object
from rag_opt.wire.settings import WireSettings

__all__ = [
    "Status",
    "compress_schema",
    "fail_open_response",
    "load_body",
    "optimized_response",
    "read_request",
    "request_job",
    "result_status",
    "schema_json",
]

Status = Literal["optimized", "optimized_lexical", "unchanged"]
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


def load_body(raw: bytes) -> dict[str, Any]:
    """The request body, parsed as the chat routes parse it (duplicate keys marked); raises RequestError."""
    try:
        return load_object(raw)
    except RequestError:
        raise
    except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise RequestError(
            "the request body is not valid JSON (a number too long to read)", code="invalid_json"
        ) from None


def read_request(data: dict[str, Any], max_documents: int) -> tuple[CompressRequest, list[dict[str, Any]]]:
    """The request in ``data`` (the parsed body) and its documents as the optimizer takes them, checked; raises
    :class:`~rag_opt.wire.errors.RequestError` (a 413 past ``max_documents``, before any document is validated).
    A server runs it off the event loop for a large body."""
    docs = data.get("documents")
    if isinstance(docs, list) and len(docs) > max_documents:
        raise RequestError(
            f"documents: {len(docs)} documents, more than this server's limit of {max_documents} (--max-documents)",
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


def request_job(
    req: CompressRequest, documents: list[dict[str, Any]], settings: WireSettings, namespace: str | None = None
) -> Job:
    """The optimization ``req`` asks for: its budget and ordering over the settings', its language, target and
    tier; ``namespace``: its encoding cache tenant."""
    return Job(
        req.question,
        documents,
        req.budget.budget() if req.budget is not None else settings.budget,
        req.ordering or settings.ordering,
        language=req.language,
        target=req.target,
        tier=req.tier,
        namespace=namespace,
    )


def result_status(attempt: Attempt) -> Status:
    """The status of an attempt with a result: ``unchanged`` when nothing needed scoring, else by its tier."""
    assert attempt.result is not None
    if attempt.result.tier == "none":
        return "unchanged"
    return "optimized_lexical" if attempt.tier == "lexical" else "optimized"


def fail_open_response(job: Job, attempt: Attempt, language: str) -> CompressResponse:
    """The answer to an attempt without a result: the documents as sent, with its reason."""
    return CompressResponse(
        status="fail_open",
        reason=attempt.told,
        tier="none",
        documents=_as_sent(job.documents),
        tokens_before=None,
        tokens_after=None,
        target_tokenizer=job.target,
        timings=CompressTimings(total_ms=attempt.elapsed_ms()),
        ordering=job.ordering,
        language=language,
    )


def optimized_response(
    job: Job,
    attempt: Attempt,
    status: Status,
    ms: float,
    language: str,
    expose_cache_hits: bool = False,
    explain: bool = False,
) -> CompressResponse:
    """The answer to an attempt with a result (``status``: :func:`result_status`; ``ms``: its time so far), with
    how the proxy model read the context (its cache hits and misses with ``expose_cache_hits``) and, with
    ``explain``, every unit's reason."""
    result = attempt.result
    assert result is not None
    lexical = attempt.tier == "lexical"
    docs, dropped = _output(result)
    reading: dict[str, Any] = {}
    if not lexical and result.tier == "model" and result.encoding is not None:
        reading["encoding"] = result.encoding
        if expose_cache_hits and result.encoding == "parallel":
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
        ordering=job.ordering,
        language=language,
        **reading,
    )


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


def schema_json() -> str:
    """:func:`compress_schema` as the committed file's text."""
    return json.dumps(compress_schema(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":  # python -m rag_opt.wire.compress > docs/compress.schema.json
    sys.stdout.write(schema_json())
