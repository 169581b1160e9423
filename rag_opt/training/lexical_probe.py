"""Training the lexical-tier probe (``rag-opt train-lexical-probe``): lexical features only, no forward pass.

Examples and labels are those of the attention probe (:mod:`rag_opt.training.sentence_probe`): HotpotQA
training questions, a sentence is positive when it is a supporting fact or contains the answer. Cheap enough to
use every training question. A *title mix* gives a share of the contexts without titles, or with the title as the
text's first line (:mod:`rag_opt.training.units`), so the probe learns to do without the title row.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from rag_opt.compressors.features import FeatureLayout, lexical_features
from rag_opt.compressors.lexical_scorer import LEXICAL_MODEL, word_counts
from rag_opt.compressors.probe import Probe
from rag_opt.errors import InvalidInputError
from rag_opt.text.units import UnitTable
from rag_opt.training.datasets import HotpotExample, read_hotpotqa
from rag_opt.training.logistic import choose_l2
from rag_opt.training.sentence_probe import fit_probe, regime_labels
from rag_opt.training.units import assign_title_regimes, hotpot_table

__all__ = ["LEXICAL_CONTEXT", "build_lexical_training_set", "train_lexical_probe"]

logger = logging.getLogger(__name__)

LAYOUT = FeatureLayout(("lexical",), 0, 0)
# the lexical tier's second stage, chosen like the attention probe's on HotpotQA dev questions 200-400 (its first
# stage differs, and so does the best company for the title links): recall 0.938 / answer kept 0.925 there, against
# 0.917 / 0.909 with the attention probe's choice (and 0.838 / 0.806 without a second stage)
LEXICAL_CONTEXT = ("own", "named_by_other", "names_other")


def build_lexical_training_set(
    examples: list[HotpotExample],
    *,
    progress: bool = True,
    tables: list[UnitTable] | None = None,
    regimes: Sequence[str] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(X, y, group) over the sentence units of every example (``tables``: a list to append their unit tables to,
    for the context stage; ``regimes``: each example's title regime, default ``field`` for all)."""
    from tqdm.auto import tqdm

    if regimes is not None and len(regimes) != len(examples):
        raise InvalidInputError(f"{len(regimes)} title regimes for {len(examples)} examples")
    xs, ys, gs = [], [], []
    for g, ex in enumerate(tqdm(examples, desc="lexical features", disable=not progress, mininterval=5.0)):
        regime = regimes[g] if regimes is not None else "field"
        units = hotpot_table(ex, regime)
        if tables is not None:
            tables.append(units)
        X = lexical_features(ex.question, units, word_counts(units))
        labels = regime_labels(ex, regime)
        xs.append(X[units.candidate])
        ys.append(labels[units.candidate])
        gs.append(np.full(int(units.candidate.sum()), g))
    if not xs:
        raise InvalidInputError("no training examples")
    return np.concatenate(xs), np.concatenate(ys).astype(np.float64), np.concatenate(gs)


def train_lexical_probe(
    data: str | Path,
    out: str | Path,
    *,
    limit: int | None = None,
    seed: int = 0,
    progress: bool = True,
    context: Sequence[str] | None = LEXICAL_CONTEXT,
    title_mix: Mapping[str, float] | None = None,
) -> Probe:
    """Train the lexical probe on HotpotQA ``data`` (JSONL(.gz)) and write it to ``out`` as JSON; ``context``: the
    second stage's features (None: none), as for the attention probe; ``title_mix``: the share of contexts in each
    title regime (:func:`rag_opt.training.units.parse_title_mix`; default: all ``field``)."""
    examples = read_hotpotqa(data, limit=limit, seed=seed)
    mix = dict(title_mix or {"field": 1.0})
    regimes = assign_title_regimes(len(examples), mix, seed)
    tables: list[UnitTable] = []
    X, y, groups = build_lexical_training_set(examples, progress=progress, tables=tables, regimes=regimes)
    l2, losses = choose_l2(X, y, groups, seed=seed)
    probe = fit_probe(
        X,
        y,
        LAYOUT,
        LEXICAL_MODEL,
        l2=l2,
        seed=seed,
        groups=groups,
        context=context,
        tables=tables,
        meta={
            "kind": "lexical tier (no model)",
            "trained_on": f"{Path(data).parent.name}/{Path(data).name}: {len(examples)} questions, {len(y)} sentences",
            "positives": int(y.sum()),
            "labels": "supporting facts + sentences containing the answer (yes/no answers mark no sentence)",
            "seed": seed,
            "l2": l2,
            "l2_heldout_logloss": {str(k): v for k, v in losses.items()},
            "length_feature": "log1p(words)",
            "context_stage": list(context or []),
            "title_mix": mix,
        },
    )
    probe.save(out)
    logger.info("lexical probe: %d questions, %d sentences, l2 %s -> %s", len(examples), len(y), l2, out)
    return probe
