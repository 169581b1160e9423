"""The shape of a JSON value with character offsets: containers, their items and the commas between them.

:func:`json_tree` reads one valid JSON value (a protected ``json`` block of the segmentation, already checked by
:func:`rag_opt.text.json_blocks.json_block_end`) in one linear pass, without recursion, so the structured
segmentation (:mod:`rag_opt.text.structure`) can cut it into array items and object members.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["JsonItem", "JsonNode", "json_tree"]

# one token after optional whitespace: a string (escapes unrolled: linear), a number or literal, a punctuator
_TOKEN = re.compile(r'\s*(?:("[^"\\]*(?:\\.[^"\\]*)*")|([-+.\w]+)|([\[\]{}:,]))', re.S)


@dataclass(slots=True)
class JsonItem:
    """An array item or an object member: ``start`` is the member's key (or the item's value); ``comma`` the
    offset of the comma before it (-1 for the first)."""

    start: int
    comma: int
    value: JsonNode


@dataclass(slots=True)
class JsonNode:
    """A value ``text[start:end]``; for a container, ``open_end`` is just after its opening bracket,
    ``close`` the offset of its closing bracket and ``items`` its items in order."""

    start: int
    end: int
    container: bool = False
    open_end: int = 0
    close: int = 0
    items: list[JsonItem] = field(default_factory=list)


def json_tree(text: str, start: int) -> JsonNode:
    """The JSON value starting at or after ``start`` (leading whitespace skipped). ``ValueError`` if it is not
    valid JSON as far as its structure goes (scalars are taken as they stand)."""
    pos = start
    stack: list[JsonNode] = []
    key_start = -1  # an object's member key seen, its value pending
    comma = -1
    while True:
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"not JSON at offset {pos}")
        pos = m.end()
        tok_start = m.start(1) if m.group(1) else (m.start(2) if m.group(2) else m.start(3))
        punct = m.group(3)
        parent = stack[-1] if stack else None
        if punct in ("]", "}"):
            if parent is None:
                raise ValueError(f"unbalanced {punct!r} at offset {tok_start}")
            parent.close, parent.end = tok_start, pos
            stack.pop()
            comma = -1
            if not stack:
                return parent
            continue
        if punct == ",":
            comma = tok_start
            continue
        if punct == ":":
            continue
        is_object = parent is not None and text[parent.start] == "{"
        if is_object and key_start < 0:  # a member's key
            if not m.group(1):
                raise ValueError(f"an object key must be a string (offset {tok_start})")
            key_start = tok_start
            continue
        if punct in ("[", "{"):
            node = JsonNode(tok_start, -1, True, pos)
        else:
            node = JsonNode(tok_start, pos)
        if parent is not None:
            parent.items.append(JsonItem(key_start if is_object else tok_start, comma, node))
        key_start, comma = -1, -1
        if node.container:
            stack.append(node)
        elif parent is None:
            return node
