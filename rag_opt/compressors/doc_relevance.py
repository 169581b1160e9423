"""Document relevance from the same proxy forward pass as the sentence scores, calibrated for position bias.

The final token's attention to a document, averaged over the small proxy's heads, mostly measures *where* the
document sits (recency), not whether it answers the question. rag-opt therefore

1. subtracts, per layer, head and slot, the attention share a non-relevant document receives in that slot
   (the calibration profile, :mod:`rag_opt.artifacts.position_profiles`: "found in the middle" applied per head;
   in log space, i.e. the log ratio of the two shares, which measured more accurate and more even across slots than
   the plain difference — ``benchmarks/ablations/doc_probe_ablation.py``), and
2. feeds those calibrated per-head features (final-token and question-token views; lexical features are an
   option, ``doc_lexical``) to a logistic-regression *document probe* trained on NQ questions set aside for
   training (``rag-opt train-doc-probe``).

No extra forward pass is needed: the attention comes from the sentence scorer's pass. Calibration needs the
whole context in one window and a profile for the number of documents; otherwise the caller falls back to the
best sentence score per document and reports the scores as uncalibrated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from rag_opt.compressors.features import build_doc_features
from rag_opt.errors import ProbeMismatchError

__all__ = ["DEFAULT_DOC_BLOCKS", "PARALLEL_DOC_BLOCKS", "document_relevance"]

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.artifacts.position_profiles import PositionProfile
    from rag_opt.compressors.probe import Probe
    from rag_opt.models.extract import AttentionFeatures

# position-calibrated attention (the log ratio: the best Recall@3 and the most even across gold positions in
# 5-fold cross-validation on the NQ train split, benchmarks/ablations/doc_probe_ablation.py), plus — for the first
# slots, where the attention share says least — BM25 and its rank, the slot, and the sentence probe's best sentence,
# also as interactions with the first slot and with earliness. Chosen on benchmarks/position.py: at 20 documents the
# gold passage in slot 1 went from Recall@3 0.50 to 0.73 (BM25 0.70), the other slots unchanged or better.
DEFAULT_DOC_BLOCKS = (
    "doc_ratio_last",
    "doc_ratio_question",
    "doc_lexical",
    "doc_lexical_rank",
    "doc_position",
    "doc_edge_lexical",
    "doc_best_sentence",
    "doc_early_interactions",
)

# under parallel encoding a document's attention share does not depend on its slot, so there is nothing to
# calibrate and nothing position-specific to learn: the raw per-head shares, BM25 and its rank, and the sentence
# probe's best sentence (``rag-opt train-doc-probe --encoding parallel``)
PARALLEL_DOC_BLOCKS = ("doc_raw_last", "doc_raw_question", "doc_lexical", "doc_lexical_rank", "doc_best_sentence")


def document_relevance(
    probe: Probe,
    attn: AttentionFeatures,
    question: str,
    doc_units: Sequence[Sequence[str]],
    profile: PositionProfile | None,
    language: str = "en",
    best_sentence: np.ndarray | None = None,
) -> np.ndarray:
    """Probability that each document (in prompt order) is relevant, from calibrated per-head attention.

    ``doc_units`` are the documents as rendered (unit strings, concatenated verbatim). ``profile`` must be the
    calibration profile of the proxy model for exactly ``len(doc_units)`` documents when the probe uses
    calibrated blocks. ``language`` chooses the stopwords of lexical features. ``best_sentence``: the sentence
    probe's best logit per document, for probes with the ``doc_best_sentence`` block.
    """
    if probe.layout.level != "document":
        raise ProbeMismatchError(f"document_relevance needs a document-level probe, got level {probe.layout.level!r}")
    n = len(doc_units)
    baseline = None
    if profile is not None:
        # the profile must be the probe model's, for exactly these many documents (raises a clear error)
        profile.check(probe.model, n, profile.template)
        baseline = profile.baseline
    texts = ["".join(d) for d in doc_units]
    X = build_doc_features(probe.layout, attn, question, texts, baseline, language, best_sentence)
    return np.asarray(probe.predict_proba(X), dtype=np.float64)
