"""Calibrated placement (AttnRank-style): put the most relevant documents into the slots the model attends to most.

The model's positional attention profile (:class:`rag_opt.calibration.PositionProfile`, measured with
non-relevant documents in every slot) ranks the slots; the document of relevance rank r goes into the slot
with the r-th highest attention.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rag_opt.calibration import PositionProfile
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
