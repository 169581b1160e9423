"""The two orderings that need no model: keep the input order, or put the most relevant document first."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rag_opt.orderers.base import OrdererResources, Ordering, OrderItem, register_orderer

__all__ = ["InputOrder", "RelevanceOrder"]


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
