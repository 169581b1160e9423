"""The orderings that need no model and no profile: keep the input order, sort by relevance, or move only
the most relevant document to the front (always, or only when it is clearly the best)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rag_opt.errors import InvalidInputError
from rag_opt.orderers.base import OrdererResources, Ordering, OrderItem, register_orderer
from rag_opt.orderers.lost_in_the_middle import checked_scores

__all__ = ["CLEAR_BEST_SHARE", "InputOrder", "PromoteBest", "PromoteClearBest", "RelevanceOrder"]


CLEAR_BEST_SHARE = 0.05
""":class:`PromoteClearBest`'s default: the best document is promoted only when the first document's relevance is
at most this share of the best's. Chosen without the test questions, by a rule fixed in advance: the largest share
of the grid 1 ... 0.01 under which a distractor moves ahead of a gold passage that came first in at most 2 % of
contexts (NQ multi-document, 200 questions, 20 documents, the gold passage at slots 1, 5, 10, 15, 20;
``benchmarks/ablations/promote_gate.py``). The ``train`` split (the document probe's training questions) picked it
first; the ``calibration`` split, which the probe never saw, picks the same: there it moves a distractor ahead in
1.5 % of contexts (25 % without the gate) and still promotes the gold passage from the other slots in 0.53 (0.75
without it). docs/reordering.md, "The default"."""


def _best(relevance: Sequence[float]) -> int:
    """The index of the most relevant document; of equally relevant ones the earliest."""
    return min(range(len(relevance)), key=lambda j: (-relevance[j], j))


def _promoted(best: int, n: int) -> Ordering:
    """Document ``best`` first, the other ``n - 1`` in input order."""
    return Ordering([best, *(j for j in range(n) if j != best)])


@register_orderer
class InputOrder:
    """Documents stay in their input order."""

    name: ClassVar[str] = "input"
    reorders: ClassVar[bool] = False

    @classmethod
    def from_resources(cls, resources: OrdererResources) -> InputOrder:
        return cls()

    def order(self, query: str, documents: Sequence[OrderItem]) -> Ordering:
        return Ordering(list(range(len(documents))))


@register_orderer
class RelevanceOrder:
    """Most relevant first; equally relevant documents keep their input order."""

    name: ClassVar[str] = "relevance"
    reorders: ClassVar[bool] = True

    @classmethod
    def from_resources(cls, resources: OrdererResources) -> RelevanceOrder:
        return cls()

    def order(self, query: str, documents: Sequence[OrderItem]) -> Ordering:
        """Descending relevance, ties in input order; raises when a relevance is not finite (NaN would sort
        anywhere)."""
        relevance = checked_scores([d.relevance for d in documents])
        return Ordering(sorted(range(len(relevance)), key=lambda j: (-relevance[j], j)))


@register_orderer
class PromoteBest:
    """The most relevant document moves to the front; every other document keeps its input order.

    The smallest change that puts the best document where readers look first.  When the retriever's order
    already has the best document first, the context is left exactly as it came, so a reader that answered
    from the input order answers the same.  Of equally relevant documents the earlier one is promoted.
    """

    name: ClassVar[str] = "promote_best"
    reorders: ClassVar[bool] = True

    @classmethod
    def from_resources(cls, resources: OrdererResources) -> PromoteBest:
        return cls()

    def order(self, query: str, documents: Sequence[OrderItem]) -> Ordering:
        """The best document first, then the others in input order; raises when a relevance is not finite."""
        relevance = checked_scores([d.relevance for d in documents])
        if not relevance:
            return Ordering([])
        return _promoted(_best(relevance), len(relevance))


@register_orderer
class PromoteClearBest:
    """:class:`PromoteBest` only when the best document is clearly the best; otherwise the input order.

    The best document moves to the front when the first document's relevance is at most ``share`` of the best's
    (:data:`CLEAR_BEST_SHARE` by default); every other document keeps its input order.  When the retriever's first
    document is nearly as relevant as rag-opt's best, rag-opt's ranking may be the one that is wrong, and moving a
    distractor ahead of the right document costs answers: this ordering then leaves the context as it came.
    Relevance below zero (a retriever's scores on another scale) is compared from the lowest score:
    ``first - low <= share * (best - low)`` with ``low = min(0, min(relevance))``.
    """

    name: ClassVar[str] = "promote_clear_best"
    reorders: ClassVar[bool] = True

    def __init__(self, share: float = CLEAR_BEST_SHARE) -> None:
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise InvalidInputError(f"share must be a number in [0, 1], got {share!r}")
        self.share = float(share)

    @classmethod
    def from_resources(cls, resources: OrdererResources) -> PromoteClearBest:
        return cls()

    def order(self, query: str, documents: Sequence[OrderItem]) -> Ordering:
        """The clearly best document first, then the others in input order; raises when a relevance is not
        finite."""
        relevance = checked_scores([d.relevance for d in documents])
        keep = Ordering(list(range(len(relevance))))
        if not relevance:
            return keep
        best = _best(relevance)
        low = min(0.0, *relevance)
        if best == 0 or relevance[0] - low > self.share * (relevance[best] - low):
            return keep
        return _promoted(best, len(relevance))
