"""Choosing units under a token budget (the *select* stage): scores in, a keep-mask out.

Pure logic over the unit table and its scores, independent of how scores were made, so every scorer (probe,
raw attention, BM25, embeddings, random, lead) is compared under exactly the same selection rule.

Rule: candidate units are taken best score first (ties: earlier first); a unit whose cost does not fit is skipped
and the next ones are tried, so the budget is filled as fully as possible without exceeding it (but see below). The
cost of a unit includes the header rows it needs (its document's title, the nearest heading before it, and the
openers and closers of the structured block around it: JSON brackets, a table's header, code fences) the first time
one of them is needed. Headers are never kept on their own. An English sentence that leans on the sentence before it
(it opens with a pronoun, "It has many museums.", or refers back through a demonstrative or definite phrase, "more
water than that", "The treatment works ...": :mod:`rag_opt.text.references`) needs that sentence the same way
(``keep_antecedents``, ``keep_references``), so no kept sentence dangles. Protected blocks are ordinary units, cut
at their own grain when large (:mod:`rag_opt.text.structure`). Because BPE merges across unit boundaries can change
counts, the kept text of each document is then rendered and counted, and the lowest-scoring kept unit is dropped
until the rendered documents fit (only the document that changed is counted again). Unit counts overestimate what a
unit adds to rendered text (a sentence's trailing space merges into the next sentence's first token, and the kept
text does not end in one: :meth:`~rag_opt.text.units.UnitTable.kept_spans`), so the rendered documents usually end
a little under the budget: a last *fill* pass tries the remaining units, best first, whose
counted cost fits the slack (a one-token allowance per unit), and keeps each one whose document, rendered again,
still fits — the budget is then used as fully as the counts themselves allow.

With ``drop_below_best`` (:class:`SelectionOptions`), documents whose relevance is below that share of the best
document's are not candidates at all, so their budget goes to the others; the selection's warnings name them.

Nothing that had content is emptied: a document marked ``required`` (a whole tool result, say) keeps at least its
best unit, taken first, and a context where nothing else would be kept keeps its best unit. When such a unit does
not fit the budget it is kept whole anyway, over the budget, and :attr:`Selection.over_budget` says by how much.

Every decision is recorded where it is made: :attr:`Selection.reasons` gives each row's
:data:`~rag_opt.types.UnitReason` (kept by its score, by the fill pass, as a required document's or the context's
best, as a document's first or best; kept as the antecedent, heading or structure a kept unit needs; dropped for
the budget, at the recount, below the threshold, with its document far below the best; a header nothing needs),
:attr:`Selection.needed_by` the kept unit a row was kept for, and :attr:`Selection.rank` the order the candidates
were tried in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from rag_opt.compressors.context_features import document_links
from rag_opt.compressors.unit_needs import unit_needs
from rag_opt.errors import InvalidInputError
from rag_opt.text.units import UnitTable
from rag_opt.types import UnitReason

__all__ = ["Selection", "SelectionOptions", "select"]


@dataclass(frozen=True)
class SelectionOptions:
    """Per-document guarantees, honoured while the budget allows."""

    keep_best_per_doc: bool = False  # first keep each document's best unit (or its best that fits)
    # an English sentence that opens with a back-reference ("It has many museums.") is kept only with the sentence
    # before it: measured neutral on 300 HotpotQA dev questions (model tier, 1/3: recall +0.002 [-0.005, +0.009],
    # answer kept -0.007 [-0.017, +0.000]; 1/5: -0.003 / +0.000; lexical tier within +-0.01), and no kept sentence
    # dangles without its antecedent
    keep_antecedents: bool = True
    # with keep_antecedents, so is a sentence that leans on the one before it through a demonstrative or definite
    # reference ("than that", "this method", "The treatment works ...": :mod:`rag_opt.text.references`). Paired
    # on 500 HotpotQA dev questions and 500 SQuAD questions, both tiers, 1/3 and 1/5: every difference in facts and
    # answers kept within one question (every interval spans 0), the same tokens, and the kept sentences that
    # dangle (0.4-1.9 % of them) go to 0 (docs/benchmarks.md, "Kept text that does not dangle")
    keep_references: bool = True
    keep_first: bool = False  # first keep each document's first candidate unit
    # with a budget: a document whose relevance is below this share of the best document's is not a candidate (a
    # required one always is); None: every document competes sentence by sentence
    drop_below_best: float | None = None
    drop_keeps_bridges: bool = True  # the gate keeps a document that a document above the bar names (a second hop)


@dataclass(frozen=True)
class Selection:
    """The select stage's value: which rows are kept, and each document's kept size in target tokens."""

    keep: np.ndarray  # (n_units,) bool; a title row is kept exactly when its document keeps a unit
    doc_kept: np.ndarray  # (n_docs,) bool: the document keeps some of its text
    texts: tuple[str, ...]  # (n_docs,) each document's kept text, rendered (title line not included; "": dropped)
    tokens_after: np.ndarray  # (n_docs,) target tokens of each document's kept text (title included); 0: dropped
    over_budget: int = 0  # target tokens kept over the limit (a unit kept whole so as not to empty the context)
    forced: tuple[int, ...] = ()  # rows kept whatever the budget: the best unit of a required document, or of all
    warnings: tuple[str, ...] = ()  # what the result should say: a unit kept over the budget, or below the threshold
    reasons: tuple[UnitReason, ...] = ()  # (n_units,) why each row was kept or dropped
    needed_by: np.ndarray | None = None  # (n_units,) int: the kept row a row was kept with (an antecedent, ...); -1
    rank: np.ndarray | None = None  # (n_units,) int: 1 + a candidate's place by score (the order tried); 0: none

    @property
    def kept_docs(self) -> list[int]:
        """Indices of the documents that keep some text, in input order."""
        return [int(d) for d in np.flatnonzero(self.doc_kept)]


def select(
    units: UnitTable,
    scores: np.ndarray | None,
    count: Callable[[str], int],
    *,
    limit: int | None = None,
    threshold: float | None = None,
    options: SelectionOptions = SelectionOptions(),  # noqa: B008 - frozen, shared safely
    doc_scores: np.ndarray | None = None,
) -> Selection:
    """Keep units of ``units`` by ``scores`` (one per row) under ``limit`` target tokens and/or ``threshold``.

    With neither (or no scores), everything is kept. ``count`` counts target-LLM tokens. ``doc_scores`` (one
    relevance per document, higher is better) is needed by ``options.drop_below_best`` only.
    """
    rank = _ranks(units, scores)
    if scores is None or (limit is None and threshold is None):
        everything = np.ones(units.n_units, dtype=bool)
        whole = [_render(units, d, everything, count, any_row=True) for d in range(units.n_docs)]
        has_text = np.bincount(units.doc[units.start >= 0], minlength=units.n_docs) > 0
        tokens = np.asarray([n for _, n in whole], np.int64)
        uncut: UnitReason = "no_compression"
        every = (uncut,) * units.n_units
        no_one = np.full(units.n_units, -1, dtype=np.int64)
        return Selection(
            everything, has_text, tuple(t for t, _ in whole), tokens, reasons=every, needed_by=no_one, rank=rank
        )
    notes: list[str] = []
    why: list[UnitReason | None] = [None] * units.n_units
    if options.drop_below_best is not None:
        was = units.candidate
        units, note = _drop_far_below_best(units, doc_scores, options.drop_below_best, options.drop_keeps_bridges)
        notes += [note] if note else []
        for r in np.flatnonzero(was & ~units.candidate).tolist():
            why[r] = "document_below_best"
    header = ~units.candidate
    needs = unit_needs(
        units, antecedents=options.keep_antecedents, references=options.keep_antecedents and options.keep_references
    )
    score = np.asarray(scores, dtype=np.float64)
    forced = _required_best(units, score)
    kept = _greedy(units, np.where(header, -np.inf, score), needs, limit, threshold, options, forced, why)
    is_forced = np.zeros(units.n_units, dtype=bool)
    is_forced[list(forced)] = True
    rendered = [_render(units, d, kept, count) for d in range(units.n_docs)]
    doc_tokens = np.asarray([tokens for _, tokens in rendered], dtype=np.int64)
    if limit is not None:
        while int(doc_tokens.sum()) > limit:
            live = np.flatnonzero(kept & ~header & ~is_forced)
            if not live.size:
                break
            worst = int(min(live, key=lambda i: (score[i], -i)))
            kept[worst] = False
            why[worst] = "recount"
            d = int(units.doc[worst])
            rows = units.rows(d)
            needed = {h for r in rows if kept[r] and not header[r] for h in needs[r]}
            for r in rows:
                if header[r]:
                    kept[r] = r in needed
            rendered[d] = _render(units, d, kept, count)
            doc_tokens[d] = rendered[d][1]
        _fill(units, score, needs, kept, rendered, doc_tokens, count, limit, threshold, why)
    floor = not (kept & ~header).any() and bool(units.candidate.any())
    if floor:  # nothing fits: the context keeps its best unit
        best = _best(units, score, np.flatnonzero(units.candidate))
        forced = (best,)
        _mark_antecedents(units, needs[best], kept, why)
        kept[[best, *needs[best]]] = True
        why[best] = "floor"
        d = int(units.doc[best])
        rendered[d] = _render(units, d, kept, count)
        doc_tokens[d] = rendered[d][1]
    keep = kept.copy()
    doc_kept = np.zeros(units.n_docs, dtype=bool)
    for d in range(units.n_docs):
        rows = units.rows(d)
        doc_kept[d] = any(keep[r] and not header[r] for r in rows)
        if not doc_kept[d]:
            keep[rows.start : rows.stop] = False
            rendered[d] = ("", 0)
            doc_tokens[d] = 0
    over = max(0, int(doc_tokens.sum()) - limit) if limit is not None else 0
    warnings: list[str] = notes
    if over:
        because = "so that the context is not emptied" if floor else "so that a required document keeps some text"
        largest = max(int(units.tokens[r]) for r in forced)
        warnings.append(
            f"over the budget by {over} tokens: a unit of {largest} tokens that does not fit the budget of {limit} "
            f"was kept whole, {because}"
        )
    elif floor and limit is None:
        warnings.append("no unit reached the threshold: the best one was kept, so that the context is not emptied")
    texts = tuple(text for text, _ in rendered)
    reasons, needed_by = _settle_reasons(units, score, needs, keep, why, threshold)
    return Selection(keep, doc_kept, texts, doc_tokens, over, tuple(forced), tuple(warnings), reasons, needed_by, rank)


def _ranks(units: UnitTable, scores: np.ndarray | None) -> np.ndarray | None:
    """1 + each candidate's place by score, best first (ties: the earlier), the order selection tries them in;
    0 for the other rows. None without scores."""
    if scores is None:
        return None
    score = np.asarray(scores, dtype=np.float64)
    order = sorted(np.flatnonzero(units.candidate).tolist(), key=lambda i: (-score[i], i))
    rank = np.zeros(units.n_units, dtype=np.int64)
    rank[order] = np.arange(1, len(order) + 1)
    return rank


def _mark_antecedents(units: UnitTable, rows: tuple[int, ...], kept: np.ndarray, why: list[UnitReason | None]) -> None:
    """Record the candidate rows of ``rows`` (what a unit needs) not kept yet as kept for being an antecedent
    (the other rows a unit needs are headers: :func:`_settle_reasons` names them by their kind)."""
    for h in rows:
        if units.candidate[h] and not kept[h]:
            why[h] = "antecedent"


def _settle_reasons(
    units: UnitTable,
    score: np.ndarray,
    needs: list[tuple[int, ...]],
    keep: np.ndarray,
    why: list[UnitReason | None],
    threshold: float | None,
) -> tuple[tuple[UnitReason, ...], np.ndarray]:
    """Each row's reason and the kept row it was kept with, from the decisions recorded on the way (``why``)
    and the rule for headers: a header row is kept exactly when a kept unit needs it (its title, heading,
    structure), and an antecedent with the unit that needs it. A candidate not kept whose score is under
    ``threshold`` never could be: below the threshold, whatever the budget."""
    needed_by = np.full(units.n_units, -1, dtype=np.int64)
    # the best-scoring kept unit that needs each kept row (the one that would keep it)
    for r in sorted(np.flatnonzero(keep & units.candidate).tolist(), key=lambda i: (-score[i], i)):
        for h in needs[r]:
            if keep[h] and needed_by[h] < 0:
                needed_by[h] = r
    out: list[UnitReason] = []
    for r in range(units.n_units):
        reason = why[r]
        if not units.candidate[r] and reason != "document_below_best":
            reason = _header_reason(units.kind[r]) if keep[r] else "unused"
        elif not keep[r] and threshold is not None and score[r] < threshold and reason != "document_below_best":
            reason = "below_threshold"
        elif reason is None:  # pragma: no cover - every candidate is decided on the way
            reason = "selected" if keep[r] else "budget"
        if reason != "antecedent" and not (keep[r] and not units.candidate[r]):
            needed_by[r] = -1
        out.append(reason)
    return tuple(out), needed_by


def _header_reason(kind: str) -> UnitReason:
    """Why a header row of ``kind`` is kept: a kept unit needs its title, heading or structure row."""
    return "title" if kind == "title" else "heading" if kind == "heading" else "structure"


def _best(units: UnitTable, score: np.ndarray, rows: np.ndarray) -> int:
    """The best-scoring of ``rows`` (ties: the earliest)."""
    return int(min(rows.tolist(), key=lambda i: (-score[i], i)))


def _drop_far_below_best(
    units: UnitTable, doc_scores: np.ndarray | None, share: float, bridges: bool = True
) -> tuple[UnitTable, str]:
    """``units`` whose documents scoring below ``share`` × the best document's score are no longer candidates
    (a required document stays, and with ``bridges`` one that a document above the bar names), and a note naming
    them ("" when none is dropped). Scores are relevance probabilities (non-negative); the gate is relative, so it
    adapts to how sure the scorer is of the best."""
    if doc_scores is None:
        raise InvalidInputError("drop_below_best needs document relevance scores")
    doc = np.asarray(doc_scores, dtype=np.float64)
    if doc.shape != (units.n_docs,) or not np.all(np.isfinite(doc)):
        raise InvalidInputError(f"document scores must be {units.n_docs} finite numbers, got shape {doc.shape}")
    if not units.n_docs:
        return units, ""
    if float(doc.min()) < 0:
        raise InvalidInputError(
            "drop_below_best needs non-negative document relevance (probabilities); this scorer gives negative ones"
        )
    required = np.asarray([d.required for d in units.documents], dtype=bool) if units.documents else None
    below = doc < share * float(doc.max())
    below[int(np.argmax(doc))] = False
    if required is not None:
        below &= ~required
    if below.any() and bridges:
        # a document that a kept one names (by title or leading subject) may be the second hop: it stays
        for d, e in document_links(units):
            if below[d] and not below[e]:
                below[d] = False
    if not below.any():
        return units, ""
    gated = replace(units, candidate=units.candidate & ~below[units.doc])
    dropped = ", ".join(str(int(d)) for d in np.flatnonzero(below))
    return gated, (
        f"{int(below.sum())} of {units.n_docs} documents dropped as far below the best "
        f"(relevance under {share:g} x the best's: documents {dropped})"
    )


def _required_best(units: UnitTable, score: np.ndarray) -> tuple[int, ...]:
    """The best candidate row of every document marked ``required``."""
    out: list[int] = []
    for d, document in enumerate(units.documents):
        if document.required:
            rows = np.asarray([r for r in units.rows(d) if units.candidate[r]], dtype=np.int64)
            if rows.size:
                out.append(_best(units, score, rows))
    return tuple(out)


def _fill(
    units: UnitTable,
    score: np.ndarray,
    needs: list[tuple[int, ...]],
    kept: np.ndarray,
    rendered: list[tuple[str, int]],
    doc_tokens: np.ndarray,
    count: Callable[[str], int],
    limit: int,
    threshold: float | None,
    why: list[UnitReason | None],
) -> None:
    """Spend what the rendered documents left of ``limit``: try the units not kept, best first, whose counted cost
    (headers included, less one token for the merge at a unit boundary) fits the slack; keep each whose document,
    rendered again, still fits. In place on ``kept``, ``rendered`` and ``doc_tokens``."""
    slack = limit - int(doc_tokens.sum())
    if slack <= 0:
        return
    order = sorted(np.flatnonzero(units.candidate & ~kept).tolist(), key=lambda i: (-score[i], i))
    for i in order:
        if threshold is not None and score[i] < threshold:
            break
        cost = int(units.tokens[i]) + sum(int(units.tokens[h]) for h in needs[i] if not kept[h])
        if cost - 1 > slack:
            continue
        d = int(units.doc[i])
        trial = kept.copy()
        trial[i] = True
        for h in needs[i]:
            trial[h] = True
        text, tokens = _render(units, d, trial, count)
        added = tokens - int(doc_tokens[d])
        if added <= slack:
            _mark_antecedents(units, needs[i], kept, why)
            why[i] = "fill"
            kept[:] = trial
            rendered[d] = (text, tokens)
            doc_tokens[d] = tokens
            slack -= added
            if slack <= 0:
                return


def _greedy(
    units: UnitTable,
    score: np.ndarray,
    needs: list[tuple[int, ...]],
    limit: int | None,
    threshold: float | None,
    options: SelectionOptions,
    forced: tuple[int, ...] = (),
    why: list[UnitReason | None] | None = None,
) -> np.ndarray:
    """The greedy pass; records in ``why`` each row's reason as it is decided."""
    kept = np.zeros(units.n_units, dtype=bool)
    used = 0
    why = [None] * units.n_units if why is None else why

    def take(i: int, reason: UnitReason, force: bool = False, with_needs: tuple[int, ...] | None = None) -> None:
        nonlocal used
        required = needs[i] if with_needs is None else with_needs
        cost = int(units.tokens[i]) + sum(int(units.tokens[h]) for h in required if not kept[h])
        if limit is not None and used + cost > limit and not force:
            why[i] = "budget"
            return
        _mark_antecedents(units, required, kept, why)
        for h in required:
            kept[h] = True
        kept[i] = True
        why[i] = reason
        used += cost

    for i in forced:
        take(i, "required", force=True)
    order = sorted(np.flatnonzero(units.candidate).tolist(), key=lambda i: (-score[i], i))
    if options.keep_first:
        for d in range(units.n_docs):
            first = next((r for r in units.rows(d) if units.candidate[r]), None)
            if first is not None and not kept[first]:
                take(first, "first")
    if options.keep_best_per_doc:
        # each document's best unit that fits (its best when it fits: a unit kept with what it needs — a title,
        # an antecedent — may not), documents in the order of their best score
        done: set[int] = set()
        for i in order:
            d = int(units.doc[i])
            if d in done:
                continue
            if not kept[i]:
                take(i, "best_of_document")
            if kept[i]:
                done.add(d)
        # a document none of whose units fits with its antecedent keeps its best unit that fits without it: the
        # caller asked for every document (the antecedent rule yields to that)
        if len(done) < len(set(units.doc[order].tolist())):  # only then: the needs without antecedents
            bare = unit_needs(units, antecedents=False)
            for i in order:
                d = int(units.doc[i])
                if d not in done and not kept[i]:
                    take(i, "best_of_document", with_needs=bare[i])
                    if kept[i]:
                        done.add(d)
    for i in order:
        if kept[i]:
            continue
        if threshold is not None and score[i] < threshold:
            break  # sorted by score: nothing later passes either (below_threshold: _settle_reasons)
        take(i, "selected")
    return kept


def _render(
    units: UnitTable, d: int, kept: np.ndarray, count: Callable[[str], int], *, any_row: bool = False
) -> tuple[str, int]:
    """Document ``d``'s kept text as rendered from ``kept`` and its target tokens (title included): ``("", 0)``
    when it keeps no candidate unit (with ``any_row``: no text unit at all — a document of headings only is
    kept whole when nothing is cut)."""
    rows = units.rows(d)
    if not any(kept[r] and (units.start[r] >= 0 if any_row else units.candidate[r]) for r in rows):
        return "", 0
    title_tokens = int(units.title_tokens[d]) if units.title_tokens is not None and units.titles[d] else 0
    text = units.render(d, kept)
    return text, title_tokens + count(text)
