"""NQ answer sentences as sentence-probe training examples (real NQ multi-document data)."""

from __future__ import annotations

import numpy as np

from rag_opt.compressors.features import FeatureLayout
from rag_opt.models.extract import AttentionFeatures
from rag_opt.training.datasets import contains_answer
from rag_opt.training.nq_contexts import nq_records, random_positions
from rag_opt.training.nq_sentences import build_nq_training_set, nq_unit_labels
from tests.helpers import data_path


def _instances(n: int = 12):
    return random_positions(nq_records(data_path("nq_multidoc", "public.jsonl.gz"), "train")[:n], 5, seed=0)


def test_positives_are_answer_sentences_of_the_gold_passage_only():
    with_positive = 0
    for inst in _instances():
        labels, units = nq_unit_labels(inst), inst.units()
        assert [len(x) for x in labels] == [len(u) for u in units]
        for d, (doc_labels, doc_units) in enumerate(zip(labels, units, strict=True)):
            assert not doc_labels[0]  # the title line is never an example
            for lab, unit in zip(doc_labels, doc_units, strict=True):
                has_answer = any(contains_answer(unit, a) for a in inst.example.answers)
                assert lab == (d == inst.gold_at and has_answer and unit is not doc_units[0])
        with_positive += any(any(x) for x in labels)
    assert with_positive >= 6  # most gold passages state the answer in a sentence


def test_training_rows_follow_the_candidates_and_skip_contexts_without_positives():
    instances = _instances()
    layout = FeatureLayout(("attn_last", "lexical"), 2, 3)
    feats = {}
    for inst in instances:
        n_units = sum(len(u) for u in inst.units())
        rng = np.random.default_rng(0)
        feats[inst.id] = AttentionFeatures(
            unit=rng.random((n_units, 2, 2, 3)),
            doc_mass=rng.random((5, 2, 2, 3)),
            unit_tokens=np.full(n_units, 5),
            context_tokens=100,
            windows=1,
        )
    tables: list = []
    X, y, g = build_nq_training_set(instances, feats, layout, group_offset=100, tables=tables)
    used = [i for i in instances if any(any(x) for x in nq_unit_labels(i))]
    assert len(tables) == len(used) and len(np.unique(g)) == len(used) and g.min() >= 100
    assert X.shape == (len(y), layout.size) and len(y) == sum(int(t.candidate.sum()) for t in tables)
    assert y.sum() == sum(sum(sum(x) for x in nq_unit_labels(i)) for i in used)
