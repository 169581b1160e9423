"""The request paths the proxy accepts, and the upstream URL of a forwarded request.

A request path must be plain: it starts with ``/``, is at most :data:`MAX_PATH_BYTES` long (else 414), and has
no empty segment (``//``, a trailing ``/``), no raw ``\\``, no malformed ``%`` escape, and no segment that,
percent-decoded once or more (double encoding: ``%252e``), is ``.`` or ``..`` (or only dots and spaces),
including before a ``;`` path parameter (``..;``, ``.;x``, ``;x``), holds a ``/``, a ``\\`` or a control
character, or is not valid UTF-8 (overlong forms such as ``%c0%ae`` for ``.``) (else 400, ``invalid_path``).
The local routes (:data:`LOCAL_PATHS`: chat completions, Anthropic messages, OpenAI responses, ``/v1/compress``
and its schema) are matched exactly: a path that another server could read as one of them — differing in
letter case, in a ``;`` parameter (``/v1/chat/completions;x``), in trailing or leading spaces or dots
(``/v1/chat/completions%20``) or in Unicode compatibility forms — is refused rather than forwarded unvalidated.
So one path means one thing to the proxy and to the upstream, and no redirect is ever built from the client's
``Host``.

The upstream URL is built from the parts of ``--upstream`` (scheme, host, port and base path), never by
joining strings: the client's path below ``/v1`` is appended to the base path and its query string kept, and
the result is checked to have the base's scheme, host and port and a path under the base path.
"""

from __future__ import annotations

import re
import unicodedata
from urllib.parse import unquote_to_bytes

import httpx

from rag_opt.server.errors import ErrorFormat, RequestError

__all__ = [
    "CHAT_PATH",
    "JSON_PATHS",
    "LOCAL_PATHS",
    "MAX_PATH_BYTES",
    "MESSAGES_PATH",
    "OPTIMIZED_PATHS",
    "RESPONSES_PATH",
    "check_path",
    "error_format",
    "upstream_url",
]

MAX_PATH_BYTES = 8192
CHAT_PATH = "/v1/chat/completions"
MESSAGES_PATH = "/v1/messages"  # the Anthropic Messages API
RESPONSES_PATH = "/v1/responses"  # the OpenAI Responses API
OPTIMIZED_PATHS = (CHAT_PATH, MESSAGES_PATH, RESPONSES_PATH)
JSON_PATHS = (*OPTIMIZED_PATHS, "/v1/compress")  # routes answered here that take JSON bodies
LOCAL_PATHS = (*JSON_PATHS, "/v1/compress/schema")  # routes answered here, never forwarded
_BAD_ESCAPE = re.compile(rb"%(?![0-9A-Fa-f]{2})")
_ESCAPE = re.compile(rb"%[0-9A-Fa-f]{2}")
_CONTROL = re.compile(rb"[\x00-\x1f\x7f]")
_DECODINGS = 4  # percent-decoding rounds looked through (%25252e...); a segment still encoded after them is refused


def _invalid(reason: str) -> RequestError:
    return RequestError(
        f"invalid request path: {reason}; rag-opt forwards only plain paths such as /v1/chat/completions",
        code="invalid_path",
    )


def check_path(raw_path: bytes, path: str) -> None:
    """Refuse a request path that is not plain (see the module docstring); ``raw_path`` as received, ``path``
    percent-decoded. Raises :class:`~rag_opt.server.errors.RequestError` (414 or 400)."""
    if len(raw_path) > MAX_PATH_BYTES:
        raise RequestError(
            f"the request path is {len(raw_path)} bytes long, more than the proxy's limit of {MAX_PATH_BYTES}",
            code="uri_too_long",
            status=414,
        )
    if not raw_path.startswith(b"/"):
        raise _invalid("the request target must be a path starting with '/'")
    if raw_path == b"/":
        return
    if b"\\" in raw_path:
        raise _invalid("it has a backslash")
    if _BAD_ESCAPE.search(raw_path):
        raise _invalid("it has a '%' not followed by two hexadecimal digits")
    canonical = []
    for segment in raw_path[1:].split(b"/"):
        if not segment:
            raise _invalid("it has an empty segment ('//' or a trailing '/')")
        canonical.append(_check_segment(segment))
    alias = "/" + "/".join(canonical)
    for local in LOCAL_PATHS:
        if path != local and alias == local:
            raise _invalid(f"another server could read it as {local} (letter case, ';', spaces or dots)")


def _check_segment(segment: bytes) -> str:
    """Refuse a path segment that is not plain (see the module docstring); its canonical form: decoded, cut at
    a ``;``, stripped of spaces and dots, NFKC-normalised and case-folded (for :data:`LOCAL_PATHS` aliases)."""
    stages = [segment]
    while _ESCAPE.search(stages[-1]):
        if len(stages) > _DECODINGS:
            raise _invalid("it is percent-encoded too many times over")
        stages.append(unquote_to_bytes(stages[-1]))
    text = ""
    for decoded in stages:  # as received, then decoded once, twice...
        try:
            text = decoded.decode("utf-8")
        except UnicodeDecodeError:
            raise _invalid("it is not valid UTF-8 once decoded (an overlong or malformed sequence)") from None
        if b"/" in decoded or b"\\" in decoded:
            raise _invalid("it has an encoded '/' or '\\' (%2F, %5C)")
        if _CONTROL.search(decoded):
            raise _invalid("it has a control character")
        if not decoded.split(b";", 1)[0].strip(b". "):
            raise _invalid("it has a '.' or '..' segment (or one of only dots, or empty before a ';')")
    return unicodedata.normalize("NFKC", text.split(";", 1)[0]).strip().strip(".").strip().casefold()


def error_format(path: str) -> ErrorFormat:
    """The shape of rag-opt's own error answers on ``path``: Anthropic's on the Messages route, else OpenAI's."""
    return "anthropic" if path == MESSAGES_PATH else "openai"


def upstream_url(base: httpx.URL, raw_path: bytes, query: bytes) -> httpx.URL:
    """The upstream URL of a request for ``raw_path`` (a checked path under ``/v1/``) with ``query``: the base
    path of ``base`` followed by the path below ``/v1``. Raises
    :class:`~rag_opt.server.errors.RequestError` if the result would leave the base (scheme, host, port or
    path)."""
    if not raw_path.startswith(b"/v1/"):
        raise _invalid("forwarded paths start with /v1/")
    prefix = base.raw_path.split(b"?", 1)[0].rstrip(b"/")
    url = base.copy_with(raw_path=prefix + raw_path[len(b"/v1") :] + (b"?" + query if query else b""))
    under = base.path.rstrip("/") + "/"
    if (url.scheme, url.host, url.port) != (base.scheme, base.host, base.port) or not url.path.startswith(under):
        raise _invalid("it would leave the upstream base URL")
    return url
