"""Calibrated placement (AttnRank-style): put the most relevant documents into the slots the model attends to most.

The model's positional attention profile (:class:`rag_opt.calibration.PositionProfile`, measured with
non-relevant documents in every slot) ranks the slots; the document of relevance rank r goes into the slot
with the r-th highest attention.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rag_opt.calibration import PositionProfile, ProfileStore
from rag_opt.orderers.lost_in_the_middle import _checked_scores


def placement(relevance: Sequence[float], slot_attention: Sequence[float]) -> list[int]:
    """Permutation mapping slots to documents: slot i holds document ``perm[i]``.

    Ties: among equally relevant documents the earlier input ranks first; among equally attended slots the
    later slot ranks first (closer to the question).
    """
    rel = _checked_scores(relevance)
    att = _checked_scores(slot_attention)
    if len(rel) != len(att):
        raise ValueError(f"{len(rel)} documents but a profile of {len(att)} slots")
    doc_rank = sorted(range(len(rel)), key=lambda i: (-rel[i], i))
    slot_rank = sorted(range(len(att)), key=lambda k: (-att[k], -k))
    perm = [0] * len(rel)
    for d, k in zip(doc_rank, slot_rank, strict=True):
        perm[k] = d
    return perm


class CalibratedPlacement:
    """Place documents by relevance into slots ranked by the profile's attention."""

    def __init__(self, profile: PositionProfile, *, view: str = "last") -> None:
        self.profile = profile
        self.slot_attention = profile.slot_attention(view)

    def order(self, relevance: Sequence[float]) -> list[int]:
        if len(relevance) != self.profile.n_docs:
            raise ValueError(
                f"calibrated placement needs a profile for {len(relevance)} documents; "
                f"this one is for {self.profile.n_docs} (run `rag-opt calibrate --n-docs {len(relevance)}`)"
            )
        return placement(relevance, np.asarray(self.slot_attention).tolist())


def resample_slots(curve: Sequence[float] | np.ndarray, n_slots: int) -> np.ndarray:
    """A slot-attention curve measured for ``len(curve)`` slots, linearly resampled to ``n_slots`` slots by
    relative position (slot centres), for placing a number of documents nobody calibrated for."""
    c = np.asarray(curve, dtype=np.float64)
    if n_slots < 1:
        raise ValueError(f"n_slots must be >= 1, got {n_slots}")
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
