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
The Gemini routes, whose model segment varies (:func:`gemini_route`:
``/v1beta/models/{model}:generateContent`` and ``:streamGenerateContent``, also under ``tunedModels/`` and
``/v1/``), are held to the same rule by their method: a path whose first segment reads as ``v1`` or ``v1beta``
and whose last segment, decoded (once or more), NFKC-normalised, case-folded and without spaces, holds
``:generatecontent`` or ``:streamgeneratecontent`` must be exactly a Gemini route (the method spelled as the API
spells it, the model name of letters, digits, ``.``, ``_``, ``-`` and ``@``), else it is refused. So one path
means one thing to the proxy and to the upstream, and no redirect is ever built from the client's ``Host``.

Two upstreams: the Gemini API's paths (:func:`is_gemini_path`: everything under ``/v1beta/``, and the model
methods of Gemini's ``v1`` API, ``/v1/models/{model}:{method}`` for the methods in :data:`GEMINI_V1_METHODS`)
go to ``--gemini-upstream``, every other ``/v1/...`` path to ``--upstream``. Each upstream URL is built from the
parts of its base URL (scheme, host, port and base path), never by joining strings: the client's path below
``/v1`` (for ``--upstream``, an OpenAI base URL ending in its ``/v1``) or the whole path (for
``--gemini-upstream``, the API's root URL) is appended to the base path and the query string kept, and the
result is checked to have the base's scheme, host and port and a path under the base path.
"""

from __future__ import annotations

import re
import unicodedata
from urllib.parse import unquote_to_bytes

import httpx

from rag_opt.server.errors import ErrorFormat
from rag_opt.wire.errors import RequestError

__all__ = [
    "CHAT_PATH",
    "GEMINI_PREFIX",
    "GEMINI_ROUTES",
    "GEMINI_V1_METHODS",
    "JSON_PATHS",
    "LOCAL_PATHS",
    "MAX_PATH_BYTES",
    "MESSAGES_PATH",
    "OPTIMIZED_PATHS",
    "RESPONSES_PATH",
    "check_path",
    "error_format",
    "gemini_model",
    "gemini_route",
    "is_gemini_path",
    "is_streamed",
    "takes_json",
    "upstream_url",
]

MAX_PATH_BYTES = 8192
CHAT_PATH = "/v1/chat/completions"
MESSAGES_PATH = "/v1/messages"  # the Anthropic Messages API
RESPONSES_PATH = "/v1/responses"  # the OpenAI Responses API
OPTIMIZED_PATHS = (CHAT_PATH, MESSAGES_PATH, RESPONSES_PATH)
JSON_PATHS = (*OPTIMIZED_PATHS, "/v1/compress")  # routes answered here that take JSON bodies
LOCAL_PATHS = (*JSON_PATHS, "/v1/compress/schema")  # routes answered here, never forwarded
GEMINI_PREFIX = "/v1beta"  # the Gemini API's paths (the SDK's default version, v1, has its model methods too)
# the optimized Gemini methods and their metrics route labels
GEMINI_ROUTES = {
    "generateContent": "gemini_generate_content",
    "streamGenerateContent": "gemini_stream_generate_content",
}
# the methods of Gemini's v1 API on a model: their /v1 paths go to the Gemini upstream (other /v1 paths: --upstream)
GEMINI_V1_METHODS = frozenset({*GEMINI_ROUTES, "countTokens", "embedContent", "batchEmbedContents"})
_GEMINI_ROUTE = re.compile(
    r"/(?:v1beta|v1)/(models|tunedModels)/([A-Za-z0-9][A-Za-z0-9._@-]*):(generateContent|streamGenerateContent)"
)
_GEMINI_V1 = re.compile(r"/v1/(?:models|tunedModels)/[^/]+:([A-Za-z]+)")
_GEMINI_METHOD = re.compile(r":(?:stream)?generatecontent")
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
    percent-decoded. Raises :class:`~rag_opt.wire.errors.RequestError` (414 or 400)."""
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
    segments = raw_path[1:].split(b"/")
    for segment in segments:
        if not segment:
            raise _invalid("it has an empty segment ('//' or a trailing '/')")
        canonical.append(_check_segment(segment))
    alias = "/" + "/".join(canonical)
    for local in LOCAL_PATHS:
        if path != local and alias == local:
            raise _invalid(f"another server could read it as {local} (letter case, ';', spaces or dots)")
    if canonical[0] in ("v1", "v1beta") and _names_gemini_method(segments[-1]) and gemini_route(path) is None:
        raise _invalid(
            "another server could read it as a Gemini generateContent route (letter case, ';', spaces, dots or "
            "the model name's characters); send /v1beta/models/MODEL:generateContent exactly"
        )


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


def _names_gemini_method(segment: bytes) -> bool:
    """Whether a path segment, decoded (once or more), NFKC-normalised, case-folded and without spaces, holds
    ``:generatecontent`` or ``:streamgeneratecontent`` (a checked segment: it decodes)."""
    stage = segment
    for _ in range(_DECODINGS + 1):
        text = unicodedata.normalize("NFKC", stage.decode("utf-8")).casefold()
        if _GEMINI_METHOD.search("".join(text.split())):
            return True
        if not _ESCAPE.search(stage):
            return False
        stage = unquote_to_bytes(stage)
    return False


def gemini_route(path: str) -> str | None:
    """The metrics route label of an optimized Gemini route (``/v1beta/models/{model}:generateContent`` or
    ``:streamGenerateContent``, under ``models/`` or ``tunedModels/``, ``/v1beta`` or ``/v1``); None for any other
    path."""
    m = _GEMINI_ROUTE.fullmatch(path)
    return GEMINI_ROUTES[m.group(3)] if m else None


def gemini_model(path: str) -> str | None:
    """The model an optimized Gemini route names (``gemini-2.5-flash``; ``tunedModels/x`` for a tuned model)."""
    m = _GEMINI_ROUTE.fullmatch(path)
    if m is None:
        return None
    return m.group(2) if m.group(1) == "models" else f"{m.group(1)}/{m.group(2)}"


def is_gemini_path(path: str) -> bool:
    """Whether ``path`` is the Gemini API's (forwarded to ``--gemini-upstream``): ``/v1beta`` and everything
    under it, and a model method of Gemini's v1 API (``/v1/models/{model}:{method}``, the methods of
    :data:`GEMINI_V1_METHODS`)."""
    if path == GEMINI_PREFIX or path.startswith(GEMINI_PREFIX + "/"):
        return True
    m = _GEMINI_V1.fullmatch(path)
    return m is not None and m.group(1) in GEMINI_V1_METHODS


def is_streamed(path: str) -> bool:
    """Whether a response on ``path`` is a stream whatever its content type (Gemini's ``:streamGenerateContent``
    without ``alt=sse`` streams one JSON array as ``application/json``): relayed as it arrives, never read
    first."""
    return is_gemini_path(path) and path.endswith(":streamGenerateContent")


def takes_json(path: str) -> bool:
    """Whether ``path`` is a route answered here that takes a JSON body (``application/json`` only)."""
    return path in JSON_PATHS or gemini_route(path) is not None


def error_format(path: str) -> ErrorFormat:
    """The shape of rag-opt's own error answers on ``path``: Anthropic's on the Messages route, Google's on the
    Gemini API's paths (:func:`is_gemini_path`), else OpenAI's."""
    if path == MESSAGES_PATH:
        return "anthropic"
    return "google" if is_gemini_path(path) else "openai"


def upstream_url(base: httpx.URL, raw_path: bytes, query: bytes, below: bytes = b"/v1") -> httpx.URL:
    """The upstream URL of a request for ``raw_path`` (a checked path under ``below``) with ``query``: the base
    path of ``base`` followed by the path below ``below`` (``b""``: the whole path, for the Gemini upstream,
    whose base is the API's root). Raises :class:`~rag_opt.wire.errors.RequestError` if the result would
    leave the base (scheme, host, port or path)."""
    if not raw_path.startswith(below + b"/"):
        raise _invalid(f"forwarded paths start with {below.decode()}/")
    prefix = base.raw_path.split(b"?", 1)[0].rstrip(b"/")
    url = base.copy_with(raw_path=prefix + raw_path[len(below) :] + (b"?" + query if query else b""))
    under = base.path.rstrip("/") + "/"
    if (url.scheme, url.host, url.port) != (base.scheme, base.host, base.port) or not url.path.startswith(under):
        raise _invalid("it would leave the upstream base URL")
    return url
