"""Calibrated placement (AttnRank-style): put the most relevant documents into the slots the model attends to most.

The model's positional attention profile (:class:`rag_opt.orderers.profiles.PositionProfile`, measured with
non-relevant documents in every slot) ranks the slots; the document of relevance rank r goes into the slot
with the r-th highest attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from rag_opt.errors import InvalidInputError
from rag_opt.orderers.base import OrdererResources, Ordering, OrderItem, register_orderer
from rag_opt.orderers.lost_in_the_middle import checked_scores, end_placement
from rag_opt.orderers.profiles import ProfileStore

__all__ = ["CalibratedPlacement", "placement", "resample_slots", "slot_attention_for"]


def placement(relevance: Sequence[float], slot_attention: Sequence[float]) -> list[int]:
    """Permutation mapping slots to documents: slot i holds document ``perm[i]``.

    Ties: among equally relevant documents the earlier input ranks first; among equally attended slots the
    later slot ranks first (closer to the question).
    """
    rel = checked_scores(relevance)
    att = checked_scores(slot_attention)
    if len(rel) != len(att):
        raise InvalidInputError(f"{len(rel)} documents but a profile of {len(att)} slots")
    doc_rank = sorted(range(len(rel)), key=lambda i: (-rel[i], i))
    slot_rank = sorted(range(len(att)), key=lambda k: (-att[k], -k))
    perm = [0] * len(rel)
    for d, k in zip(doc_rank, slot_rank, strict=True):
        perm[k] = d
    return perm


@register_orderer
class CalibratedPlacement:
    """Place documents by relevance into slots ranked by the proxy's positional attention profile.

    The profile for exactly the number of documents is used when one exists, else the nearest calibrated size
    resampled (with a warning), else end placement (with a warning). ``profiles`` is the store to read and
    ``model`` the proxy model's name (profiles are per model).
    """

    name: ClassVar[str] = "calibrated"
    reorders: ClassVar[bool] = True

    def __init__(self, profiles: ProfileStore | None, model: str, *, view: str = "last") -> None:
        self.profiles = profiles
        self.model = model
        self.view = view

    @classmethod
    def from_resources(cls, resources: OrdererResources) -> CalibratedPlacement:
        return cls(resources.profiles(), resources.proxy().name)

    def order(self, query: str, documents: Sequence[OrderItem]) -> Ordering:
        relevance = [d.relevance for d in documents]
        curve, note = slot_attention_for(self.profiles, self.model, len(documents), view=self.view)
        warnings = [note] if note else []
        if curve is None:
            return Ordering(end_placement(relevance), warnings)
        return Ordering(placement(relevance, curve.tolist()), warnings)


def resample_slots(curve: Sequence[float] | np.ndarray, n_slots: int) -> np.ndarray:
    """A slot-attention curve measured for ``len(curve)`` slots, linearly resampled to ``n_slots`` slots by
    relative position (slot centres), for placing a number of documents nobody calibrated for."""
    c = np.asarray(curve, dtype=np.float64)
    if n_slots < 1:
        raise InvalidInputError(f"n_slots must be >= 1, got {n_slots}")
    src = (np.arange(len(c)) + 0.5) / len(c)
    dst = (np.arange(n_slots) + 0.5) / n_slots
    return np.asarray(np.interp(dst, src, c), dtype=np.float64)


def slot_attention_for(
    store: ProfileStore | None, model: str, n_slots: int, *, view: str = "last"
) -> tuple[np.ndarray | None, str | None]:
    """The slot-attention curve to place ``n_slots`` documents with, and a note when it is not measured.

    The profile for exactly ``n_slots`` when one exists; else the nearest calibrated size, resampled by
    relative position (noted); else None (noted: the caller falls back to end-placement).
    """
    if store is not None:
        exact = store.get(model, n_slots)
        if exact is not None:
            return exact.slot_attention(view), None
        sizes = store.available(model)
        if sizes:
            near = min(sizes, key=lambda n: (abs(n - n_slots), n))
            prof = store.get(model, near)
            if prof is not None:
                note = (
                    f"calibrated placement: no profile for {n_slots} documents of {model}; used the {near}-document "
                    f"profile resampled to {n_slots} slots (`rag-opt calibrate --n-docs {n_slots}` measures it)"
                )
                return resample_slots(prof.slot_attention(view), n_slots), note
    return None, (
        f"calibrated placement: no calibration profile for {model}; documents were end-placed "
        "(lost_in_the_middle) instead (`rag-opt calibrate` measures one)"
    )
