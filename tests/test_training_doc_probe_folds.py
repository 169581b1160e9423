"""The document probe's held-out estimates split by question: one question read at several N never sits on both
sides of a fold (with contexts as the unit, a probe can recall a question's gold passage from its other reading)."""

from __future__ import annotations

import numpy as np

from rag_opt.training.doc_probe import DOC_L2_GRID, cross_validate


def _twice_read_questions(n_questions: int = 40, n_docs: int = 10, dim: int = 1000, seed: int = 0):
    """Each question's documents are random vectors (more dimensions than rows, so a probe can memorise them), read
    twice (two contexts, as at N=10 and N=20); the gold one is random, so only a probe that has seen the question's
    other context can find it."""
    rng = np.random.default_rng(seed)
    xs, ys, contexts, questions = [], [], [], []
    for q in range(n_questions):
        X = rng.normal(size=(n_docs, dim))
        y = np.zeros(n_docs)
        y[rng.integers(n_docs)] = 1.0
        for reading in range(2):
            xs.append(X + 0.01 * rng.normal(size=X.shape))
            ys.append(y)
            contexts.append(np.full(n_docs, 2 * q + reading))
            questions.append(np.full(n_docs, q))
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(contexts), np.concatenate(questions)


def test_folds_split_by_question_do_not_leak_a_question_read_twice() -> None:
    X, y, contexts, questions = _twice_read_questions()
    leaky = cross_validate(X, y, contexts, l2=1e-4)  # contexts as the unit: a question's twin is often trained on
    honest = cross_validate(X, y, contexts, l2=1e-4, split=questions)
    assert leaky["recall@1"] > 0.5  # memorised from the twin
    assert honest["recall@1"] < 0.3  # chance is 0.1: nothing to learn across questions


def test_the_l2_grid_reaches_below_the_sentence_probes() -> None:
    assert min(DOC_L2_GRID) < 1e-2 and list(DOC_L2_GRID) == sorted(DOC_L2_GRID)
