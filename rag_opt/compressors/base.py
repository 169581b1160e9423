"""What every scorer returns, and the protocol the pipeline relies on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.attention import AttentionFeatures
    from rag_opt.features import ContextUnits


@dataclass
class Scores:
    """Relevance for the units of one context (all units, in prompt order) and for its documents."""

    unit: np.ndarray  # (n_units,)
    doc: np.ndarray  # (n_docs,)
    method: str  # e.g. "probe", "raw-attention", "bm25"
    model: str | None = None  # the proxy/embedding model used, if any
    attention: AttentionFeatures | None = None
    doc_raw: np.ndarray | None = None  # (n_docs,) document relevance before calibration (best unit score)
    calibrated: bool = False  # ``doc`` is position-calibrated (document probe over calibrated attention)
    calibration_note: str | None = None  # why ``doc`` is not calibrated, when it could have been


class Scorer(Protocol):
    """Anything that scores the units of a context for a question."""

    def score(self, question: str, units: ContextUnits) -> Scores: ...


def doc_scores_from_units(unit: np.ndarray, units: ContextUnits) -> np.ndarray:
    """A document's relevance: the best score among its candidate units (0 when it has none)."""
    doc = np.full(len(units.docs), -np.inf)
    k = 0
    for d, cands in enumerate(units.candidate):
        for c in cands:
            if c:
                doc[d] = max(doc[d], unit[k])
            k += 1
    doc[~np.isfinite(doc)] = 0.0
    return doc
