"""Which tenant a request belongs to, for the encoding cache's namespaces (``--cache-namespace``).

The encoding cache answers a document block it has seen from any request; across tenants that is a side channel
(a hit is faster, and ``--expose-cache-hits`` counts it), so a proxy serving several tenants keeps their entries
apart: every request's cache lookups and writes run in its tenant's namespace
(:func:`rag_opt.models.encoding_cache.cache_namespace`, set per job by :class:`rag_opt.server.engine.Engine`), and
a tenant's entries are never another's hits. :func:`request_namespace` names the tenant:

* ``none`` (the default): one namespace for all (None);
* ``api-key``: the client's credentials, as the proxy and the upstream read them: the token of
  ``Authorization: Bearer <token>`` (any other ``Authorization`` value as it is), ``x-api-key`` (Anthropic),
  ``api-key`` (Azure OpenAI), ``x-goog-api-key`` and, on the Gemini API's paths, the ``key`` query parameter.
  The distinct values presented are hashed together (one key sent as a bearer token on one route and as
  ``x-api-key`` on another is one tenant). The proxy's own ``--api-key`` never counts: the front door removes it
  before any route reads the request (:mod:`rag_opt.server.security`), so every holder of the proxy key alone is
  one tenant;
* ``header:NAME``: the value of the request header ``NAME`` (set by a trusted gateway in front of the proxy).

A request with no credential (or without the header) is in the fixed namespace :data:`ANONYMOUS`. A namespace is a
SHA-256 of what named it, and only that hash ever leaves this module (hashed again into the cache's store keys):
no key or header value is stored or logged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from urllib.parse import unquote_to_bytes

from rag_opt.server.settings import ProxySettings

__all__ = ["ANONYMOUS", "CREDENTIAL_HEADERS", "request_namespace"]

ANONYMOUS = "anonymous"  # the namespace of a request that presents no credential (never a hash: those are hex)
# the headers that carry a client's key (as the upstream reads them; Authorization's Bearer token, see below)
CREDENTIAL_HEADERS = ("authorization", "x-api-key", "api-key", "x-goog-api-key")
_HASH_CHARS = 32  # hex characters kept of a namespace's SHA-256 (128 bits)


def request_namespace(
    settings: ProxySettings, headers: Mapping[str, str], query: str | bytes | None = None
) -> str | None:
    """The encoding cache namespace of a request with these ``headers`` (as the route reads them, the proxy key
    removed) under ``settings.cache_namespace``: None for ``none``, else a hash of the client's key (``api-key``)
    or of the header's value (``header:NAME``), or :data:`ANONYMOUS` when there is none. ``query``: the query
    string of a request on the Gemini API's paths, whose ``key`` parameter is a credential there (None
    elsewhere)."""
    mode = settings.cache_namespace
    if mode == "none":
        return None
    if mode == "api-key":
        keys = _credentials(headers, query)
        return _digest(b"api-key", *sorted(keys)) if keys else ANONYMOUS
    name = mode.removeprefix("header:")
    values = [v.strip() for v in _values(headers, name) if v.strip()]
    if not values:
        return ANONYMOUS
    return _digest(b"header", name.encode("latin-1"), *(v.encode("latin-1", "replace") for v in values))


def _credentials(headers: Mapping[str, str], query: str | bytes | None) -> set[bytes]:
    """The distinct credentials a request presents (see the module docstring)."""
    found: set[bytes] = set()
    for name in CREDENTIAL_HEADERS:
        for value in _values(headers, name):
            value = value.strip()
            if name == "authorization":
                scheme, _, token = value.partition(" ")
                if scheme.lower() == "bearer":
                    value = token.strip()
            if value:
                found.add(value.encode("latin-1", "replace"))
    if query:
        raw = query.encode("latin-1", "replace") if isinstance(query, str) else query
        for param in raw.split(b"&"):
            param_name, _, given = param.partition(b"=")
            if param_name == b"key" and given:
                found.add(unquote_to_bytes(given.replace(b"+", b" ")))
    return found


def _values(headers: Mapping[str, str], name: str) -> list[str]:
    """Every value of the header ``name`` (all of a repeated header's, where ``headers`` keeps them)."""
    getlist = getattr(headers, "getlist", None)
    if callable(getlist):
        return [str(v) for v in getlist(name)]
    for key, value in headers.items():
        if key.lower() == name:
            return [value]
    return []


def _digest(kind: bytes, *parts: bytes) -> str:
    h = hashlib.sha256(kind)
    for part in parts:
        h.update(b"\0" + len(part).to_bytes(8, "big") + part)  # length-prefixed: no two lists hash alike
    return h.hexdigest()[:_HASH_CHARS]
