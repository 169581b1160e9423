"""Sentence segmentation with exact character offsets.

:func:`segment` partitions a text into contiguous, non-empty :class:`Segment` spans (sentences, headings, list
items and *protected* units: fenced code, tables (Markdown pipe tables, and comma, tab or semicolon separated
values with a header line) and JSON blocks). Joining the spans rebuilds the input byte for byte, so a compressor
can drop segments and keep exact offsets into the original document.

Prose is split by the offline ``sentencex`` library; this module adds the structure it does not know about (the
line-level blocks come from :mod:`rag_opt.text.blocks`):

* protected units are detected first and are never split into sentences (the unit table cuts large ones at
  their own grain, into JSON items, table rows and code lines: :mod:`rag_opt.text.structure`);
* blank lines are paragraph breaks, Markdown headings are their own segment, list items start a new segment;
* single newlines inside a paragraph (hard-wrapped text) are not boundaries on their own;
* whitespace between two segments belongs to the end of the preceding one, so every segment but the first
  starts with a non-whitespace character.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Segment", "SegmentKind", "segment"]

from rag_opt.text.blocks import LIST_BULLETS, TextBlockKind, text_blocks

logger = logging.getLogger(__name__)

SegmentKind = Literal["sentence", "heading", "list_item", "code", "table", "json"]

_PROTECTED_KINDS: frozenset[str] = frozenset({"code", "table", "json"})


@dataclass(frozen=True, slots=True)
class Segment:
    """A span ``text[start:end]`` of the segmented text."""

    start: int
    """Character offset into the original text (inclusive)."""
    end: int
    """Character offset into the original text (exclusive)."""
    kind: SegmentKind

    @property
    def protected(self) -> bool:
        """True for code, tables and JSON: never split into sentences (see :mod:`rag_opt.text.structure`)."""
        return self.kind in _PROTECTED_KINDS


# ----------------------------------------------------------------------------------------------------
# Prose splitting
# ----------------------------------------------------------------------------------------------------

# A prose piece that is nothing but a list marker ("1. ", "- ", "a) ", "(iv)") is never a segment of its own.
_BARE_MARKER = re.compile(
    r"\(?(?:[" + re.escape(LIST_BULLETS) + r"]|\d{1,3}[.)]?|[A-Za-z][.)]|[ivxlcdmIVXLCDM]{1,6}[.)])\)?"
)
_WORD_CHAR = re.compile(r"\w")

# Characters that end a sentence, and closers that may follow them (quotes, brackets, emphasis markers).
_TERMINALS = frozenset(".!?…。！？｡؟۔।॥‼⁇⁈⁉")
_EXCLAMATIONS = frozenset("!?‼⁇⁈⁉")  # the terminals after which cased text may go on in lower case
_CLOSERS = frozenset("\"'”’»)]}*_`」』）】〕〉》")

# What sentencex sees of a prose block: every whitespace character but the space and the tab becomes one
# space (character offsets do not change). Line breaks inside a paragraph are hard wraps, not boundaries, and
# sentencex would otherwise guess list items at line starts ("O\n2. Next"); multi-byte spaces make sentencex
# 1.0.32 panic on some inputs ("A\u00a0.").
_SENTENCEX_SPACES = str.maketrans({c: " " for c in map(chr, range(0x3001)) if c.isspace() and c not in " \t"})


def _sentencex_cuts(block: str, language: str) -> list[int] | None:
    """Sentence start offsets (but 0) inside ``block`` from sentencex; None if it failed or disagreed."""
    block = block.translate(_SENTENCEX_SPACES)
    try:
        import sentencex

        boundaries: Any = sentencex.get_sentence_boundaries(language, block)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # a Rust panic (pyo3 PanicException) is a BaseException
        logger.warning("sentencex failed on a %d-character block (%s); kept it as one segment", len(block), exc)
        return None
    cuts: list[int] = []
    previous_end = 0
    try:
        for b in boundaries:
            s, e = int(b["start_index"]), int(b["end_index"])
            piece = b.get("text")
            if not (previous_end <= s <= e <= len(block)) or (piece is not None and piece != block[s:e]):
                raise ValueError(f"inconsistent boundary {s}:{e} after {previous_end}")
            if 0 < s < len(block) and (not cuts or s > cuts[-1]):
                cuts.append(s)
            if 0 < e < len(block) and (not cuts or e > cuts[-1]):
                cuts.append(e)
            previous_end = e
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        logger.warning(
            "sentencex returned inconsistent offsets for a %d-character block (%s); kept it as one segment",
            len(block),
            exc,
        )
        return None
    return cuts


def _skip_space(text: str, pos: int, end: int) -> int:
    while pos < end and text[pos].isspace():
        pos += 1
    return pos


def _mark_before(text: str, start: int, cut: int) -> str:
    """The last character before ``cut`` once whitespace and closers are passed ("" when none is left)."""
    j = cut - 1
    while j >= start and text[j].isspace():
        j -= 1
    while j >= start and text[j] in _CLOSERS:
        j -= 1
    return text[j] if j >= start else ""


def _ends_sentence(text: str, start: int, cut: int) -> bool:
    """Whether the non-whitespace text before ``cut`` ends with sentence-final punctuation."""
    mark = _mark_before(text, start, cut)
    return bool(mark) and mark in _TERMINALS


def _continues_after_exclamation(text: str, start: int, cut: int) -> bool:
    """Whether the cut at ``cut`` follows ``!`` or ``?`` (closing quotes or brackets aside) and the text goes on in
    lower case: a name or title with the mark inside it ("Panic! at the Disco", "American Dad! is"), or quoted speech
    ("Stop!" she said), not a new sentence."""
    mark = _mark_before(text, start, cut)
    return bool(mark) and mark in _EXCLAMATIONS and text[cut].islower()


def _prose_cuts(text: str, start: int, end: int, language: str) -> list[int]:
    """Absolute start offsets of the sentences after the first in the prose block ``text[start:end]``."""
    content_end = start + len(text[start:end].rstrip())
    if content_end <= start:
        return []
    block = text[start:content_end]
    raw = _sentencex_cuts(block, language)
    if not raw:
        return []
    cuts: list[int] = []
    for rel in raw:
        cut = _skip_space(text, start + rel, content_end)
        if cut >= content_end or cut <= start or (cuts and cut <= cuts[-1]):
            continue
        gap_start = cut
        while gap_start > start and text[gap_start - 1].isspace():
            gap_start -= 1
        # A single newline is not a sentence boundary by itself (hard-wrapped text).
        if "\n" in text[gap_start:cut] and not _ends_sentence(text, start, cut):
            continue
        # Never inside a word: a cut right after a period with a letter or digit on both sides and no space is an
        # initialism or a dotted name ("Super Junior-K.R.Y.", "U.S.A.", "v1.2"), not a sentence end.
        if _inside_word(text, start, cut):
            continue
        # Only where the writer uses capitals: in text written all in lower case a sentence may start in lower case.
        if _continues_after_exclamation(text, start, cut) and any(ch.isupper() for ch in block):
            continue
        cuts.append(cut)
    return _merge_fragments(text, start, content_end, cuts)


def _inside_word(text: str, start: int, cut: int) -> bool:
    """Whether ``cut`` falls between a period and a letter or digit, with a letter or digit before the period and no
    space anywhere (``K.|R.Y.``)."""
    return cut - 2 >= start and text[cut - 1] == "." and text[cut].isalnum() and text[cut - 2].isalnum()


def _merge_fragments(text: str, start: int, end: int, cuts: list[int]) -> list[int]:
    """Drop cuts that would leave a bare list marker or a piece without any word character on its own."""
    bounds = [start, *cuts, end]
    keep = [True] * len(cuts)  # keep[k] is for bounds[k + 1]
    for k in range(len(bounds) - 1):
        piece = text[bounds[k] : bounds[k + 1]].strip()
        if _BARE_MARKER.fullmatch(piece):
            if k < len(cuts):
                keep[k] = False  # merge forward
            elif k > 0:
                keep[k - 1] = False  # last piece: merge backward
        elif not _WORD_CHAR.search(piece) and k > 0:
            keep[k - 1] = False  # punctuation / emoji only: merge backward
    return [c for c, flag in zip(cuts, keep, strict=True) if flag]


# ----------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------


def segment(text: str, language: str = "en") -> list[Segment]:
    """Partition ``text`` into sentence / structural segments with exact character offsets.

    The result is a contiguous partition: the first segment starts at 0, each starts where the previous
    one ends, the last ends at ``len(text)``, and no segment is empty or whitespace-only (unless the whole
    text is). ``"".join(text[s.start:s.end] for s in segment(text)) == text`` always holds; empty text
    gives ``[]``.

    ``language`` is an ISO 639 code passed to ``sentencex`` (unknown codes fall back to its defaults).

    A document seen recently is not segmented again (:data:`SEGMENT_MEMO` texts of at most
    :data:`SEGMENT_MEMO_CHARS` characters are remembered): a retrieved document comes back with other questions, and
    its segmentation depends on nothing but its text and language.
    """
    if not text:
        return []
    if len(text) <= SEGMENT_MEMO_CHARS:
        return list(_segment_memo(text, language))
    return _segment(text, language)


SEGMENT_MEMO = 4096  # documents whose segmentation is remembered
SEGMENT_MEMO_CHARS = 8192  # only texts this short (the memo holds at most ~32 MiB of text)


@functools.lru_cache(maxsize=SEGMENT_MEMO)
def _segment_memo(text: str, language: str) -> tuple[Segment, ...]:
    return tuple(_segment(text, language))


# The blocks that are one segment each, whole (code, tables, JSON, headings)
_WHOLE_BLOCK_KINDS: dict[TextBlockKind, SegmentKind] = {
    "code": "code",
    "table": "table",
    "json": "json",
    "heading": "heading",
}


def _segment(text: str, language: str) -> list[Segment]:
    starts: list[tuple[int, SegmentKind]] = []
    for block in text_blocks(text):
        whole = _WHOLE_BLOCK_KINDS.get(block.kind)
        if whole is not None:
            starts.append((block.start, whole))
            continue
        first: SegmentKind = "list_item" if block.kind == "item" else "sentence"
        starts.append((block.start, first))
        starts.extend((cut, "sentence") for cut in _prose_cuts(text, block.start, block.end, language))
    return _normalize(text, starts)


def _normalize(text: str, starts: list[tuple[int, SegmentKind]]) -> list[Segment]:
    """Turn start offsets into a partition whose segments (but the first) start with non-whitespace."""
    n = len(text)
    if not starts:
        return [Segment(0, n, "sentence")]
    fixed: list[tuple[int, SegmentKind]] = [(0, starts[0][1])]
    for idx in range(1, len(starts)):
        pos, kind = starts[idx]
        limit = starts[idx + 1][0] if idx + 1 < len(starts) else n
        pos = _skip_space(text, max(pos, fixed[-1][0] + 1), limit)
        if pos >= limit or pos <= fixed[-1][0]:
            continue  # whitespace-only (or empty) piece: its characters stay with the preceding segment
        fixed.append((pos, kind))
    segments = [Segment(pos, fixed[k + 1][0] if k + 1 < len(fixed) else n, kind) for k, (pos, kind) in enumerate(fixed)]
    return segments
