"""Units at their own grain: structured blocks cut into items and rows, overlong units cut at a length limit.

:func:`unit_pieces` turns one :class:`~rag_opt.text.segment.Segment` into the units of the unit table
(:class:`~rag_opt.text.units.UnitTable`), a contiguous partition of the segment:

* a JSON block larger than :data:`SPLIT_STRUCTURED_BYTES` becomes its array items and object members, each a
  candidate unit, plus the pieces of the brackets around them (an *opener*: the opening bracket, or the key and
  bracket of a nested member, and a *closer*: the closing bracket). An item is cut further, into its own items,
  when it is larger than :data:`MAX_UNIT_BYTES` (or when it is the only item of its container). Selection keeps
  an item with the openers and closers of every container around it, and rendering leaves out the comma a kept
  item no longer needs, so the kept text stays valid JSON;
* a table (a Markdown pipe table, or comma/tab/semicolon-separated values) larger than
  :data:`SPLIT_STRUCTURED_BYTES` becomes its rows, each kept with the header (the lines up to its separator row,
  else the first line);
* a fenced code block larger than :data:`MAX_UNIT_BYTES` becomes chunks of whole lines, kept with its fences;
* a sentence (or list item, or heading line) larger than :data:`MAX_UNIT_BYTES` is cut into pieces no larger,
  after the last whitespace that leaves the piece at least half full (else at the limit).

The limit is in UTF-8 bytes, so the units do not depend on the target tokenizer (cached encodings and
``rag-opt index`` see the same units for every target): a unit of at most :data:`MAX_UNIT_BYTES` bytes is at most
as many tokens of any byte-level tokenizer (the proxy model's included), about 250 tokens of English. A unit that
cannot be cut (one JSON string, one table row or code line larger than the limit) stays whole; the proxy model
reads only its first :data:`MAX_UNIT_BYTES` bytes, so no unit makes a forward pass longer than the limit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from rag_opt.text.json_tree import JsonItem, JsonNode, json_tree

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.text.segment import Segment, SegmentKind

__all__ = ["MAX_UNIT_BYTES", "SPLIT_STRUCTURED_BYTES", "Piece", "split_points", "unit_pieces"]

MAX_UNIT_BYTES = 1024
"""The longest a unit that can be cut may be, in UTF-8 bytes (about 250 tokens of English)."""
SPLIT_STRUCTURED_BYTES = 256
"""JSON and tables larger than this (about 60 tokens) are cut into items and rows; smaller ones stay one unit."""
MAX_DEPTH = 32  # JSON containers nested deeper than this are not cut further

_FENCE = re.compile(r"[ \t]{0,3}(?:`{3,}|~{3,})[ \t]*\r?\n?")
_TABLE_SEPARATOR_LINE = re.compile(r"[ \t]*\|?[ \t]*:?-+:?[ \t]*(?:\|[ \t]*:?-+:?[ \t]*)*\|?[ \t]*\r?\n?")


@dataclass(frozen=True, slots=True)
class Piece:
    """One unit of a segment: ``text[start:end]``. ``parent``: the index (in the same list) of the opener of the
    structure it belongs to (-1: none); ``closer``: for an opener, the index of its closing piece (-1: none);
    ``comma``: the offset of the comma that separates it from the item before (-1: none); ``read_end``: where the
    text the proxy model reads ends (``end`` unless the unit is longer than the limit and cannot be cut)."""

    start: int
    end: int
    kind: SegmentKind
    candidate: bool = True
    parent: int = -1
    closer: int = -1
    comma: int = -1
    read_end: int = -1


def unit_pieces(text: str, seg: Segment) -> list[Piece]:
    """The units of segment ``seg`` of ``text`` (see the module docstring), in order, covering it exactly."""
    s, e, kind = seg.start, seg.end, seg.kind
    if kind == "json" and _over(text, s, e, SPLIT_STRUCTURED_BYTES):
        pieces = _json_pieces(text, s, e)
    elif kind == "table" and _over(text, s, e, SPLIT_STRUCTURED_BYTES):
        pieces = _table_pieces(text, s, e)
    elif kind == "code" and _over(text, s, e, MAX_UNIT_BYTES):
        pieces = _code_pieces(text, s, e)
    elif kind in ("sentence", "list_item", "heading") and _over(text, s, e, MAX_UNIT_BYTES):
        first: SegmentKind = "list_item" if kind == "list_item" else "sentence"  # a heading that long is prose
        bounds = [s, *split_points(text, s, e), e]
        return [
            Piece(a, b, first if k == 0 else "sentence")
            for k, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))
        ]
    else:
        pieces = None
    return [_whole(text, s, e, kind)] if pieces is None else pieces


def split_points(text: str, start: int, end: int, limit: int = MAX_UNIT_BYTES) -> list[int]:
    """Where to cut ``text[start:end]`` into pieces of at most ``limit`` UTF-8 bytes: after the last whitespace that
    leaves a piece at least half full, else at the limit. Every piece but the first starts with a non-whitespace
    character when the cut is at whitespace. Linear in the length."""
    cuts: list[int] = []
    pos = start
    while _over(text, pos, end, limit):
        hard = pos + _prefix_chars(text, pos, end, limit)
        cut = hard
        floor = pos + (hard - pos) // 2
        for i in range(hard, floor, -1):
            if text[i - 1].isspace() and not text[i].isspace():
                cut = i
                break
        cuts.append(cut)
        pos = cut
    return cuts


# -- lengths ---------------------------------------------------------------------------------------------------
def _utf8_len(ch: str) -> int:
    o = ord(ch)
    return 1 if o < 0x80 else 2 if o < 0x800 else 3 if o < 0x10000 else 4


def _over(text: str, start: int, end: int, limit: int) -> bool:
    """Whether ``text[start:end]`` is longer than ``limit`` UTF-8 bytes (a character is 1 to 4 bytes)."""
    n = end - start
    if n > limit:
        return True
    if 4 * n <= limit:
        return False
    # a lone surrogate is 3 bytes, as _utf8_len counts it ("surrogatepass" encodes it so instead of failing)
    return len(text[start:end].encode("utf-8", "surrogatepass")) > limit


def _prefix_chars(text: str, pos: int, end: int, limit: int) -> int:
    """How many characters from ``pos`` fit in ``limit`` UTF-8 bytes (at least one)."""
    used = n = 0
    for ch in text[pos : min(end, pos + limit)]:
        used += _utf8_len(ch)
        if used > limit:
            break
        n += 1
    return max(n, 1)


def _read_end(text: str, start: int, end: int) -> int:
    """The end of what the proxy reads of an uncut unit: all of it, or its first :data:`MAX_UNIT_BYTES` bytes."""
    return start + _prefix_chars(text, start, end, MAX_UNIT_BYTES) if _over(text, start, end, MAX_UNIT_BYTES) else end


def _whole(text: str, start: int, end: int, kind: SegmentKind, **kw: int | bool) -> Piece:
    return Piece(start, end, kind, read_end=_read_end(text, start, end), **kw)  # type: ignore[arg-type]


def _lines(text: str, start: int, end: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    pos = start
    while pos < end:
        nl = text.find("\n", pos, end)
        stop = end if nl < 0 else nl + 1
        out.append((pos, stop))
        pos = stop
    return out


def _with_blank_lines(text: str, lines: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Blank lines joined to the line before them (the first line keeps those after it)."""
    out: list[tuple[int, int]] = []
    for a, b in lines:
        if out and not text[a:b].strip():
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


# -- tables and code -------------------------------------------------------------------------------------------
def _table_pieces(text: str, start: int, end: int) -> list[Piece] | None:
    """A header piece (the lines up to the separator row, when there is one among the first three lines; else the
    first line) and one candidate piece per row."""
    lines = _with_blank_lines(text, _lines(text, start, end))
    head = 0
    for k, (a, b) in enumerate(lines[:3]):
        if "-" in text[a:b] and _TABLE_SEPARATOR_LINE.fullmatch(text, a, b):
            head = k
            break
    if len(lines) <= head + 1:
        return None
    header = _whole(text, lines[0][0], lines[head][1], "table", candidate=False)
    return [header, *(_whole(text, a, b, "table", parent=0) for a, b in lines[head + 1 :])]


def _code_pieces(text: str, start: int, end: int) -> list[Piece] | None:
    """The opening fence, chunks of whole lines of at most :data:`MAX_UNIT_BYTES` bytes, and the closing fence."""
    lines = _with_blank_lines(text, _lines(text, start, end))
    closing = len(lines) >= 2 and _FENCE.fullmatch(text, *_trimmed(text, lines[-1])) is not None
    inner = lines[1 : -1 if closing else None]
    if not inner:
        return None
    chunks: list[tuple[int, int]] = []
    for a, b in inner:
        if chunks and not _over(text, chunks[-1][0], b, MAX_UNIT_BYTES):
            chunks[-1] = (chunks[-1][0], b)
        else:
            chunks.append((a, b))
    out = [_whole(text, *lines[0], "code", candidate=False)]
    out += [_whole(text, a, b, "code", parent=0) for a, b in chunks]
    if closing:
        out[0] = replace(out[0], closer=len(out))
        out.append(_whole(text, *lines[-1], "code", candidate=False, parent=0))
    return out


def _trimmed(text: str, span: tuple[int, int]) -> tuple[int, int]:
    """A line without its trailing whitespace and blank lines (for matching a fence)."""
    a, b = span
    while b > a and text[b - 1].isspace():
        b -= 1
    return a, b


# -- JSON ------------------------------------------------------------------------------------------------------
def _json_pieces(text: str, start: int, end: int) -> list[Piece] | None:
    """Openers, items and closers of the JSON value in ``text[start:end]`` (see the module docstring)."""
    try:
        root = json_tree(text, start)
    except ValueError:  # pragma: no cover - the segmentation checked it is JSON
        return None
    if not root.items:
        return None
    out: list[Piece] = []
    _container(text, root, start, end, -1, -1, out, 0)
    return out


def _container(
    text: str, node: JsonNode, start: int, end: int, comma: int, parent: int, out: list[Piece], depth: int
) -> None:
    """Append the opener ``text[start:first item)``, the items and the closer ``text[last item end:end]`` of the
    container ``node``."""
    opener = len(out)
    out.append(_whole(text, start, node.items[0].start, "json", candidate=False, parent=parent, comma=comma))
    only = len(node.items) == 1
    prev_end = -1
    for item in node.items:
        a = item.start if prev_end < 0 else prev_end
        b = item.value.end
        if _splits(text, item, a, b, only, depth):
            _container(text, item.value, a, b, item.comma, opener, out, depth + 1)
        else:
            out.append(_whole(text, a, b, "json", parent=opener, comma=item.comma))
        prev_end = b
    out[opener] = replace(out[opener], closer=len(out))
    out.append(_whole(text, prev_end, end, "json", candidate=False, parent=opener))


def _splits(text: str, item: JsonItem, a: int, b: int, only: bool, depth: int) -> bool:
    """Whether an item is cut into its own items: a container with items, not too deep, larger than the limit or
    the only item of its container."""
    value = item.value
    return bool(value.items) and depth + 1 < MAX_DEPTH and (only or _over(text, a, b, MAX_UNIT_BYTES))
