"""The *score* stage's contract: what every scorer takes (a :class:`~rag_opt.text.units.UnitTable`) and returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.models.extract import AttentionFeatures
    from rag_opt.text.units import UnitTable

__all__ = ["Scorer", "Scores"]


@dataclass
class Scores:
    """Relevance for the units of one context (one value per unit-table row) and for its documents."""

    unit: np.ndarray  # (n_units,)
    doc: np.ndarray  # (n_docs,)
    method: str  # e.g. "probe", "raw-attention", "bm25"
    model: str | None = None  # the proxy/embedding model used, if any
    attention: AttentionFeatures | None = None
    doc_raw: np.ndarray | None = None  # (n_docs,) document relevance before calibration (best unit score)
    calibrated: bool = False  # ``doc`` is position-calibrated (document probe over calibrated attention)
    calibration_note: str | None = None  # why ``doc`` is not calibrated, when it could have been
    # (n_units,) bool: the rows whose score is the lexical probe's (a lexical-tier decision: every row when the
    # lexical tier scored, the structured rows under the model tier); None: none
    lexical_rows: np.ndarray | None = None

    def scored_by(self, row: int) -> str:
        """What scored ``row``: the lexical probe for a lexical-tier decision, else :attr:`method`."""
        lexical = self.lexical_rows is not None and bool(self.lexical_rows[row])
        return "lexical-probe" if lexical else self.method


@runtime_checkable
class Scorer(Protocol):
    """Anything that scores the units of a context for a question."""

    def score(self, question: str, units: UnitTable) -> Scores: ...
