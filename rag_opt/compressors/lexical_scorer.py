"""The lexical tier: sentence relevance from BM25 and other lexical features through a small trained probe.

No model runs: it scores in milliseconds. rag-opt uses it when the proxy model is saturated, not loaded yet or
the request is too large for it (the server), or when asked (``ContextOptimizer(tier="lexical")``). The probe
is trained on the same HotpotQA training questions as the attention probe, on lexical features alone
(``rag-opt train-lexical-probe``), and shipped as ``rag_opt/probes/lexical.json``.
"""

from __future__ import annotations

import numpy as np

from rag_opt.compressors.base import Scores
from rag_opt.compressors.features import lexical_features
from rag_opt.compressors.probe import Probe, shipped_probe
from rag_opt.errors import ProbeMismatchError
from rag_opt.text.units import UnitTable

__all__ = ["LEXICAL_MODEL", "LexicalScorer", "word_counts"]

LEXICAL_MODEL = "lexical"
"""The ``model`` of a lexical probe: it reads no model, so it fits every proxy model."""


def word_counts(units: UnitTable) -> np.ndarray:
    """Whitespace-separated words per unit: the lexical probe's length feature (no tokenizer needed)."""
    return np.asarray([len(t.split()) for t in units.texts], dtype=np.int64)


class LexicalScorer:
    """Scores units with the lexical probe (BM25 of the unit and its document, term overlap, position, length).

    Args:
        probe: ``"auto"`` (the shipped lexical probe), a path, or a :class:`Probe` with the single ``lexical``
            block.
    """

    name = "lexical"

    def __init__(self, probe: Probe | str = "auto") -> None:
        loaded = (
            shipped_probe(LEXICAL_MODEL) if probe == "auto" else Probe.load(probe) if isinstance(probe, str) else probe
        )
        if loaded is None:
            raise ProbeMismatchError("no lexical probe is shipped with this rag-opt (rag_opt/probes/lexical.json)")
        if loaded.layout.blocks != ("lexical",) or loaded.model != LEXICAL_MODEL:
            raise ProbeMismatchError(
                f"a lexical probe has the single block 'lexical' and model {LEXICAL_MODEL!r}; this one has "
                f"{list(loaded.layout.blocks)} for {loaded.model!r}"
            )
        self.probe = loaded

    def score(self, question: str, units: UnitTable) -> Scores:
        feats = lexical_features(question, units, word_counts(units))
        unit = np.asarray(self.probe.unit_scores(feats, units), dtype=np.float64)
        every = np.ones(units.n_units, dtype=bool)
        return Scores(unit=unit, doc=units.doc_best(unit), method="lexical-probe", lexical_rows=every)
