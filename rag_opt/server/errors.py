"""The errors the server raises on purpose, and the OpenAI-style error bodies it answers with.

Every error derives from :class:`rag_opt.errors.RagOptError` (and from the built-in exception it replaced, so
``except ValueError`` / ``except RuntimeError`` keep working).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

from rag_opt.errors import RagOptError

__all__ = [
    "BodyTooLarge",
    "BudgetExceeded",
    "Overloaded",
    "RequestError",
    "RewriteError",
    "error_json",
    "error_response",
]


class RequestError(RagOptError, ValueError):
    """A client error in a chat completion request (its body, the ``rag_opt`` field or ``x-ragopt-*``
    headers); answered with an OpenAI-style error (``status``, 400 unless said otherwise) carrying ``message``,
    ``param`` and ``code``."""

    def __init__(
        self, message: str, param: str | None = None, code: str = "invalid_rag_opt", status: int = 400
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


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


class RewriteError(RagOptError, RuntimeError):
    """An optimization result could not be written back into the request body (the request is then forwarded
    unoptimized)."""


def _error(message: str, type_: str, code: str | None, param: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_json(message: str, type_: str, code: str) -> bytes:
    """An OpenAI-style error body as bytes, for answers sent from the ASGI middleware."""
    return json.dumps(_error(message, type_, code, None)).encode()


def error_response(
    status: int,
    message: str,
    type_: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An OpenAI-style error response: ``{"error": {"message", "type", "param", "code"}}``."""
    return JSONResponse(_error(message, type_, code, param), status, headers=headers)
