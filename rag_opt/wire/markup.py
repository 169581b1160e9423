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
- **Code.** Tags inside Markdown code are text (:func:`code_spans`): a fenced code block (a line of three or
  more backticks or tildes, up to three spaces in, closed by a line of at least as many of the same; an unclosed
  fence is not code) or an inline code span (a run of backticks closed by a run of the same length in the same
  paragraph) — when the tags inside it pair up among themselves (an example of the markup), or it is an inline
  span on one line whose tags are all opening or all closing ones (a tag quoted: ```<document>```). Other code
  regions are not taken for code, their tags count: such a region is most likely a fence or a backtick run that
  only looks like one, cut in two by chunking or next to a tag (```` <document>```py ````), or stray backticks
  such as ````quotes''`` in two documents.

No regular expression here can backtrack over more than one tag's attributes, so the pass costs O(length).
"""

from __future__ import annotations

import html
import re
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache

__all__ = ["TAG_LIMIT", "Block", "Scan", "code_spans", "parse_attributes", "scan", "strip_blocks"]

TAG_LIMIT = 4096  # characters of one opening tag, attributes included; a longer one is text

_ATTR = re.compile(
    r"\s*(?:(?P<end>/?>)|(?P<name>[^\s\"'<>/=`]+)"
    r"(?:\s*=\s*(?:\"(?P<dq>[^\"]*)\"|'(?P<sq>[^']*)'|(?P<bare>[^\s\"'=<>`]+)))?)"
)
_CLOSE_END = re.compile(r"\s*>")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})([^\n]*)", re.MULTILINE)
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")
_BACKTICKS = re.compile(r"`+")


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


@dataclass(frozen=True)
class _Tag:
    start: int
    end: int
    opening: bool
    attrs: dict[str, str]


def _tag_tokens(text: str, tag: str) -> list[_Tag]:
    """The well-formed opening and closing ``tag`` tags of ``text``, in order."""
    pattern = _tags(tag)
    tokens: list[_Tag] = []
    pos = 0
    while (m := pattern.search(text, pos)) is not None:
        if m.group(1):  # a closing tag
            close = _CLOSE_END.match(text, m.end())
            if close is not None:
                tokens.append(_Tag(m.start(), close.end(), False, {}))
            pos = close.end() if close is not None else m.end()
            continue
        opened = _opening(text, m.end())
        if opened is not None:
            tokens.append(_Tag(m.start(), opened[0], True, opened[1]))
        pos = opened[0] if opened is not None else m.end()
    return tokens


def _fences(text: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The fenced code blocks of ``text`` (start, end), and the stretches of text between them."""
    blocks: list[tuple[int, int]] = []
    opened: re.Match[str] | None = None
    for m in _FENCE.finditer(text):
        run, rest = m.group(1), m.group(2)
        if opened is None:
            if not (run[0] == "`" and "`" in rest):  # a backtick fence's info string has no backtick
                opened = m
            continue
        first = opened.group(1)
        if run[0] == first[0] and len(run) >= len(first) and not rest.strip():
            blocks.append((opened.start(), m.end()))
            opened = None
    between: list[tuple[int, int]] = []
    pos = 0
    for s, e in blocks:
        between.append((pos, s))
        pos = e
    between.append((pos, len(text)))
    return blocks, between


def _inline_code(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """The inline code spans of the paragraph ``text[start:end]``: a backtick run up to the next run of its length."""
    runs = [(m.start(), m.end()) for m in _BACKTICKS.finditer(text, start, end)]
    by_length: dict[int, deque[int]] = {}
    for i, (s, e) in enumerate(runs):
        by_length.setdefault(e - s, deque()).append(i)
    spans: list[tuple[int, int]] = []
    i = 0
    while i < len(runs):
        same = by_length[runs[i][1] - runs[i][0]]
        while same and same[0] <= i:
            same.popleft()
        if same:
            j = same.popleft()
            spans.append((runs[i][0], runs[j][1]))
            i = j + 1
        else:
            i += 1
    return spans


def _code_regions(text: str) -> list[tuple[int, int, bool]]:
    """The Markdown code of ``text``: (start, end, whether it is an inline span on one line), in order."""
    if "`" not in text and "~~~" not in text:
        return []
    blocks, between = _fences(text)
    regions = [(s, e, False) for s, e in blocks]
    for s, e in between:
        if "`" not in text[s:e]:
            continue
        pos = s
        spans: list[tuple[int, int]] = []
        for m in _PARAGRAPH_BREAK.finditer(text, s, e):
            spans += _inline_code(text, pos, m.start())
            pos = m.end()
        spans += _inline_code(text, pos, e)
        regions += [(a, b, "\n" not in text[a:b]) for a, b in spans]
    return sorted(regions)


def code_spans(text: str) -> list[tuple[int, int]]:
    """The Markdown code of ``text`` (see the module docstring) as (start, end) spans, in order."""
    return [(s, e) for s, e, _ in _code_regions(text)]


def _outside_code(text: str, tokens: list[_Tag]) -> list[_Tag]:
    """``tokens`` without those inside Markdown code (see the module docstring)."""
    regions = _code_regions(text)
    if not regions or not tokens:
        return tokens
    out: list[_Tag] = []
    k = 0
    for s, e, one_line in regions:
        while k < len(tokens) and tokens[k].start < s:
            out.append(tokens[k])
            k += 1
        inside: list[_Tag] = []
        while k < len(tokens) and tokens[k].start < e:
            inside.append(tokens[k])
            k += 1
        depth, paired = 0, True
        for t in inside:
            depth += 1 if t.opening else -1
            paired = paired and depth >= 0
        quoted = one_line and len({t.opening for t in inside}) == 1  # `<document>`: a tag quoted
        if not (paired and depth == 0) and not quoted:  # a tag pairs with one outside: not code
            out += inside
    out += tokens[k:]
    return out


def scan(text: str, tag: str = "document") -> Scan:
    """The ``tag`` blocks of ``text`` (see the module docstring)."""
    stack: list[tuple[int, int, dict[str, str], list[bool]]] = []  # start, body start, attrs, [has a block inside]
    pairs: list[tuple[Block, bool]] = []
    for t in _outside_code(text, _tag_tokens(text, tag)):
        if t.opening:
            stack.append((t.start, t.end, t.attrs, [False]))
        elif stack:
            start, body_start, attrs, nested = stack.pop()
            pairs.append((Block(start, body_start, t.start, t.end, attrs), nested[0]))
            if stack:
                stack[-1][3][0] = True
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
