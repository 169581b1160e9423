"""The errors the server raises on purpose, and the error bodies it answers with: OpenAI-style
(``{"error": {"message", "type", "param", "code"}}``) everywhere but on the Anthropic Messages route, which
answers in Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``), and on the Gemini API's paths
(``/v1beta/...``, ``/v1/models/{model}:{method}``), which answer in Google's (``{"error": {"code", "message",
"status", "details"}}``; see :data:`ErrorFormat`).

Every error derives from :class:`rag_opt.errors.RagOptError` (and from the built-in exception it replaced, so
``except ValueError`` / ``except RuntimeError`` keep working). A client's invalid request and a result that cannot
be written back are the transport-free core's errors (:mod:`rag_opt.wire.errors`), answered here.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from starlette.responses import JSONResponse

from rag_opt.errors import RagOptError

__all__ = [
    "BodyTooLarge",
    "BudgetExceeded",
    "ErrorFormat",
    "Overloaded",
    "error_json",
    "error_response",
]


class BodyTooLarge(RagOptError):
    """The request body is over ``--max-body-bytes``."""


class Overloaded(RagOptError):
    """The optimization was not admitted to the worker pool: ``reason`` is ``queue_full`` or ``estimate``."""

    def __init__(self, reason: str, estimate_s: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.estimate_s = estimate_s


class BudgetExceeded(RagOptError):
    """The time budget ran out while the job was ``queued`` (it never ran) or ``running`` (left to finish)."""

    def __init__(self, stage: str) -> None:
        super().__init__(stage)
        self.stage = stage


ErrorFormat = Literal["openai", "anthropic", "google"]
"""The shape of the error bodies rag-opt answers with itself: ``openai``, ``anthropic`` (the Messages API) or
``google`` (the Gemini API)."""

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors); other 5xx: api_error
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


# Google's canonical error statuses (google.rpc.Code) by HTTP status, as the Gemini API answers them;
# another 4xx: INVALID_ARGUMENT, another 5xx: INTERNAL
_GOOGLE_STATUSES = {
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    405: "UNIMPLEMENTED",  # (no canonical code for a wrong method: the method is not implemented on that path)
    408: "DEADLINE_EXCEEDED",
    409: "ABORTED",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    501: "UNIMPLEMENTED",
    502: "UNAVAILABLE",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def _google(message: str, code: str | None, param: str | None, status: int) -> dict[str, Any]:
    """Google's error body; rag-opt's own code (and the ``param`` it names) in a ``google.rpc.ErrorInfo``."""
    kind = _GOOGLE_STATUSES.get(status, "INTERNAL" if status >= 500 else "INVALID_ARGUMENT")
    error: dict[str, Any] = {"code": status, "message": message, "status": kind}
    if code:
        info: dict[str, Any] = {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": code.upper()}
        info["domain"] = "rag-opt"
        if param:
            info["metadata"] = {"param": param}
        error["details"] = [info]
    return {"error": error}


def _error(
    message: str, type_: str, code: str | None, param: str | None, fmt: ErrorFormat = "openai", status: int = 400
) -> dict[str, Any]:
    if fmt == "google":
        return _google(message, code, param, status)
    if fmt == "anthropic":
        kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_json(message: str, type_: str, code: str, fmt: ErrorFormat = "openai", status: int = 400) -> bytes:
    """An error body (OpenAI-style, or Anthropic's or Google's for ``fmt="anthropic"`` / ``"google"``, its type
    from ``status``) as bytes, for answers sent from the ASGI middleware."""
    return json.dumps(_error(message, type_, code, None, fmt, status)).encode()


def error_response(
    status: int,
    message: str,
    type_: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    fmt: ErrorFormat = "openai",
) -> JSONResponse:
    """An error response: OpenAI-style ``{"error": {"message", "type", "param", "code"}}``, with
    ``fmt="anthropic"`` Anthropic's ``{"type": "error", "error": {"type", "message"}}`` (its type from
    ``status``), with ``fmt="google"`` Google's ``{"error": {"code": status, "message", "status": "INVALID_ARGUMENT"
    ..., "details": [{"@type": "...google.rpc.ErrorInfo", "reason": CODE, "domain": "rag-opt"}]}}``."""
    return JSONResponse(_error(message, type_, code, param, fmt, status), status, headers=headers)
