"""The orderings that need no model and no profile: keep the input order, sort by relevance, or move only
the most relevant document to the front."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rag_opt.orderers.base import OrdererResources, Ordering, OrderItem, register_orderer
from rag_opt.orderers.lost_in_the_middle import checked_scores

__all__ = ["InputOrder", "PromoteBest", "RelevanceOrder"]


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
        return Ordering(sorted(range(len(documents)), key=lambda j: (-documents[j].relevance, j)))


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
        best = min(range(len(relevance)), key=lambda j: (-relevance[j], j))
        return Ordering([best, *(j for j in range(len(relevance)) if j != best)])
