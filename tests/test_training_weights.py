"""Row weights in probe training: NQ rows can count more or less than HotpotQA rows (``train-probe --nq-weight``)."""

from __future__ import annotations

import numpy as np
import pytest

from rag_opt.errors import InvalidInputError
from rag_opt.training.logistic import choose_l2, cross_val_scores
from rag_opt.training.sentence_probe import train_probe_cli


def _conflicting_groups() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """400 rows of questions whose label follows x0 > 0, then 100 rows of other questions where it is x0 < 0."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(500, 3))
    b = np.arange(500) >= 400
    y = np.where(b, X[:, 0] < 0, X[:, 0] > 0).astype(float)
    groups = np.arange(500) // 5
    return X, y, groups, b


def test_weighted_rows_pull_the_held_out_fit_toward_them():
    X, y, groups, b = _conflicting_groups()
    plain = cross_val_scores(X, y, groups, l2=1e-3)
    weighted = cross_val_scores(X, y, groups, l2=1e-3, sample_weight=np.where(b, 10.0, 1.0))
    correct = lambda z: (z > 0) == (y > 0.5)  # noqa: E731
    assert correct(plain)[b].mean() < 0.2  # the 400 rows decide the unweighted fit
    assert correct(weighted)[b].mean() > 0.8  # ten times the weight: the 100 rows decide it
    assert np.array_equal(cross_val_scores(X, y, groups, l2=1e-3, sample_weight=np.ones(500)), plain)


def test_choose_l2_with_unit_weights_is_the_unweighted_choice_and_weights_change_the_losses():
    X, y, groups, b = _conflicting_groups()
    best, losses = choose_l2(X, y, groups)
    best_w, losses_w = choose_l2(X, y, groups, sample_weight=np.ones(500))
    assert best_w == best and losses_w == pytest.approx(losses, rel=1e-12)
    _, heavy = choose_l2(X, y, groups, sample_weight=np.where(b, 10.0, 1.0))
    assert heavy != pytest.approx(losses, rel=1e-3)


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), float("inf")])
def test_train_probe_refuses_a_weight_that_is_not_a_positive_number(weight):
    with pytest.raises(InvalidInputError, match="positive number"):
        train_probe_cli(
            data="unused", out="unused", model=None, limit=1, seed=0, cache_root="unused", l2=None, blocks=None,
            nq_limit=5, nq_data="unused", nq_weight=weight,
        )  # fmt: skip


def test_train_probe_cli_options_for_the_nq_weight_are_checked(capsys):
    from rag_opt.cli import main

    base = ["train-probe", "--out", "never.json", "--encoding", "parallel"]
    assert main([*base, "--nq-weight", "2"]) != 0  # no NQ contexts to weigh
    assert "--nq" in capsys.readouterr().err
    for bad in ("0", "-1", "nan", "x"):
        with pytest.raises(SystemExit):
            main([*base, "--nq", "5", "--nq-weight", bad])


@pytest.mark.model
def test_train_probe_weighs_real_nq_rows_and_records_the_weight(tmp_path):
    from rag_opt.cli import main
    from rag_opt.compressors.probe import Probe
    from tests.helpers import data_path

    hotpot = data_path("hotpotqa", "train.jsonl.gz")
    nq = data_path("nq_multidoc", "public.jsonl.gz")
    base = ["train-probe", "--data", str(hotpot), "--nq-data", str(nq), "--cache", str(tmp_path / "c")]
    base += ["--limit", "4", "--nq", "3", "--encoding", "parallel", "--layers", "2", "--l2", "0.01"]
    assert main([*base, "--out", str(tmp_path / "plain.json")]) == 0
    assert main([*base, "--out", str(tmp_path / "heavy.json"), "--nq-weight", "5", "--cached-only"]) == 0
    plain, heavy = Probe.load(tmp_path / "plain.json"), Probe.load(tmp_path / "heavy.json")
    assert "nq_weight" not in plain.metadata and heavy.metadata["nq_weight"] == 5.0
    assert plain.metadata["trained_on"] == heavy.metadata["trained_on"]  # the same rows, weighed otherwise
    assert not np.allclose(plain.weights, heavy.weights)
