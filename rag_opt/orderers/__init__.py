"""Orderers: permutations of the kept documents that place them where the LLM uses them best.

Every orderer implements :class:`Orderer` and is registered under its ordering name (:data:`ORDERERS`,
:func:`make_orderer`); the pure placement functions are usable on their own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rag_opt._lazy import lazy_module

__all__ = [
    "ORDERERS",
    "AttentionSort",
    "CalibratedPlacement",
    "InputOrder",
    "LostInTheMiddle",
    "OrderItem",
    "Orderer",
    "OrdererResources",
    "Ordering",
    "PositionProfile",
    "ProfileStore",
    "PromoteBest",
    "PromoteClearBest",
    "RelevanceOrder",
    "end_placement",
    "make_orderer",
    "placement",
    "rank_scores",
    "register_orderer",
    "resample_slots",
    "slot_attention_for",
]

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.artifacts.position_profiles import PositionProfile, ProfileStore
    from rag_opt.orderers.attention_sort import AttentionSort
    from rag_opt.orderers.base import (
        ORDERERS,
        Orderer,
        OrdererResources,
        Ordering,
        OrderItem,
        make_orderer,
        register_orderer,
    )
    from rag_opt.orderers.calibrated import CalibratedPlacement, placement, resample_slots, slot_attention_for
    from rag_opt.orderers.lost_in_the_middle import LostInTheMiddle, end_placement, rank_scores
    from rag_opt.orderers.simple import InputOrder, PromoteBest, PromoteClearBest, RelevanceOrder

__getattr__, __dir__ = lazy_module(
    __name__,
    {
        "AttentionSort": "rag_opt.orderers.attention_sort",
        "ORDERERS": "rag_opt.orderers.base",
        "OrderItem": "rag_opt.orderers.base",
        "Orderer": "rag_opt.orderers.base",
        "OrdererResources": "rag_opt.orderers.base",
        "Ordering": "rag_opt.orderers.base",
        "make_orderer": "rag_opt.orderers.base",
        "register_orderer": "rag_opt.orderers.base",
        "CalibratedPlacement": "rag_opt.orderers.calibrated",
        "placement": "rag_opt.orderers.calibrated",
        "resample_slots": "rag_opt.orderers.calibrated",
        "slot_attention_for": "rag_opt.orderers.calibrated",
        "LostInTheMiddle": "rag_opt.orderers.lost_in_the_middle",
        "end_placement": "rag_opt.orderers.lost_in_the_middle",
        "rank_scores": "rag_opt.orderers.lost_in_the_middle",
        "PositionProfile": "rag_opt.artifacts.position_profiles",
        "ProfileStore": "rag_opt.artifacts.position_profiles",
        "InputOrder": "rag_opt.orderers.simple",
        "PromoteBest": "rag_opt.orderers.simple",
        "PromoteClearBest": "rag_opt.orderers.simple",
        "RelevanceOrder": "rag_opt.orderers.simple",
    },
)
