"""Sentence-probe training examples from the NQ multi-document train split (single-hop Wikipedia passages).

HotpotQA's supporting facts teach multi-hop evidence; NQ adds single-hop questions over Wikipedia passages
unlike HotpotQA's: in each context (the gold passage among BM25 distractors, ``rag_opt.training.doc_probe``),
the sentences of the gold passage that contain one of the answers are the positives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from rag_opt.compressors.features import FeatureLayout
from rag_opt.errors import InvalidInputError
from rag_opt.models.extract import AttentionFeatures
from rag_opt.training.nq_contexts import NQInstance

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.text.units import UnitTable

__all__ = ["build_nq_training_set", "nq_unit_labels"]


def nq_unit_labels(inst: NQInstance) -> list[list[bool]]:
    """Per document, per unit of an NQ context: a sentence of the gold passage that contains one of the answers
    is positive; every other unit (titles, the gold passage's other sentences, distractors — which contain no
    answer by construction) is negative."""
    from rag_opt.training.datasets import contains_answer

    answers = inst.example.answers
    return [
        [d == inst.gold_at and k > 0 and any(contains_answer(u, a) for a in answers) for k, u in enumerate(doc)]
        for d, doc in enumerate(inst.units())
    ]


def build_nq_training_set(
    instances: Sequence[NQInstance],
    features: dict[str, AttentionFeatures],
    layout: FeatureLayout,
    *,
    group_offset: int = 0,
    tables: list[UnitTable] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(X, y, group) over the sentence units of the NQ contexts with cached features (``tables``: as in
    :func:`rag_opt.training.sentence_probe.build_training_set`). Contexts whose gold
    passage has no sentence containing an answer are skipped (nothing to learn from them); groups are numbered
    from ``group_offset`` so they can be appended to HotpotQA's."""
    from rag_opt.compressors.features import build_features
    from rag_opt.text.units import UnitTable

    xs, ys, gs = [], [], []
    for g, inst in enumerate(instances):
        attn = features.get(inst.id)
        if attn is None:
            continue
        labels = np.concatenate(nq_unit_labels(inst))
        if not labels.any():
            continue
        units = UnitTable.titled(inst.units())
        if tables is not None:
            tables.append(units)
        X = build_features(layout, attn, inst.example.question, units)
        cand = units.candidate
        xs.append(X[cand])
        ys.append(labels[cand])
        gs.append(np.full(int(cand.sum()), group_offset + g))
    if not xs:
        raise InvalidInputError("no cached features for any NQ training context with an answer sentence")
    return np.concatenate(xs), np.concatenate(ys).astype(np.float64), np.concatenate(gs)
