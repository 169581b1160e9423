"""Second-stage features: a unit's relevance read in the light of its neighbours and of the other documents.

The first-stage probe scores each sentence on its own attention and lexical signals. Multi-hop evidence needs
more: the second sentence of a bridge paragraph is relevant *because* its paragraph is the one a relevant
sentence elsewhere names. From the first stage's logits ``z`` (one per unit) and the unit table alone, this
module builds per-unit features (no forward pass, microseconds):

* ``own``: the unit's own logit;
* ``prev`` / ``next``: the logit of the previous / next candidate unit of the same document (the context
  minimum when there is none);
* ``doc_best_other``: the best logit among the *other* units of the same document;
* ``doc_rank``: the document's rank by its best logit (0 = best document), over the number of documents;
* ``gap_to_top``: the unit's logit minus the best logit of the context;
* ``rank_in_doc``: the unit's rank within its document, over its number of candidates;
* ``named_by_other``: the best logit among units of *other* documents that name this document's title
  (a bridge: the paragraph is what a relevant sentence points to); the context minimum when none does;
* ``names_other``: the best document score (best logit) among the other documents whose title this unit
  names; the context minimum when it names none.

A document is named by its title (a title field, metadata, a leading heading line; else its title row) or, without
one, by the subject its text opens with and that subject's other names (``UnitTable.link_names`` and
``link_variants``: :mod:`rag_opt.text.name_variants`), or, opening with no subject, by the first proper name of its
text where that name is salient (``link_spans``: named by at most :data:`SPAN_MAX_DOCS` other document). A titled
document whose text opens with another name ("Carroll County" under the title "Carroll County, New Hampshire") is
also named by that subject and its other names, under the same bound (``link_spans``). A document without any name
takes part in neither feature.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.text.units import UnitTable

__all__ = ["CONTEXT_FEATURES", "DEFAULT_CONTEXT", "context_features", "document_links"]

CONTEXT_FEATURES = (
    "own",
    "prev",
    "next",
    "doc_best_other",
    "doc_rank",
    "gap_to_top",
    "rank_in_doc",
    "named_by_other",
    "names_other",
)

# chosen by forward selection on HotpotQA dev questions 200-400 (benchmarks/ablations/context_ablation.py: a
# feature is kept when supporting-fact recall + answer kept rise by at least 0.01; first stage on 1,750 train
# questions): the title links between documents carry the whole multi-hop gain (+0.05 recall, +0.07 answer kept);
# nothing else helped
DEFAULT_CONTEXT = ("own", "named_by_other")

# an untitled document that opens with no subject is linked by the first proper name of its text only when at most
# this many other documents name it: on 3,000 HotpotQA train questions (benchmarks/ablations/link_coverage.py) such
# links join the two supporting paragraphs 20 % of the time (titles' links: 13 %); with any number of documents, 3 %.
# The same bound holds for a titled document's subject names (new documents beyond those its title links): 19 %
SPAN_MAX_DOCS = 1

_PAREN = re.compile(r"\s*\([^)]*\)\s*$")


@lru_cache(maxsize=4096)
def _title_pattern(title: str) -> re.Pattern[str] | None:
    """A case-insensitive, word-bounded pattern for a title without its trailing "(disambiguation)" part."""
    core = _PAREN.sub("", title).strip()
    if len(core) < 3:
        return None
    return re.compile(r"(?<!\w)" + re.escape(core) + r"(?!\w)", re.IGNORECASE)


@lru_cache(maxsize=4096)
def _variant_pattern(names: tuple[str, ...]) -> re.Pattern[str]:
    """One case-sensitive, word-bounded pattern for a document's other names (proper names: capitalization
    counts), the longest first."""
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return re.compile(r"(?<!\w)(?:" + alternatives + r")(?!\w)")


@lru_cache(maxsize=256)
def _mentions(
    titles: tuple[str, ...],
    texts: tuple[tuple[int, str], ...],
    variants: tuple[tuple[str, ...], ...],
    spans: tuple[tuple[str, ...], ...] = (),
) -> tuple[tuple[int, int], ...]:
    """``(d, i)`` for each candidate ``texts[i]`` (its document, its text) that names document ``d``, ``d`` another
    document: by its title (case-insensitive, :func:`_title_pattern`), by one of its ``variants`` (other names of
    an untitled document, case-sensitive: :mod:`rag_opt.text.name_variants`), or by its salient names (``spans``:
    the opening name of a document that opens with no subject, or a titled document's subject names;
    case-sensitive, and only when they name at most :data:`SPAN_MAX_DOCS` documents that its title and variants do
    not already link). It depends on the documents only, not on the question: remembered per document set (a
    second question over the same documents skips the ``documents × units`` pattern searches)."""
    out: list[tuple[int, int]] = []
    for d, title in enumerate(titles):
        pats = [p for p in [_title_pattern(title) if title else None] if p is not None]
        others = variants[d] if d < len(variants) else ()
        pats += [_variant_pattern(tuple(others))] if others else []
        named = (
            [(d, i) for i, (doc, text) in enumerate(texts) if doc != d and any(p.search(text) for p in pats)]
            if pats
            else []
        )
        out += named
        salient = spans[d] if d < len(spans) else ()
        if not salient:
            continue
        pat = _variant_pattern(tuple(salient))
        seen = {i for _, i in named}
        linked = {texts[i][0] for i in seen}
        hits = [(d, i) for i, (doc, text) in enumerate(texts) if doc != d and i not in seen and pat.search(text)]
        if len({texts[i][0] for _, i in hits} - linked) <= SPAN_MAX_DOCS:  # salient: not a name every document uses
            out += hits
    return tuple(out)


def _titles(units: UnitTable) -> list[str | None]:
    """The name each document is linked by: its title as found when the table was built (a title field, metadata,
    a leading heading line) or, without one, the subject its text opens with (``UnitTable.link_names``); else its
    title row's text (tables built from texts)."""
    names = units.link_names or units.titles
    out: list[str | None] = [t.strip() or None if t else None for t in names] or [None] * units.n_docs
    for r, kind in enumerate(units.kind):
        if kind == "title" and out[int(units.doc[r])] is None:
            out[int(units.doc[r])] = units.texts[r].strip() or None
    return out


def _unit_mentions(units: UnitTable) -> tuple[np.ndarray, tuple[tuple[int, int], ...]]:
    """The candidate rows, and ``(d, i)`` for each candidate row ``rows[i]`` that names document ``d`` (another)."""
    rows_c = np.flatnonzero(units.candidate)
    texts = tuple((int(units.doc[r]), units.texts[r]) for r in rows_c)
    return rows_c, _mentions(tuple(t or "" for t in _titles(units)), texts, units.link_variants, units.link_spans)


def document_links(units: UnitTable) -> set[tuple[int, int]]:
    """``(d, e)`` for each document ``d`` whose name (title, else leading subject) a candidate unit of another
    document ``e`` names: the links ``named_by_other`` reads, per document pair."""
    rows_c, mentions = _unit_mentions(units)
    return {(d, int(units.doc[int(rows_c[i])])) for d, i in mentions}


def context_features(logits: np.ndarray, units: UnitTable, names: Sequence[str] = CONTEXT_FEATURES) -> np.ndarray:
    """Feature matrix (n_units, len(names)) from first-stage ``logits`` (n_units,); non-candidate rows get zeros."""
    unknown = [n for n in names if n not in CONTEXT_FEATURES]
    if unknown:
        raise ValueError(f"unknown context feature(s) {unknown}; known: {list(CONTEXT_FEATURES)}")
    z = np.asarray(logits, dtype=np.float64)
    n = units.n_units
    if z.shape != (n,):
        raise ValueError(f"{z.shape} logits for {n} units")
    cand = units.candidate
    out = np.zeros((n, len(CONTEXT_FEATURES)), dtype=np.float64)
    if not cand.any():
        return out[:, [CONTEXT_FEATURES.index(x) for x in names]].astype(np.float32)
    floor = float(z[cand].min())
    top = float(z[cand].max())
    doc_best = np.full(units.n_docs, floor)
    per_doc: list[np.ndarray] = []
    for d in range(units.n_docs):
        rows = np.asarray([r for r in units.rows(d) if cand[r]], dtype=np.int64)
        per_doc.append(rows)
        if rows.size:
            doc_best[d] = z[rows].max()
    doc_rank = np.empty(units.n_docs)
    doc_rank[np.argsort(-doc_best, kind="stable")] = np.arange(units.n_docs)
    # candidate unit r (of another document) names document d's title
    named_by = np.full(units.n_docs, floor)
    names_other = np.full(n, floor)
    rows_c, mentions = _unit_mentions(units)
    for d, i in mentions:
        r = int(rows_c[i])
        named_by[d] = max(named_by[d], z[r])
        names_other[r] = max(names_other[r], doc_best[d])
    for d, rows in enumerate(per_doc):
        k = rows.size
        if not k:
            continue
        zs = z[rows]
        order = np.argsort(-zs, kind="stable")
        rank = np.empty(k)
        rank[order] = np.arange(k)
        for i, r in enumerate(rows):
            others = np.delete(zs, i)
            out[r] = (
                zs[i],
                zs[i - 1] if i > 0 else floor,
                zs[i + 1] if i + 1 < k else floor,
                others.max() if others.size else floor,
                doc_rank[d] / max(units.n_docs - 1, 1),
                zs[i] - top,
                rank[i] / max(k - 1, 1),
                named_by[d],
                names_other[r],
            )
    return out[:, [CONTEXT_FEATURES.index(x) for x in names]].astype(np.float32)
