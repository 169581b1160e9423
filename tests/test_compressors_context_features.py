"""The second (context) stage of the sentence probe: features from first-stage logits, and its persistence."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rag_opt.compressors.context_features import CONTEXT_FEATURES, DEFAULT_CONTEXT, context_features
from rag_opt.compressors.features import FeatureLayout
from rag_opt.compressors.probe import FORMAT, FORMAT_CONTEXT, ContextStage, Probe
from rag_opt.errors import ProbeMismatchError
from rag_opt.text.units import UnitTable

# a bridge question: document 0 names "Blue Lagoon (film)"'s core title; document 1 is that film's page
DOCS = [
    ["Jean Simmons\n", "Jean Simmons was an English actress.", " She starred in Blue Lagoon in 1949."],
    ["Blue Lagoon (film)\n", "The Blue Lagoon is a 1949 British film.", " It was directed by Frank Launder."],
    ["Weather\n", "Rain fell all day.", " The wind was cold."],
]


def _table() -> UnitTable:
    return UnitTable.titled(DOCS)


def test_features_read_neighbours_ranks_and_title_links():
    units = _table()
    z = np.array([0, 3.0, 2.0, 0, 1.0, -1.0, 0, -2.0, -3.0])  # title rows are ignored
    F = context_features(z, units)
    col = {name: F[:, i] for i, name in enumerate(CONTEXT_FEATURES)}
    floor = -3.0
    # rows: 1, 2 (doc 0), 4, 5 (doc 1), 7, 8 (doc 2)
    np.testing.assert_allclose(col["own"][[1, 2, 4, 5, 7, 8]], [3, 2, 1, -1, -2, -3])
    np.testing.assert_allclose(col["prev"][[1, 2]], [floor, 3.0])
    np.testing.assert_allclose(col["next"][[1, 2]], [2.0, floor])
    np.testing.assert_allclose(col["doc_best_other"][[1, 2]], [2.0, 3.0])
    np.testing.assert_allclose(col["doc_rank"][[1, 4, 7]], [0.0, 0.5, 1.0])
    np.testing.assert_allclose(col["gap_to_top"][[1, 8]], [0.0, -6.0])
    np.testing.assert_allclose(col["rank_in_doc"][[1, 2]], [0.0, 1.0])
    # document 1 ("Blue Lagoon", without its "(film)") is named by row 2 of document 0 (logit 2.0)
    np.testing.assert_allclose(col["named_by_other"][[4, 5]], [2.0, 2.0])
    np.testing.assert_allclose(col["named_by_other"][[1, 7]], [floor, floor])
    # row 2 names document 1, whose best logit is 1.0; no other row names another document
    assert col["names_other"][2] == pytest.approx(1.0)
    assert col["names_other"][1] == pytest.approx(floor)
    assert not F[[0, 3, 6]].any()  # title rows: zeros


def test_features_without_titles_or_candidates():
    untitled = UnitTable.from_texts([["a b c.", "d e."], ["f g."]], [[True, True], [True]])
    F = context_features(np.array([1.0, 0.0, -1.0]), untitled, ("named_by_other", "names_other"))
    np.testing.assert_allclose(F, -1.0)  # no titles: nothing names anything
    only_titles = UnitTable.from_texts([["T\n"]], [[False]])
    assert context_features(np.zeros(1), only_titles).shape == (1, len(CONTEXT_FEATURES))
    with pytest.raises(ValueError, match="unknown context feature"):
        context_features(np.zeros(9), _table(), ("own", "nope"))
    with pytest.raises(ValueError, match="logits for 9 units"):
        context_features(np.zeros(3), _table())


def _probe(context: ContextStage | None) -> Probe:
    layout = FeatureLayout(("lexical",), 16, 9)
    d = layout.size
    rng = np.random.default_rng(0)
    return Probe("m", layout, rng.random(d), rng.random(d) + 0.5, rng.standard_normal(d), 0.1, context=context)


def test_context_stage_changes_scores_and_round_trips(tmp_path):
    names = ("own", "named_by_other", "rank_in_doc")
    stage = ContextStage(names, np.zeros(3), np.ones(3), np.array([1.0, 2.0, 0.5]), -0.2)
    with_stage, plain = _probe(stage), _probe(None)
    units = _table()
    X = np.random.default_rng(1).random((units.n_units, with_stage.layout.size))
    z = plain.decision(X)
    expected = 1 / (1 + np.exp(-(context_features(z, units, names) @ [1.0, 2.0, 0.5] - 0.2)))
    np.testing.assert_allclose(with_stage.unit_scores(X, units), expected)
    np.testing.assert_allclose(plain.unit_scores(X, units), plain.predict_proba(X))
    with_stage.save(tmp_path / "p.json")
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["format"] == FORMAT_CONTEXT and data["context"]["features"] == list(names)
    assert set(DEFAULT_CONTEXT) <= set(CONTEXT_FEATURES)
    np.testing.assert_allclose(Probe.load(tmp_path / "p.json").unit_scores(X, units), expected)
    plain.save(tmp_path / "q.json")
    assert json.loads((tmp_path / "q.json").read_text())["format"] == FORMAT


def test_inconsistent_context_stage_is_refused(tmp_path):
    stage = ContextStage(("own",), np.zeros(1), np.ones(1), np.ones(1), 0.0)
    data = _probe(stage).to_dict()
    data["format"] = FORMAT  # an old-format file must not carry a stage an old reader would ignore
    (tmp_path / "a.json").write_text(json.dumps(data))
    with pytest.raises(ProbeMismatchError, match="cannot carry a context stage"):
        Probe.load(tmp_path / "a.json")
    with pytest.raises(ProbeMismatchError, match="unknown or no features"):
        ContextStage(("bogus",), np.zeros(1), np.ones(1), np.ones(1), 0.0)
    with pytest.raises(ProbeMismatchError, match="shape"):
        ContextStage(("own", "prev"), np.zeros(1), np.ones(2), np.ones(2), 0.0)
