"""The unit table: every unit of one context, one row each, built once by the *segment* stage.

A unit is a document's title line, or a segment of its text (a sentence, heading, list item or protected
block), cut at its own grain by :func:`rag_opt.text.structure.unit_pieces` (JSON items, table rows, code lines,
pieces of an overlong sentence). A row holds the unit's document, its character span in that document's text, its
kind, its length in the *target* LLM's tokens, whether it is a scoring candidate (titles, headings and the
brackets, table headers and fences of a cut structured block are not: they are kept along with the units that
need them) and the text the proxy model reads. Rows are in prompt order: document by document, each document's
title row first. A structured block's rows also say which opener (bracket, header, fence) each belongs to, which
closer ends it, and where the comma before an item is, so that what is kept renders as valid JSON, or a table
with its header.

Every later stage reads this table: scorers fill one score per row, selection returns one keep flag per row,
rendering joins the kept spans of each document. All mapping between flat rows and documents lives here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from rag_opt.text.name_variants import name_variants, opening_name, subject_names
from rag_opt.text.titles import DEFAULT_TITLE_KEYS, find_title, leading_subject
from rag_opt.types import Document, UnitKind

__all__ = ["UnitTable", "join_spans", "merge_spans"]


@dataclass(frozen=True, eq=False)
class UnitTable:
    """One row per unit of one context, in prompt order (see the module docstring).

    Columns (arrays of length ``n_units``): ``doc`` (document index), ``start``/``end`` (character span in the
    document's text; ``-1`` for a title row, which is not part of the text), ``kind``, ``tokens`` (target-LLM
    tokens), ``candidate`` and ``texts`` (what the proxy reads). Per document (length ``n_docs``): ``titles``,
    ``title_sources`` (where each title was found: :attr:`rag_opt.text.titles.FoundTitle.label`; empty for tables
    built from texts), ``link_names`` (the name other documents' sentences link to: the title, else the subject the
    text opens with, :func:`rag_opt.text.titles.leading_subject`; empty for tables built from texts),
    ``link_variants`` (other names an untitled document goes by, from its leading subject and first sentence:
    :func:`rag_opt.text.name_variants.name_variants`; empty tuples for titled documents), ``link_spans`` (names that
    link only where salient, see :mod:`rag_opt.compressors.context_features`: for an untitled document that opens
    with no subject, the first proper name of its text, :func:`rag_opt.text.name_variants.opening_name`; for a
    titled document, the subject its text opens with when that is not the title, and its variants,
    :func:`rag_opt.text.name_variants.subject_names`; empty tuples otherwise),
    ``title_tokens`` (0 for a title that is the text's own leading heading line: it is a unit of the text) and
    ``text_tokens`` (the whole text: BPE merges across units make it differ from the sum).
    ``language`` is the ISO 639 code the documents were segmented with (scorers' lexical features follow it).
    Structure (None for tables without any, e.g. :meth:`from_texts`): ``parent`` (the row of the opener a row
    belongs to, -1: none), ``closer`` (an opener's closing row, -1: none) and ``comma`` (the offset of the comma
    before an item, -1: none).
    """

    doc: np.ndarray
    start: np.ndarray
    end: np.ndarray
    kind: tuple[UnitKind, ...]
    tokens: np.ndarray
    candidate: np.ndarray
    texts: tuple[str, ...]
    documents: tuple[Document, ...] = ()
    titles: tuple[str | None, ...] = ()
    title_sources: tuple[str | None, ...] = ()
    link_names: tuple[str | None, ...] = ()
    link_variants: tuple[tuple[str, ...], ...] = ()
    link_spans: tuple[tuple[str, ...], ...] = ()
    title_tokens: np.ndarray | None = None
    text_tokens: np.ndarray | None = None
    language: str = "en"
    parent: np.ndarray | None = None
    closer: np.ndarray | None = None
    comma: np.ndarray | None = None

    # -- building ---------------------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        documents: Sequence[Document],
        count: Callable[[str], int],
        language: str = "en",
        *,
        title_keys: Sequence[str] = DEFAULT_TITLE_KEYS,
        title_from_text: bool = True,
    ) -> UnitTable:
        """Segment ``documents`` and count every unit in the target LLM's tokens (the *segment* stage). Each
        document's title is found by :func:`rag_opt.text.titles.find_title` (``title_keys``, ``title_from_text``):
        a title row first, or, for a leading heading line, that line as a ``heading`` unit of the text."""
        from rag_opt.text.segment import Segment, segment
        from rag_opt.text.structure import unit_pieces

        doc: list[int] = []
        start: list[int] = []
        end: list[int] = []
        kind: list[UnitKind] = []
        tokens: list[int] = []
        texts: list[str] = []
        candidate: list[bool] = []
        parent: list[int] = []
        closer: list[int] = []
        comma: list[int] = []
        titles: list[str | None] = []
        sources: list[str | None] = []
        links: list[str | None] = []
        variants: list[tuple[str, ...]] = []
        spans: list[tuple[str, ...]] = []
        title_tokens: list[int] = []
        text_tokens: list[int] = []
        for d, document in enumerate(documents):
            found = find_title(document, title_keys, from_text=title_from_text)
            titles.append(found.title if found is not None else None)
            sources.append(found.label if found is not None else None)
            subject = None if found is not None else leading_subject(document.text)
            links.append(found.title if found is not None else subject)
            variants.append(name_variants(subject, document.text) if subject else ())
            if found is not None:  # a titled document: also the subject its text opens with, where salient
                body = document.text[found.span[1] :] if found.span is not None else document.text
                spans.append(subject_names(found.title, body))
            else:
                span = opening_name(document.text) if subject is None else None
                spans.append((span,) if span else ())
            in_text = found is not None and found.span is not None
            title = None if found is None or in_text else found.title
            title_tokens.append(count(f"{title}\n") if title else 0)
            text_tokens.append(count(document.text))
            if title:
                doc.append(d)
                start.append(-1)
                end.append(-1)
                kind.append("title")
                tokens.append(title_tokens[-1])
                texts.append(f"{title}\n")
                candidate.append(False)
                parent.append(-1)
                closer.append(-1)
                comma.append(-1)
            text = document.text
            segments = segment(text, language)
            if found is not None and found.span is not None:  # the leading heading line: a unit of its own
                cut = found.span[1]
                rest = [Segment(g.start + cut, g.end + cut, g.kind) for g in segment(text[cut:], language)]
                segments = [Segment(0, cut, "heading"), *rest]
            for seg in segments:
                base = len(doc)  # the pieces' parent and closer are indices into their own list
                for p in unit_pieces(text, seg):
                    doc.append(d)
                    start.append(p.start)
                    end.append(p.end)
                    kind.append(p.kind)
                    tokens.append(count(text[p.start : p.end]))
                    texts.append(text[p.start : p.read_end if p.read_end >= 0 else p.end])
                    candidate.append(p.candidate and p.kind != "heading")
                    parent.append(base + p.parent if p.parent >= 0 else -1)
                    closer.append(base + p.closer if p.closer >= 0 else -1)
                    comma.append(p.comma)
        return cls(
            doc=np.asarray(doc, dtype=np.int64),
            start=np.asarray(start, dtype=np.int64),
            end=np.asarray(end, dtype=np.int64),
            kind=tuple(kind),
            tokens=np.asarray(tokens, dtype=np.int64),
            candidate=np.asarray(candidate, dtype=bool),
            texts=tuple(texts),
            documents=tuple(documents),
            titles=tuple(titles),
            title_sources=tuple(sources),
            link_names=tuple(links),
            link_variants=tuple(variants),
            link_spans=tuple(spans),
            title_tokens=np.asarray(title_tokens, dtype=np.int64),
            text_tokens=np.asarray(text_tokens, dtype=np.int64),
            language=language,
            parent=np.asarray(parent, dtype=np.int64),
            closer=np.asarray(closer, dtype=np.int64),
            comma=np.asarray(comma, dtype=np.int64),
        )

    @classmethod
    def from_spans(
        cls, documents: Sequence[Document], spans: Sequence[Sequence[tuple[int, int]]], count: Callable[[str], int]
    ) -> UnitTable:
        """A table over a segmentation given as character spans per document (e.g. a dataset's own sentences),
        instead of :meth:`build`'s. Every span becomes a ``sentence`` row; titles as in :meth:`build`."""
        if len(spans) != len(documents):
            raise ValueError(f"{len(spans)} span lists for {len(documents)} documents")
        titles = tuple(_title_of(d) for d in documents)
        rows: list[tuple[int, int, int, UnitKind, str]] = []
        for d, (document, doc_spans) in enumerate(zip(documents, spans, strict=True)):
            if titles[d]:
                rows.append((d, -1, -1, "title", f"{titles[d]}\n"))
            rows.extend((d, a, b, "sentence", document.text[a:b]) for a, b in doc_spans)
        return cls(
            doc=np.asarray([r[0] for r in rows], dtype=np.int64),
            start=np.asarray([r[1] for r in rows], dtype=np.int64),
            end=np.asarray([r[2] for r in rows], dtype=np.int64),
            kind=tuple(r[3] for r in rows),
            tokens=np.asarray([count(r[4]) for r in rows], dtype=np.int64),
            candidate=np.asarray([r[3] != "title" for r in rows], dtype=bool),
            texts=tuple(r[4] for r in rows),
            documents=tuple(documents),
            titles=titles,
            title_tokens=np.asarray([count(f"{t}\n") if t else 0 for t in titles], dtype=np.int64),
            text_tokens=np.asarray([count(d.text) for d in documents], dtype=np.int64),
        )

    @classmethod
    def from_texts(cls, docs: Sequence[Sequence[str]], candidate: Sequence[Sequence[bool]]) -> UnitTable:
        """A table of units given as strings (training and benchmark data): no offsets or token counts.

        Non-candidate units are taken as title lines.
        """
        if len(docs) != len(candidate) or any(len(a) != len(b) for a, b in zip(docs, candidate, strict=True)):
            raise ValueError("docs and candidate must have the same shape")
        flat_c = [bool(c) for cs in candidate for c in cs]
        n = len(flat_c)
        return cls(
            doc=np.asarray([d for d, units in enumerate(docs) for _ in units], dtype=np.int64),
            start=np.full(n, -1, dtype=np.int64),
            end=np.full(n, -1, dtype=np.int64),
            kind=tuple("sentence" if c else "title" for c in flat_c),
            tokens=np.zeros(n, dtype=np.int64),
            candidate=np.asarray(flat_c, dtype=bool),
            texts=tuple(u for units in docs for u in units),
            titles=(None,) * len(docs),
        )

    @classmethod
    def titled(cls, docs: Sequence[Sequence[str]]) -> UnitTable:
        """:meth:`from_texts` for documents whose first unit is a title line (``[title + "\\n", sentence, ...]``)."""
        return cls.from_texts(docs, [[False] + [True] * (len(d) - 1) for d in docs])

    # -- shape --------------------------------------------------------------------------------------------
    @property
    def n_units(self) -> int:
        return len(self.texts)

    @property
    def n_docs(self) -> int:
        return len(self.titles)

    @property
    def bounds(self) -> np.ndarray:
        """Row offsets per document: document ``d`` owns rows ``bounds[d]:bounds[d + 1]``."""
        counts = np.bincount(self.doc, minlength=self.n_docs) if self.n_units else np.zeros(self.n_docs, np.int64)
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def rows(self, d: int) -> range:
        """The rows of document ``d``."""
        b = self.bounds
        return range(int(b[d]), int(b[d + 1]))

    def by_document(self) -> list[list[str]]:
        """Unit texts grouped by document, in prompt order (what the proxy model reads)."""
        b = self.bounds
        return [list(self.texts[b[d] : b[d + 1]]) for d in range(self.n_docs)]

    def document_texts(self) -> list[str]:
        """Each document as the proxy reads it: its units concatenated (the title line included)."""
        return ["".join(units) for units in self.by_document()]

    def split(self, values: np.ndarray) -> list[np.ndarray]:
        """A per-row array cut into one array per document."""
        b = self.bounds
        return [values[b[d] : b[d + 1]] for d in range(self.n_docs)]

    def doc_best(self, values: np.ndarray) -> np.ndarray:
        """Per document, the best value among its candidate rows (0 when it has none)."""
        best = np.full(self.n_docs, -np.inf)
        rows = np.flatnonzero(self.candidate)
        np.maximum.at(best, self.doc[rows], np.asarray(values, dtype=np.float64)[rows])
        best[~np.isfinite(best)] = 0.0
        return best

    @property
    def tokens_before(self) -> int:
        """Target-LLM tokens of the whole input (titles included)."""
        if self.title_tokens is None or self.text_tokens is None:
            raise ValueError("this unit table was built from texts: it has no token counts")
        return int(self.title_tokens.sum() + self.text_tokens.sum())

    def enclosing(self, r: int) -> tuple[int, ...]:
        """The structure rows row ``r`` needs kept with it: the opener and closer of every structure (JSON
        container, table header, code fence) around it, innermost first; ``()`` outside any."""
        if self.parent is None or self.closer is None:
            return ()
        out: list[int] = []
        p = int(self.parent[r])
        while p >= 0:
            out.append(p)
            c = int(self.closer[p])
            if c >= 0 and c != r:
                out.append(c)
            p = int(self.parent[p])
        return tuple(out)

    # -- rendering ----------------------------------------------------------------------------------------
    def kept_spans(self, d: int, keep: np.ndarray) -> list[tuple[int, int]]:
        """Character spans of document ``d``'s text kept by the per-row ``keep`` mask (adjacent ones merged). The
        comma before a kept item is left out when no item before it in its container is kept (a JSON array or
        object whose first items were dropped), so kept JSON stays valid. Unless the whole text is kept, the last
        span ends at its last non-space character: a unit carries the whitespace after it, which separates it from
        a later kept unit but would otherwise be left trailing at the end of the kept text."""
        spans: list[tuple[int, int]] = []
        opened: set[int] = set()  # containers (their opener rows) with a kept item so far
        text = self.documents[d].text if self.documents else ""
        whole = True
        for r in self.rows(d):
            if self.start[r] < 0:
                continue
            if not keep[r]:
                whole = False
                continue
            s, e = int(self.start[r]), int(self.end[r])
            p = int(self.parent[r]) if self.parent is not None else -1
            c = int(self.comma[r]) if self.comma is not None else -1
            if c >= 0 and p not in opened:  # the comma goes, with the whitespace after it (the opener has its own)
                after = c + 1
                while after < e and text[after].isspace():
                    after += 1
                spans.extend(span for span in ((s, c), (after, e)) if span[0] < span[1])
            else:
                spans.append((s, e))
            if p >= 0:
                opened.add(p)
        spans = merge_spans(spans)
        if spans and not whole and text:
            s, e = spans[-1]
            while e > s and text[e - 1].isspace():
                e -= 1
            spans[-1:] = [(s, e)] if e > s else []
        return spans

    def title_in_text(self, d: int) -> bool:
        """Whether document ``d``'s title is its text's leading heading line (not a title row of its own)."""
        return bool(self.title_sources) and self.title_sources[d] == "text"

    def render(self, d: int, keep: np.ndarray) -> str:
        """Document ``d``'s kept text: kept units verbatim, in order (see :func:`join_spans`)."""
        return join_spans(self.documents[d].text, self.kept_spans(d, keep))


def _title_of(doc: Document) -> str | None:
    """A title row's title for tables built from given spans: the ``title`` field or metadata (no heading lines:
    the spans are the caller's)."""
    found = find_title(doc, from_text=False)
    return found.title if found is not None else None


def join_spans(text: str, spans: Sequence[tuple[int, int]]) -> str:
    """Join non-adjacent spans of ``text``, inserting one space only where a cut would glue two words
    (e.g. "Inc." + "He ..."; not before a comma, which starts a JSON item)."""
    parts: list[str] = []
    for s, e in spans:
        piece = text[s:e]
        if parts and not parts[-1][-1:].isspace() and not piece[:1].isspace() and piece[:1] != ",":
            parts.append(" ")
        parts.append(piece)
    return "".join(parts)


def merge_spans(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge spans that touch (``end == next start``)."""
    out: list[tuple[int, int]] = []
    for s, e in spans:
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out
