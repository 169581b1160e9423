"""The errors of the transport-free core: a client error in a request (:class:`RequestError`, which each surface
answers in its own shape: a 4xx of the route's error shape on ``rag-opt serve``, a ``GatewayError`` in a gateway)
and a result that could not be written back (:class:`RewriteError`: the request goes on unoptimized).

Both derive from :class:`rag_opt.errors.RagOptError` (and from the built-in exception they replaced, so
``except ValueError`` / ``except RuntimeError`` keep working).
"""

from __future__ import annotations

from rag_opt.errors import RagOptError

__all__ = ["RequestError", "RewriteError"]


class RequestError(RagOptError, ValueError):
    """A client error in a request (its body, the ``rag_opt`` field or ``x-ragopt-*`` headers); answered with an
    error (``status``, 400 unless said otherwise) carrying ``message``, ``param`` and ``code``."""

    def __init__(
        self, message: str, param: str | None = None, code: str = "invalid_rag_opt", status: int = 400
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


class RewriteError(RagOptError, RuntimeError):
    """An optimization result could not be written back into the request body (the request is then forwarded
    unoptimized)."""
