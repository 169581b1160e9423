"""Choosing units under a token budget (the *select* stage).

Pure logic over scored units, independent of how scores were made, so every scorer (probe, raw attention,
BM25, embeddings, random, lead) is compared under exactly the same selection rule in the benchmarks.

Rule: units are taken best score first (ties: earlier first); a unit whose cost does not fit is skipped and
the next ones are tried, so the budget is filled as fully as possible without ever exceeding it. The cost of a
unit includes the header units it needs (its document's title and the nearest heading before it) the first
time one of them is needed. Headers are never candidates on their own. Protected blocks are ordinary units:
kept or dropped whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """One unit as seen by selection."""

    doc: int
    tokens: int
    score: float
    header: bool = False  # title/heading: kept only along with a sentence that needs it
    needs: tuple[int, ...] = ()  # indices of header units this unit needs


@dataclass(frozen=True)
class SelectionOptions:
    budget: int | None = None  # max tokens; None = no budget
    threshold: float | None = None  # keep units scoring >= threshold (with the budget, if any)
    keep_best_per_doc: bool = False  # first keep each document's best unit (while it fits)
    keep_first: bool = False  # first keep each document's first non-header unit (while it fits)


def select(cands: Sequence[Candidate], opts: SelectionOptions, first_units: Sequence[int] = ()) -> list[bool]:
    """Return a kept flag per candidate."""
    kept = [False] * len(cands)
    used = 0
    budget = opts.budget

    def cost(i: int) -> int:
        return cands[i].tokens + sum(cands[h].tokens for h in cands[i].needs if not kept[h])

    def take(i: int) -> bool:
        nonlocal used
        c = cost(i)
        if budget is not None and used + c > budget:
            return False
        for h in cands[i].needs:
            kept[h] = True
        kept[i] = True
        used += c
        return True

    order = sorted((i for i, c in enumerate(cands) if not c.header), key=lambda i: (-cands[i].score, i))
    if opts.keep_first:
        for i in first_units:
            if not kept[i]:
                take(i)
    if opts.keep_best_per_doc:
        seen: set[int] = set()
        for i in order:
            if cands[i].doc not in seen:
                seen.add(cands[i].doc)
                if not kept[i]:
                    take(i)
    for i in order:
        if kept[i]:
            continue
        if opts.threshold is not None and cands[i].score < opts.threshold:
            break  # sorted by score: nothing later passes either
        take(i)
    return kept
