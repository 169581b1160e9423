"""The line-level structure of a text, the first pass of :func:`rag_opt.text.segment.segment`.

:func:`text_blocks` cuts a text into :class:`TextBlock` spans, one per fenced code block, table (a Markdown pipe
table, or comma, tab or semicolon separated values with a header line), JSON block, Markdown heading, list item or
paragraph, with exact character offsets. Only ``\\n`` separates lines; blank lines attach to the block before them,
and single newlines inside a paragraph (hard-wrapped text) do not end it.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rag_opt.text.json_blocks import json_block_end

__all__ = ["LIST_BULLETS", "TextBlock", "TextBlockKind", "text_blocks"]

# Fenced code: up to 3 spaces of indentation, then ``` or ~~~ (3 or more). A backtick fence's info string
# may not contain a backtick (CommonMark), so inline ```code``` on one line does not open a block.
_FENCE_OPEN = re.compile(r"[ \t]{0,3}(`{3,}|~{3,})(.*)")
_HEADING = re.compile(r"[ \t]{0,3}#{1,6}(?:[ \t]|$)")
LIST_BULLETS = "-*+•◦▪‣"  # the characters that mark an unordered list item
_LIST_ITEM = re.compile(r"[ \t]*(?:[" + re.escape(LIST_BULLETS) + r"]|\d{1,3}[.)]|[A-Za-z]\))[ \t]+\S")
_ORDERED_MARKER = re.compile(r"[ \t]*(?:(\d{1,3})[.)]|([A-Za-z])\))")
_TABLE_SEPARATOR = re.compile(r"[ \t]*\|?[ \t]*:?-+:?[ \t]*(?:\|[ \t]*:?-+:?[ \t]*)*\|?[ \t]*")

TextBlockKind = Literal["code", "table", "json", "heading", "para", "item"]
"""A block's kind: fenced code, a table, a JSON block, a Markdown heading, a paragraph or a list item."""


@dataclass(slots=True)
class TextBlock:
    """A structural block ``text[start:end]`` of the text."""

    start: int  # offset of the block's first character (its first line's start)
    end: int  # exclusive; includes trailing newlines and blank lines that follow the block
    kind: TextBlockKind


def _line_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of every line; ``end`` includes the ``\\n``. Only ``\\n`` separates lines."""
    spans: list[tuple[int, int]] = []
    pos = 0
    n = len(text)
    while pos < n:
        nl = text.find("\n", pos)
        end = n if nl < 0 else nl + 1
        spans.append((pos, end))
        pos = end
    return spans


def _content(text: str, span: tuple[int, int]) -> str:
    """A line without its line terminator."""
    return text[span[0] : span[1]].rstrip("\r\n")


def _is_blank(text: str, span: tuple[int, int]) -> bool:
    return not text[span[0] : span[1]].strip()


def _fence_end(text: str, lines: Sequence[tuple[int, int]], i: int) -> int | None:
    """If line ``i`` opens a fenced code block, the index of its last line (closing fence or end of text)."""
    m = _FENCE_OPEN.fullmatch(_content(text, lines[i]))
    if m is None:
        return None
    fence, info = m.group(1), m.group(2)
    if fence[0] == "`" and "`" in info:
        return None
    closing = re.compile(r"[ \t]{0,3}" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}[ \t]*")
    for j in range(i + 1, len(lines)):
        if closing.fullmatch(_content(text, lines[j])):
            return j
    return len(lines) - 1


def _is_table_separator(line: str) -> bool:
    return "|" in line and "-" in line and _TABLE_SEPARATOR.fullmatch(line) is not None


def _is_table_like(line: str) -> bool:
    return line.lstrip().startswith("|") or " | " in line or _is_table_separator(line)


def _table_run_end(text: str, lines: Sequence[tuple[int, int]], i: int) -> tuple[int, bool]:
    """Index of the last line of the run of table-like lines starting at ``i`` and whether it is a table.

    A run is a table when it has a separator row (``|---|---|``), or when it has at least two lines that all
    start and end with ``|`` (pipe tables exported without a separator row).
    """
    j = i
    has_separator = False
    all_piped = True
    while j < len(lines):
        line = _content(text, lines[j])
        if not line.strip() or not _is_table_like(line):
            break
        stripped = line.strip()
        has_separator = has_separator or _is_table_separator(line)
        all_piped = all_piped and stripped.startswith("|") and stripped.endswith("|") and len(stripped) > 1
        j += 1
    last = j - 1
    n_lines = j - i
    return last, n_lines >= 2 and (has_separator or all_piped)


_CSV_DELIMITERS = (",", "\t", ";")
_CSV_MIN_LINES = 3  # a header and two rows
_CSV_HEADER_FIELD_CHARS = 64
_CSV_HEADER_FIELD_WORDS = 4


def _csv_fields(line: str, delimiter: str) -> list[str]:
    if delimiter not in line:
        return []
    try:
        return next(csv.reader([line], delimiter=delimiter))
    except csv.Error:
        return []


def _csv_header(fields: list[str]) -> bool:
    """Column names: every one present, short, a few words at most (prose with commas is not a header)."""
    return all(
        f.strip() and len(f) <= _CSV_HEADER_FIELD_CHARS and len(f.split()) <= _CSV_HEADER_FIELD_WORDS for f in fields
    )


def _csv_run_end(text: str, lines: Sequence[tuple[int, int]], i: int) -> tuple[int, bool]:
    """Delimiter-separated values from line ``i``: the index of the run's last line and whether it is a table (at
    least three lines, the same number (2 or more) of comma, tab or semicolon separated fields on every line, and a
    header line of column names). Otherwise the index of the last line known not to start such a table."""
    first = _content(text, lines[i])
    last = i
    for delimiter in _CSV_DELIMITERS:
        header = _csv_fields(first, delimiter)
        if len(header) < 2:
            continue
        j = i + 1
        while j < len(lines) and not _is_blank(text, lines[j]):
            if len(_csv_fields(_content(text, lines[j]), delimiter)) != len(header):
                break
            j += 1
        if j - i >= _CSV_MIN_LINES and _csv_header(header):
            return j - 1, True
        last = max(last, j - 1 if j - i >= _CSV_MIN_LINES else i)
    return last, False


def _can_interrupt(line: str) -> bool:
    """Whether a list-item line may interrupt a paragraph (CommonMark: a bullet, or an ordered "1." / "a)").

    A hard-wrapped line that happens to start with "2." or "3)" (e.g. the subscript in "O\n2. Next") continues
    the paragraph instead of starting a list.
    """
    m = _ORDERED_MARKER.match(line)
    if m is None:
        return True
    if m.group(1) is not None:
        return int(m.group(1)) == 1
    return m.group(2) in "aA"


def text_blocks(text: str) -> list[TextBlock]:
    """Split ``text`` into structural blocks; blank lines attach to the preceding block."""
    lines = _line_spans(text)
    blocks: list[TextBlock] = []
    prose_open = False  # whether the last block is a paragraph / list item a following line may continue
    no_table_until = -1  # lines up to this index are known not to start a table (avoids quadratic rescans)
    no_csv_until = -1  # the same for delimiter-separated values
    no_json_before = -1  # lines ending at or before this offset lay inside a failed multi-line JSON parse
    i = 0
    n = len(lines)
    while i < n:
        span = lines[i]
        if _is_blank(text, span):
            if blocks:
                blocks[-1].end = span[1]
            prose_open = False
            i += 1
            continue
        line = _content(text, span)
        last: int | None = None
        kind: TextBlockKind | None = None
        fence_last = _fence_end(text, lines, i)
        if fence_last is not None:
            last, kind = fence_last, "code"
        elif i > no_table_until and _is_table_like(line):
            run_last, is_table = _table_run_end(text, lines, i)
            if is_table:
                last, kind = run_last, "table"
            else:
                no_table_until = run_last
        if kind is None and i > no_csv_until:
            csv_last, is_csv = _csv_run_end(text, lines, i)
            if is_csv:
                last, kind = csv_last, "table"
            else:
                no_csv_until = csv_last
        if kind is None:
            json_last: int | None = None
            if span[1] > no_json_before:
                json_last, failed_at = json_block_end(text, lines, i)
                no_json_before = max(no_json_before, failed_at)
            if json_last is not None:
                last, kind = json_last, "json"
            elif _HEADING.match(line):
                last, kind = i, "heading"
        if kind is not None and last is not None:
            blocks.append(TextBlock(span[0], lines[last][1], kind))
            prose_open = False
            i = last + 1
            continue
        if _LIST_ITEM.match(line) and (not prose_open or blocks[-1].kind == "item" or _can_interrupt(line)):
            blocks.append(TextBlock(span[0], span[1], "item"))
        elif prose_open:
            blocks[-1].end = span[1]
        else:
            blocks.append(TextBlock(span[0], span[1], "para"))
        prose_open = True
        i += 1
    return blocks
