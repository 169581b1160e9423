"""Reading a request of an optimized route: its body's structure, and rag-opt's own per-request options.

A body that is not UTF-8 JSON, not an object, or whose structure rag-opt reads is malformed (for a chat
completion: its ``messages``; the other routes pass their own check to :func:`parse_request`) is a client error
(:class:`~rag_opt.wire.errors.RequestError`, answered with a 400 in the route's error shape); rag-opt
validates only the structure it reads, everything else is the upstream's to validate.

One rule on every route for what rag-opt reads (``/v1/compress``: the whole body; the forwarding routes: the keys
each checks, the ``rag_opt`` field, and the texts it reads as documents or as the question): a key that appears
twice in one object is a 400 ``duplicate_key`` (rag-opt and the upstream could read different values), and a
string holding a lone UTF-16 surrogate (a ``\\ud800``-style escape without its pair: not Unicode text) is a
400 ``lone_surrogate``, each naming where (:func:`check_readable`, :func:`lone_surrogate`). What rag-opt does not
read is forwarded as sent.

Per-request options come from the ``x-ragopt-*`` headers (``ratio``, ``target-tokens``, ``threshold``,
``ordering``, ``language``, ``disable``) and the ``rag_opt`` extension field (``query``, ``documents``,
``ratio``, ``target_tokens``, ``threshold``, ``ordering``, ``language``, ``placement``, ``enabled``), the field
over the headers; a budget in the field replaces one in the headers. ``language`` (an ISO 639 code) overrides the
server's ``--language`` for this request: segmentation and the BM25 stopwords follow it.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from rag_opt.errors import InvalidInputError
from rag_opt.options import BUDGET_FIELDS  # also accepted at the top level of a request
from rag_opt.text.language import check_language
from rag_opt.types import Budget, Document, check_ordering, to_documents
from rag_opt.wire.errors import RequestError

__all__ = [
    "EXTENSION_FIELD",
    "HEADER_PREFIX",
    "BodyCheck",
    "Options",
    "check_chat_body",
    "check_messages",
    "check_parts",
    "check_readable",
    "check_request_language",
    "check_unique",
    "decode_body",
    "json_type",
    "load_object",
    "lone_surrogate",
    "parse_request",
]

EXTENSION_FIELD = "rag_opt"
HEADER_PREFIX = "x-ragopt-"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_HEADERS = ("ratio", "target-tokens", "threshold", "ordering", "language", "disable")
_BODY_KEYS = frozenset({"messages", EXTENSION_FIELD})  # the keys rag-opt reads, where a duplicate is refused
_MESSAGE_KEYS = frozenset({"role", "content"})
_PART_KEYS = frozenset({"type", "text"})

BodyCheck = Callable[[dict[str, Any]], None]
"""Checks the structure of a decoded request body that rag-opt reads; raises RequestError."""


@dataclass(frozen=True)
class Options:
    """Per-request settings: the ``rag_opt`` field over the ``x-ragopt-*`` headers; None = server default."""

    budget: Budget | None = None
    ordering: str | None = None
    language: str | None = None
    query: str | None = None
    placement: str = "user"
    enabled: bool = True


class _Extension(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    documents: list[Any] | None = None
    query: str | None = None
    ratio: float | None = None
    target_tokens: int | None = None
    threshold: float | None = None
    ordering: str | None = None
    language: str | None = None
    placement: Literal["user", "system"] = "user"
    enabled: bool = True


class _Duplicated(dict[str, Any]):
    """A JSON object in which some keys appeared more than once (the last value kept, as ``json.loads`` does)."""

    duplicates: frozenset[str] = frozenset()


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) == len(pairs):
        return out
    seen: set[str] = set()
    repeated: set[str] = set()
    for key, _ in pairs:
        (repeated if key in seen else seen).add(key)
    dup = _Duplicated(out)
    dup.duplicates = frozenset(repeated)
    return dup


def check_unique(obj: dict[str, Any], where: str, keys: frozenset[str] | None = None) -> None:
    """Refuse ``obj`` if a key rag-opt reads (``keys``; None: every key) appears in it more than once: rag-opt
    and the upstream could read different values."""
    dups: frozenset[str] = getattr(obj, "duplicates", frozenset())
    for key in sorted(dups if keys is None else dups & keys):
        param = f"{where}.{key}" if where else key
        raise RequestError(
            f"{param} appears more than once in the request body: send each key once (rag-opt and the upstream "
            "could read different values)",
            param,
            "duplicate_key",
        )


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(where: str, param: str | None) -> RequestError:
    """The 400 for a text rag-opt reads (at ``where``; ``param``: the error's ``param``) that holds a lone UTF-16
    surrogate: the same on every route."""
    return RequestError(
        f"{where} holds a lone UTF-16 surrogate (a \\ud800-style escape without its pair), which is not Unicode "
        "text: send well-formed text (a surrogate pair, or the character itself)",
        param,
        "lone_surrogate",
    )


def check_readable(value: Any, where: str = "") -> None:
    """Refuse what rag-opt reads whole (``value``, at ``where`` in the body: ``/v1/compress``'s body, the ``rag_opt``
    field) when it holds, at any depth, a key that appears more than once in one object (:func:`check_unique`) or
    a string or key with a lone UTF-16 surrogate (:func:`lone_surrogate`); the first found, in document order."""
    stack: list[tuple[str, Any]] = [(where, value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                raise lone_surrogate(path or "the request body", path or None)
        elif isinstance(v, dict):
            check_unique(v, path)
            items = []
            for key, item in v.items():
                sub = f"{path}.{key}" if path else key
                if _SURROGATE.search(key):
                    raise lone_surrogate(f"a key of {path}" if path else "a key of the request body", path or None)
                items.append((sub, item))
            stack.extend(reversed(items))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(v))))


def _budget(ratio: Any, target_tokens: Any, threshold: Any, where: str) -> Budget:
    try:
        return Budget(ratio=ratio, target_tokens=target_tokens, threshold=threshold)
    except InvalidInputError as exc:
        raise RequestError(f"{where}: {exc}", param=where) from None


def _check_ordering(ordering: str | None, where: str) -> None:
    if ordering is None:
        return
    try:
        check_ordering(ordering)
    except InvalidInputError as exc:
        raise RequestError(f"{where}: {exc}", param=where) from None


def check_request_language(language: str | None, where: str) -> str | None:
    """``language`` as a normalised ISO 639 code (None stays None), or a :class:`RequestError` naming ``where``."""
    if language is None:
        return None
    try:
        return check_language(language)
    except InvalidInputError as exc:
        raise RequestError(f"{where}: {exc}", param=where, code="invalid_language") from None


def _header_options(headers: Mapping[str, str]) -> dict[str, Any]:
    """Read the ``x-ragopt-*`` request headers (names case-insensitive); unknown ones are an error."""
    found = {
        k.lower()[len(HEADER_PREFIX) :]: v.strip() for k, v in headers.items() if k.lower().startswith(HEADER_PREFIX)
    }
    out: dict[str, Any] = {}
    for name, value in found.items():
        where = HEADER_PREFIX + name
        if name not in _HEADERS:
            raise RequestError(
                f"unknown header {where}; rag-opt reads {', '.join(HEADER_PREFIX + h for h in _HEADERS)}"
            )
        try:
            if name in ("ratio", "threshold"):
                out[name] = float(value)
            elif name == "target-tokens":
                out["target_tokens"] = int(value)
            elif name in ("ordering", "language"):
                out[name] = value
            elif value.lower() in _TRUE | _FALSE:
                out["enabled"] = value.lower() not in _TRUE
            else:
                raise ValueError
        except ValueError:
            raise RequestError(f"{where}: invalid value {value!r}", param=where) from None
    _budget(out.get("ratio"), out.get("target_tokens"), out.get("threshold"), "x-ragopt headers")
    _check_ordering(out.get("ordering"), HEADER_PREFIX + "ordering")
    if "language" in out:
        out["language"] = check_request_language(out["language"], HEADER_PREFIX + "language")
    return out


def _extension(value: Any) -> tuple[_Extension, list[Document]]:
    """Validate the ``rag_opt`` field; returns it and its documents."""
    if not isinstance(value, dict):
        raise RequestError(f"'{EXTENSION_FIELD}' must be an object, got {type(value).__name__}", EXTENSION_FIELD)
    check_readable(value, EXTENSION_FIELD)  # rag-opt reads all of it (and removes it before forwarding)
    try:
        ext = _Extension.model_validate(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join([EXTENSION_FIELD, *map(str, err["loc"])])
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        raise RequestError(f"{where}: {msg}", param=where) from None
    _budget(ext.ratio, ext.target_tokens, ext.threshold, EXTENSION_FIELD)
    _check_ordering(ext.ordering, f"{EXTENSION_FIELD}.ordering")
    ext.language = check_request_language(ext.language, f"{EXTENSION_FIELD}.language")
    if ext.query is not None and not ext.query.strip():
        raise RequestError(f"{EXTENSION_FIELD}.query is empty", f"{EXTENSION_FIELD}.query")
    docs: list[Document] = []
    if ext.documents is not None:
        try:
            docs = to_documents(ext.documents)
        except (TypeError, ValueError) as exc:
            raise RequestError(f"{EXTENSION_FIELD}.{exc}", f"{EXTENSION_FIELD}.documents") from None
    return ext, docs


def parse_request(
    raw: bytes, headers: Mapping[str, str], check: BodyCheck | None = None
) -> tuple[dict[str, Any], Options, list[Document]]:
    """The decoded body of a request, its :class:`Options` and the documents of its ``rag_opt`` field (empty
    without one). ``check``: the route's check of the body's structure (default: a chat completion's,
    :func:`check_chat_body`).

    Raises :class:`~rag_opt.wire.errors.RequestError` for an unknown or invalid ``x-ragopt-*`` header (checked
    first), a body that is not a valid request (JSON, an object, then ``check``) or an invalid ``rag_opt``
    member."""
    opts = _header_options(headers)
    body = load_object(raw)
    (check or check_chat_body)(body)
    docs: list[Document] = []
    if EXTENSION_FIELD in body:
        ext, docs = _extension(body[EXTENSION_FIELD])
        if ext.ratio is not None or ext.target_tokens is not None or ext.threshold is not None:
            for k in BUDGET_FIELDS:
                opts.pop(k, None)
        opts.update(ext.model_dump(exclude={"documents"}, exclude_unset=True, exclude_none=True))
    limits = {k: opts.pop(k) for k in BUDGET_FIELDS if k in opts}
    return body, Options(budget=Budget(**limits) if limits else None, **opts), docs


def check_messages(messages: Any, where_list: str = "messages", text_types: tuple[str, ...] = ("text",)) -> None:
    """The structure rag-opt relies on: ``messages`` is a list of objects with a string ``role`` and a
    ``content`` that is absent, null, a string or a list of objects (whose ``text``, for parts of a type in
    ``text_types``, is a string). Everything else in the request is the upstream's to validate."""
    if not isinstance(messages, list):
        raise RequestError(
            f"'{where_list}' must be an array of message objects, got {json_type(messages)}",
            where_list,
            "invalid_type",
        )
    for i, m in enumerate(messages):
        where = f"{where_list}[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where} must be an object, got {json_type(m)}", where, "invalid_type")
        check_unique(m, where, _MESSAGE_KEYS)
        if "role" not in m:
            raise RequestError(f"{where}.role is missing", f"{where}.role", "missing_required_parameter")
        if not isinstance(m["role"], str):
            raise RequestError(
                f"{where}.role must be a string, got {json_type(m['role'])}", f"{where}.role", "invalid_type"
            )
        content = m.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise RequestError(
                f"{where}.content must be a string, an array of content parts or null, got {json_type(content)}",
                f"{where}.content",
                "invalid_type",
            )
        check_parts(content, f"{where}.content", text_types)


def check_parts(content: list[Any], where: str, text_types: tuple[str, ...] = ("text",)) -> None:
    """Each content part is an object; those of a type in ``text_types`` have a string ``text``."""
    for j, part in enumerate(content):
        pwhere = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise RequestError(f"{pwhere} must be an object, got {json_type(part)}", pwhere, "invalid_type")
        check_unique(part, pwhere, _PART_KEYS)
        if part.get("type") in text_types and not isinstance(part.get("text"), str):
            raise RequestError(
                f"{pwhere}.text must be a string, got {json_type(part.get('text'))}",
                f"{pwhere}.text",
                "invalid_type",
            )


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__  # pragma: no cover


def check_chat_body(body: dict[str, Any]) -> None:
    """A chat completion body's structure (see :func:`check_messages`); a duplicate ``messages`` or
    ``rag_opt`` is refused."""
    check_unique(body, "", _BODY_KEYS)
    if "messages" not in body:
        raise RequestError("missing required parameter 'messages'", "messages", "missing_required_parameter")
    check_messages(body["messages"])


def load_object(raw: bytes) -> dict[str, Any]:
    """Decode a request body that must be a JSON object encoded as UTF-8 (RequestError otherwise)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(
            f"the request body is not valid UTF-8 (byte {exc.start}): send JSON encoded as UTF-8",
            code="invalid_encoding",
        ) from None
    try:
        body = json.loads(text, object_pairs_hook=_object)
    except json.JSONDecodeError as exc:
        raise RequestError(
            f"the request body is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})",
            code="invalid_json",
        ) from None
    except RecursionError:
        raise RequestError("the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {json_type(body)}", code="invalid_json")
    return body


def decode_body(raw: bytes, encoding: str, limit: int) -> bytes:
    """A request body sent with ``Content-Encoding: encoding`` (``gzip``, ``x-gzip``, ``deflate`` or
    ``identity``), decoded; at most ``limit`` bytes once decoded. Raises
    :class:`~rag_opt.wire.errors.RequestError`: 415 for another or a stacked encoding, 413 past ``limit`` (a
    gzip bomb stops there), 400 for a corrupt or truncated body."""
    codings = [c.strip().lower() for c in encoding.split(",") if c.strip() and c.strip().lower() != "identity"]
    if not codings:
        return raw
    if len(codings) > 1 or codings[0] not in ("gzip", "x-gzip", "deflate"):
        raise RequestError(
            f"Content-Encoding {encoding.strip()!r} is not supported: send the body as identity, gzip or deflate",
            code="unsupported_encoding",
            status=415,
        )
    for wbits in (47, -15) if codings[0] == "deflate" else (47,):  # 47: a gzip or zlib header; -15: raw deflate
        d = zlib.decompressobj(wbits=wbits)
        try:
            out = d.decompress(raw, limit + 1)
        except zlib.error:
            continue
        if len(out) > limit or d.unconsumed_tail:
            raise RequestError(
                f"the {codings[0]} request body exceeds the proxy's limit of {limit} bytes once decompressed "
                "(--max-body-bytes)",
                code="request_too_large",
                status=413,
            )
        if d.eof and not d.unused_data:
            return out
    raise RequestError(
        f"the request body is not valid {codings[0]} data (corrupt or truncated): check its Content-Encoding",
        code="invalid_encoding",
    )
