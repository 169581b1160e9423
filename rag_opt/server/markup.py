"""Finding ``<tag ...>...</tag>`` blocks in a message text, in time linear in its length.

One left-to-right pass finds the opening and closing tags (the tag name case-insensitive, a closing tag
``</tag>`` with optional whitespace before its ``>``), and pairs each closing tag with the nearest opening tag
still open, as a stack does. Then:

- **Nesting.** The *innermost* blocks (those with no other block inside) are the documents. A block around
  other blocks is markup: its tags and the text between the inner blocks are forwarded as they are. An opening
  tag never closed, and a closing tag with nothing open, are text. Tags are only ever removed in matched pairs,
  so an output is never less balanced than its input.
- **Attributes.** An opening tag's attribute values may be double-quoted, single-quoted (either may contain
  ``>`` and ``<``) or bare; names are lowercased, HTML entities in values decoded, and the first of repeated
  names wins. A self-closing tag (``<tag/>``), an opening tag with malformed attributes, and one longer than
  :data:`TAG_LIMIT` characters are text.

No regular expression here can backtrack over more than one tag's attributes, so the pass costs O(length).
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from functools import lru_cache

__all__ = ["TAG_LIMIT", "Block", "Scan", "parse_attributes", "scan", "strip_blocks"]

TAG_LIMIT = 4096  # characters of one opening tag, attributes included; a longer one is text

_ATTR = re.compile(
    r"\s*(?:(?P<end>/?>)|(?P<name>[^\s\"'<>/=`]+)"
    r"(?:\s*=\s*(?:\"(?P<dq>[^\"]*)\"|'(?P<sq>[^']*)'|(?P<bare>[^\s\"'=<>`]+)))?)"
)
_CLOSE_END = re.compile(r"\s*>")


@lru_cache(maxsize=16)
def _tags(tag: str) -> re.Pattern[str]:
    """An opening or closing tag's start: ``<tag`` or ``</tag`` followed by whitespace, ``/`` or ``>``."""
    return re.compile(rf"<(/?){re.escape(tag)}(?=[\s/>])", re.IGNORECASE)


@dataclass(frozen=True)
class Block:
    """One matched ``<tag ...>body</tag>``: ``text[start:body_start]`` is the opening tag,
    ``text[body_end:end]`` the closing one."""

    start: int
    body_start: int
    body_end: int
    end: int
    attrs: dict[str, str] = field(default_factory=dict)


@dataclass
class Scan:
    """The blocks of one text: ``documents`` (the innermost blocks) and ``outer`` (the outermost), each in
    position order and without overlaps."""

    documents: list[Block]
    outer: list[Block]


def _opening(text: str, pos: int) -> tuple[int, dict[str, str]] | None:
    """The end of the opening tag whose attributes start at ``pos``, and its attributes; None if it is not one."""
    attrs: dict[str, str] = {}
    limit = min(len(text), pos + TAG_LIMIT)
    while True:
        m = _ATTR.match(text, pos, limit)
        if m is None:
            return None
        end = m.group("end")
        if end is not None:
            return (m.end(), attrs) if end == ">" else None  # "/>": self-closing, not a block
        value = next((v for v in (m.group("dq"), m.group("sq"), m.group("bare")) if v is not None), "")
        attrs.setdefault(m.group("name").lower(), html.unescape(value))
        pos = m.end()


def scan(text: str, tag: str = "document") -> Scan:
    """The ``tag`` blocks of ``text`` (see the module docstring)."""
    pattern = _tags(tag)
    stack: list[tuple[int, int, dict[str, str], list[bool]]] = []  # start, body start, attrs, [has a block inside]
    pairs: list[tuple[Block, bool]] = []
    pos = 0
    while (m := pattern.search(text, pos)) is not None:
        if m.group(1):  # a closing tag
            close = _CLOSE_END.match(text, m.end())
            if close is None:
                pos = m.end()
                continue
            if stack:
                start, body_start, attrs, nested = stack.pop()
                pairs.append((Block(start, body_start, m.start(), close.end(), attrs), nested[0]))
                if stack:
                    stack[-1][3][0] = True
            pos = close.end()
            continue
        opened = _opening(text, m.end())
        if opened is None:
            pos = m.end()
            continue
        stack.append((m.start(), opened[0], opened[1], [False]))
        pos = opened[0]
    documents = sorted((b for b, nested in pairs if not nested), key=lambda b: b.start)
    outer: list[Block] = []
    for b in sorted((b for b, _ in pairs), key=lambda b: b.start):  # pairs nest or are disjoint
        if not outer or b.start >= outer[-1].end:
            outer.append(b)
    return Scan(documents, outer)


def strip_blocks(text: str, tag: str = "document") -> str:
    """``text`` without its blocks (each outermost block removed whole)."""
    out: list[str] = []
    pos = 0
    for b in scan(text, tag).outer:
        out.append(text[pos : b.start])
        pos = b.end
    out.append(text[pos:])
    return "".join(out)


def parse_attributes(attrs: str) -> dict[str, str]:
    """The attributes of an opening tag's attribute text (e.g. ``' id="1" title="a>b"'``); empty when it is not
    well-formed."""
    opened = _opening(attrs + ">", 0)
    return opened[1] if opened is not None else {}
