"""Calibrated placement (AttnRank-style): put the most relevant documents into the slots the model makes most of.

The slots are ranked by a profile, and the document of relevance rank r goes into the slot ranked r-th:

* the *reader's* profile (:class:`rag_opt.orderers.reader_profiles.ReaderProfile`: its attention or its accuracy
  per slot, ``rag-opt calibrate --reader``) when one exists for the model that reads the context;
* else the proxy's positional attention profile (:class:`rag_opt.artifacts.position_profiles.PositionProfile`,
  measured with non-relevant documents in every slot);
* else end placement.

The result's ``placement_profile`` says which profile placed the documents.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np

from rag_opt.artifacts.position_profiles import ProfileStore
from rag_opt.errors import InvalidInputError
from rag_opt.orderers.base import OrdererResources, Ordering, OrderItem, register_orderer
from rag_opt.orderers.lost_in_the_middle import checked_scores, end_placement
from rag_opt.orderers.reader_profiles import ReaderProfileStore

__all__ = ["CalibratedPlacement", "placement", "reader_weights_for", "resample_slots", "slot_attention_for"]


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
    """Place documents by relevance into slots ranked by the reader's profile, else the proxy's.

    ``reader`` (the model that reads the context) and ``readers`` (its profiles): the reader's profile for
    exactly the number of documents, else its nearest measured size resampled (noted). Without one, the proxy's
    profile (``profiles``, ``model`` the proxy model's name) for exactly the number of documents, else the nearest
    calibrated size resampled (noted), else end placement (noted).
    """

    name: ClassVar[str] = "calibrated"
    reorders: ClassVar[bool] = True

    def __init__(
        self,
        profiles: ProfileStore | None,
        model: str | None,
        *,
        view: str = "last",
        reader: str | None = None,
        readers: ReaderProfileStore | None = None,
        proxy_side: Callable[[], tuple[ProfileStore | None, str]] | None = None,
    ) -> None:
        self.profiles = profiles
        self.model = model
        self.view = view
        self.reader = reader
        self.readers = readers
        self._proxy_side = proxy_side  # (profiles, model), loaded when first needed

    @classmethod
    def from_resources(cls, resources: OrdererResources) -> CalibratedPlacement:
        if resources.reader:  # the proxy is loaded only if a request has no reader profile to place by
            return cls(
                None,
                None,
                reader=resources.reader,
                readers=resources.reader_profiles(),
                proxy_side=lambda: (resources.profiles(), resources.proxy().name),
            )
        return cls(resources.profiles(), resources.proxy().name)

    def order(self, query: str, documents: Sequence[OrderItem]) -> Ordering:
        relevance = [d.relevance for d in documents]
        n = len(documents)
        if self.reader and self.readers is not None:
            weights, profile, note = reader_weights_for(self.readers, self.reader, n)
            if weights is not None:
                return Ordering(placement(relevance, weights.tolist()), [note] if note else [], profile=profile)
        if self.model is None:
            if self._proxy_side is None:
                raise InvalidInputError("calibrated placement needs a reader profile or the proxy model's profile")
            self.profiles, self.model = self._proxy_side()
        curve, note = slot_attention_for(self.profiles, self.model, n, view=self.view)
        warnings = [note] if note else []
        if curve is None:
            return Ordering(end_placement(relevance), warnings)
        resampled = ", resampled" if note else ""
        return Ordering(
            placement(relevance, curve.tolist()), warnings, profile=f"proxy profile of {self.model}{resampled}"
        )


def resample_slots(curve: Sequence[float] | np.ndarray, n_slots: int) -> np.ndarray:
    """A slot-attention curve measured for ``len(curve)`` slots, linearly resampled to ``n_slots`` slots by
    relative position (slot centres), for placing a number of documents nobody calibrated for."""
    c = np.asarray(curve, dtype=np.float64)
    if n_slots < 1:
        raise InvalidInputError(f"n_slots must be >= 1, got {n_slots}")
    src = (np.arange(len(c)) + 0.5) / len(c)
    dst = (np.arange(n_slots) + 0.5) / n_slots
    return np.asarray(np.interp(dst, src, c), dtype=np.float64)


def reader_weights_for(
    store: ReaderProfileStore, reader: str, n_slots: int
) -> tuple[np.ndarray | None, str | None, str | None]:
    """The reader's slot weights to place ``n_slots`` documents with, the profile's description, and a note when
    it was resampled from another size; ``(None, None, None)`` when the reader has no profile."""
    exact = store.get(reader, n_slots)
    if exact is not None:
        return exact.slot_weight, exact.describe(), None
    sizes = store.available(reader)
    if not sizes:
        return None, None, None
    near = min(sizes, key=lambda n: (abs(n - n_slots), n))
    prof = store.get(reader, near)
    if prof is None:  # pragma: no cover - removed between listing and reading
        return None, None, None
    note = (
        f"calibrated placement: no reader profile of {reader} for {n_slots} documents; used its {near}-document "
        f"profile resampled to {n_slots} slots (`rag-opt calibrate --reader {reader} --n-docs {n_slots}` measures it)"
    )
    return resample_slots(prof.slot_weight, n_slots), f"{prof.describe()}, resampled to {n_slots}", note


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
