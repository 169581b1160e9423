"""The routing key of a request: which documents it carries, read at the transport level by the ingress.

Document routing sends requests over the same documents to the same replica, whose in-process memory tier of the
encoding cache then holds them. The key is computed from the request body alone, cheaply, without the model and
without any of the optimizer's logic (nothing is scored, selected or ordered here):

* the *document texts* (:func:`document_texts`): the ``documents`` array of a ``/v1/compress`` body and the
  ``rag_opt.documents`` extension of a chat body (each a string or an object's ``text``), and the text between
  ``<document ...>`` and ``</document>`` tags (``--document-tag``) in any string of the body, whatever the API
  (OpenAI chat and Responses, Anthropic Messages, Gemini); without any of those, the string contents of the
  ``tool``/``function`` messages (a tool result is context). It approximates what the server optimizes (the
  server's own parser reads more cases: :mod:`rag_opt.wire.documents`); an approximation only moves a request
  to another replica, it never changes its answer;
* the *key* (:func:`routing_key`): the least of the documents' 128-bit BLAKE2b hashes (each text stripped), a
  one-permutation MinHash. The same documents, in any order, always give the same key; two sets of documents that
  overlap give the same key with a probability equal to their Jaccard similarity (the share of documents they
  have in common), so retrievals that mostly agree tend to meet on one replica, where their common documents are
  cached. A body without documents, not JSON, or sent with a ``Content-Encoding`` has no key (it is routed as
  random routing would).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

__all__ = ["document_texts", "rank_replicas", "routing_key", "text_hash"]

_TOOL_ROLES = ("tool", "function")
_EXTENSION = "rag_opt"  # the chat extension field (rag_opt.wire.request.EXTENSION_FIELD)


@lru_cache(maxsize=16)
def _block_pattern(tag: str) -> re.Pattern[str]:
    """``<tag ...>text</tag>``, the text captured (tags matched case-insensitively, attributes skipped)."""
    name = re.escape(tag)
    return re.compile(rf"<{name}(?:\s[^>]*)?>(.*?)</{name}\s*>", re.IGNORECASE | re.DOTALL)


def _item_text(item: Any) -> str | None:
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and isinstance(item.get("text"), str):
        return str(item["text"])
    return None


def _strings(value: Any) -> Iterator[str]:
    """Every string value under ``value`` (objects' values and arrays' items, not keys), depth first."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            yield v
        elif isinstance(v, dict):
            stack.extend(reversed(list(v.values())))
        elif isinstance(v, list):
            stack.extend(reversed(v))


def document_texts(payload: Any, tag: str = "document") -> list[str]:
    """The document texts of a parsed request body, as the router reads them (see the module's docstring): the
    ``documents`` arrays, then the ``<tag>`` blocks of every other string, else the tool messages' text."""
    if not isinstance(payload, dict):
        return []
    texts: list[str] = []
    arrays = [payload.get("documents")]
    ext = payload.get(_EXTENSION)
    if isinstance(ext, dict):
        arrays.append(ext.get("documents"))
    for array in arrays:
        if isinstance(array, list):
            texts.extend(t for t in map(_item_text, array) if t is not None)
    rest = {k: v for k, v in payload.items() if k not in ("documents", _EXTENSION)}
    pattern = _block_pattern(tag)
    for s in _strings(rest):
        if "<" in s:
            texts.extend(m.group(1) for m in pattern.finditer(s))
    if texts:
        return texts
    messages = payload.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict) and m.get("role") in _TOOL_ROLES:
                texts.extend(_strings(m.get("content")))
    return texts


def text_hash(text: str) -> str:
    """A document text's 128-bit BLAKE2b hash in hex (the text stripped; lone surrogates hashed as they are)."""
    return hashlib.blake2b(text.strip().encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def routing_key(body: bytes, *, tag: str = "document", content_encoding: str | None = None) -> str | None:
    """The routing key of a request body: the least hash (:func:`text_hash`) of its non-empty document texts
    (:func:`document_texts`), or None when it has none, is not JSON or is sent encoded (``content_encoding``
    other than ``identity``)."""
    if content_encoding and content_encoding.strip().lower() not in ("", "identity"):
        return None
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):  # not JSON (UnicodeDecodeError is a ValueError), or nested too deep
        return None
    hashes = [text_hash(t) for t in document_texts(payload, tag) if t.strip()]
    return min(hashes) if hashes else None


def _weight(key: str, replica: str) -> int:
    digest = hashlib.blake2b(f"{key}\0{replica}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank_replicas(key: str, replicas: list[str]) -> list[str]:
    """``replicas`` (their ids) in rendezvous-hashing order for ``key``: the first serves the key, the next is its
    fallback (:class:`~rag_opt.server.ray_serve.router.DocumentRouter`). A pure function of the key and the set of
    replicas: when one goes or comes, only the keys it served (or now serves) move."""
    return sorted(replicas, key=lambda r: (_weight(key, r), r), reverse=True)
