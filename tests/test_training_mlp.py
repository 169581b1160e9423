"""A first stage with one hidden layer: fitting (rag_opt.training.mlp), the probe format that carries it, the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rag_opt.compressors.features import FeatureLayout
from rag_opt.compressors.probe import (
    FORMAT_CONTEXT,
    FORMAT_HIDDEN,
    FORMAT_HIDDEN_LINEAR,
    ContextStage,
    HiddenLayer,
    Probe,
    gelu_tanh,
)
from rag_opt.errors import InvalidInputError, ProbeMismatchError
from rag_opt.training.logistic import train_logistic
from rag_opt.training.mlp import MLPConfig, cross_val_mlp_scores, train_mlp


def _hidden_probe(units=5, context=False, linear=False):
    layout = FeatureLayout(("attn_last", "lexical"), 2, 9)
    d = layout.size
    rng = np.random.default_rng(0)
    around = np.where(np.arange(d) >= 18, rng.standard_normal(d), 0.0) if linear else None
    stage = ContextStage(("own", "named_by_other"), np.zeros(2), np.ones(2), np.array([1.0, 0.5]), -1.0)
    return Probe(
        "embedded:smollm2-135m",
        layout,
        rng.random(d),
        rng.random(d) + 0.5,
        rng.standard_normal(units),
        0.1,
        {"k": "v"},
        context=stage if context else None,
        hidden=HiddenLayer(rng.standard_normal((units, d)), rng.standard_normal(units), linear=around),
    )


def _xor(n=4000, seed=0):
    """Two informative features whose product decides the label (no linear model can), plus noise features."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, 6))
    y = ((X[:, 0] * X[:, 1]) > 0).astype(np.float64)
    return X, y


def _accuracy(z, y):
    return float(np.mean((z > 0) == (y > 0.5)))


@pytest.mark.parametrize("context", [False, True])
def test_a_hidden_layer_probe_round_trips_and_computes_its_network(tmp_path, context):
    p = _hidden_probe(context=context)
    p.save(tmp_path / "p.json")
    raw = json.loads((tmp_path / "p.json").read_text())
    assert raw["format"] == FORMAT_HIDDEN and ("context" in raw) == context
    q = Probe.load(tmp_path / "p.json")
    assert q.hidden is not None and q.hidden.units == 5 and (q.context is not None) == context
    X = np.random.default_rng(1).random((7, p.layout.size))
    expected = gelu_tanh(((X - p.mean) / p.scale) @ p.hidden.weights.T + p.hidden.bias) @ p.weights + p.bias
    np.testing.assert_allclose(p.decision(X), expected)
    np.testing.assert_allclose(q.decision(X), expected, rtol=1e-5, atol=1e-5)  # written to 7 significant digits


@pytest.mark.parametrize("context", [False, True])
def test_features_passed_around_the_hidden_layer_round_trip_and_add_to_the_logit(tmp_path, context):
    p = _hidden_probe(context=context, linear=True)
    p.save(tmp_path / "p.json")
    raw = json.loads((tmp_path / "p.json").read_text())
    assert raw["format"] == FORMAT_HIDDEN_LINEAR and len(raw["hidden"]["linear"]) == p.layout.size
    q = Probe.load(tmp_path / "p.json")
    assert q.hidden is not None and q.hidden.linear is not None
    X = np.random.default_rng(1).random((7, p.layout.size))
    z = (X - p.mean) / p.scale
    expected = gelu_tanh(z @ p.hidden.weights.T + p.hidden.bias) @ p.weights + z @ p.hidden.linear + p.bias
    np.testing.assert_allclose(p.decision(X), expected)
    np.testing.assert_allclose(q.decision(X), expected, rtol=1e-5, atol=1e-5)


def test_gelu_tanh_is_torchs():
    import torch

    x = np.linspace(-6, 6, 101)
    np.testing.assert_allclose(
        gelu_tanh(x), torch.nn.GELU(approximate="tanh")(torch.tensor(x)).numpy(), rtol=1e-12, atol=1e-12
    )


def test_malformed_hidden_layers_are_refused(tmp_path):
    f = tmp_path / "p.json"
    good = _hidden_probe().to_dict()

    def refused(data, match):
        f.write_text(json.dumps(data))
        with pytest.raises(ProbeMismatchError, match=match):
            Probe.load(f)

    with_context = _hidden_probe(context=True).to_dict()
    refused({**with_context, "format": FORMAT_CONTEXT}, "cannot carry a hidden layer")
    refused({k: v for k, v in good.items() if k != "hidden"}, "needs a hidden layer")
    refused({**good, "hidden": {**good["hidden"], "activation": "relu"}}, "activation 'relu'")
    refused({**good, "hidden": {**good["hidden"], "bias": good["hidden"]["bias"][:-1]}}, "hidden bias has shape")
    refused({**good, "weights": good["weights"][:-1]}, "the hidden layer needs")
    narrow = [row[:-1] for row in good["hidden"]["weights"]]
    refused({**good, "hidden": {**good["hidden"], "weights": narrow}}, "hidden layer reads")
    bad = [[float("nan")] * len(good["hidden"]["weights"][0])] + good["hidden"]["weights"][1:]
    refused({**good, "hidden": {**good["hidden"], "weights": bad}}, "non-finite")
    # linear weights around the network: only in format /4 (an older reader would ignore them), of the right shape
    around = _hidden_probe(linear=True).to_dict()
    refused({**around, "format": FORMAT_HIDDEN}, "cannot carry linear weights")
    refused({**good, "format": FORMAT_HIDDEN_LINEAR}, "needs linear weights")
    refused({**around, "hidden": {**around["hidden"], "linear": around["hidden"]["linear"][:-1]}}, "linear weights")
    nan = [float("nan")] + around["hidden"]["linear"][1:]
    refused({**around, "hidden": {**around["hidden"], "linear": nan}}, "non-finite")


def test_a_hidden_layer_learns_what_a_logistic_first_stage_cannot():
    X, y = _xor()
    Xt, yt = _xor(seed=1)
    mean, scale, w, b = train_logistic(X, y, l2=1e-3)
    linear = _accuracy(((Xt - mean) / scale) @ w + b, yt)
    net = train_mlp(X, y, MLPConfig(hidden=16, members=1, epochs=30, learning_rate=1e-2, dropout=0.0))
    assert linear < 0.6 and _accuracy(net.decision(Xt), yt) > 0.9


def test_members_merge_into_one_network_that_averages_them():
    X, y = _xor(1000)
    config = MLPConfig(hidden=8, members=2, epochs=3)
    merged = train_mlp(X, y, config, seed=5)
    one = MLPConfig(hidden=8, members=1, epochs=3)
    a, b = train_mlp(X, y, one, seed=5), train_mlp(X, y, one, seed=6)
    assert merged.hidden_weights.shape == (16, 6) and merged.weights.shape == (16,)
    np.testing.assert_allclose(merged.decision(X), (a.decision(X) + b.decision(X)) / 2, rtol=1e-9, atol=1e-9)
    again = train_mlp(X, y, config, seed=5)  # deterministic for a seed
    np.testing.assert_array_equal(again.hidden_weights, merged.hidden_weights)


def test_features_passed_around_the_network_count_linearly_and_the_hidden_layer_ignores_them():
    X, y = _xor(2000)
    rng = np.random.default_rng(3)
    X[:, 5] = rng.standard_normal(len(y)) + 1.5 * y  # a feature that moves the odds the same way everywhere
    config = MLPConfig(hidden=8, members=2, epochs=30, learning_rate=1e-2)
    net = train_mlp(X, y, config, linear_columns=[5])
    assert net.linear is not None and np.count_nonzero(net.linear) == 1 and net.linear[5] > 0
    assert not net.hidden_weights[:, 5].any()
    # far outside its training range the feature still adds exactly its weight per unit (no saturation)
    far = X[:50].copy()
    base = net.decision(far)
    far[:, 5] += 40.0
    np.testing.assert_allclose(net.decision(far) - base, 40.0 * net.linear[5] / net.scale[5], rtol=1e-9)
    assert train_mlp(X, y, config).linear is None
    with pytest.raises(InvalidInputError, match="linear feature columns"):
        train_mlp(X, y, config, linear_columns=[6])


def test_held_out_scores_come_from_networks_that_never_saw_their_rows():
    X, y = _xor(3000)
    groups = np.arange(len(y)) // 10
    config = MLPConfig(hidden=16, members=1, epochs=30, learning_rate=1e-2, dropout=0.0)
    held = cross_val_mlp_scores(X, y, groups, config)
    assert held.shape == y.shape and 0.85 < _accuracy(held, y)
    y_shuffled = np.random.default_rng(0).permutation(y)  # labels no network can predict for unseen rows
    assert _accuracy(cross_val_mlp_scores(X, y_shuffled, groups, config), y_shuffled) < 0.6


def test_bad_training_input_is_refused():
    X, y = _xor(100)
    with pytest.raises(InvalidInputError, match="single class"):
        train_mlp(X, np.zeros(100))
    with pytest.raises(InvalidInputError, match="sample weights"):
        train_mlp(X, y, sample_weight=np.ones(3))
    with pytest.raises(InvalidInputError, match="dropout"):
        MLPConfig(dropout=1.0)
    with pytest.raises(InvalidInputError, match="positive"):
        MLPConfig(hidden=0)


def test_train_probe_options_that_contradict_each_other_are_refused(capsys):
    from rag_opt.cli import main

    base = ["train-probe", "--out", "never.json", "--encoding", "parallel"]
    assert main([*base, "--hidden", "8", "--l2", "0.01"]) != 0
    assert "drop --hidden" in capsys.readouterr().err
    assert main([*base, "--members", "2"]) != 0  # the default first stage is logistic
    assert "--members" in capsys.readouterr().err
    assert main([*base, "--linear-blocks", "lexical"]) != 0
    assert "--linear-blocks passes features around a hidden layer" in capsys.readouterr().err
    assert main([*base, "--hidden", "8", "--linear-blocks", "lexicon"]) != 0
    assert "'lexicon'" in capsys.readouterr().err


def test_blocks_to_pass_around_the_network_must_be_in_the_layout():
    from rag_opt.training.sentence_probe import fit_probe

    X, y = _xor(200)
    layout = FeatureLayout(("lexical",), 1, 9)
    X = np.concatenate([X, X[:, :2]], axis=1)  # the lexical block's 8 columns
    with pytest.raises(InvalidInputError, match="'cross_doc'.*not in the layout"):
        fit_probe(X, y, layout, "m", l2=0.0, seed=0, meta={}, mlp=MLPConfig(hidden=4, linear_blocks=("cross_doc",)))
    np.testing.assert_array_equal(FeatureLayout(("attn_last", "lexical"), 2, 9).columns(["lexical"]), range(18, 26))


@pytest.mark.model
def test_train_probe_fits_a_hidden_layer_on_real_hotpotqa_and_the_compressor_runs_it(proxy, tmp_path):
    from rag_opt.cli import main
    from rag_opt.compressors import SentinelCompressor
    from rag_opt.pipeline import ContextOptimizer
    from tests.helpers import data_path, hotpot_dev, hotpot_docs

    data = data_path("hotpotqa", "train.jsonl.gz")
    out = tmp_path / "probe.json"
    args = ["train-probe", "--data", str(data), "--out", str(out), "--cache", str(tmp_path / "c"), "--limit", "6"]
    args += ["--encoding", "parallel", "--layers", "2", "--hidden", "8", "--members", "2"]
    assert main(args) == 0
    probe = Probe.load(out)
    assert probe.hidden is not None and probe.hidden.units == 16 and probe.context is not None
    assert probe.metadata["first_stage"]["kind"] == "mlp" and "l2" not in probe.metadata
    # by default the lexical block goes around the network: linear weights there, none in the hidden layer
    lexical = probe.layout.columns(["lexical"])
    assert probe.metadata["first_stage"]["linear_blocks"] == ["lexical"] and probe.hidden.linear is not None
    assert np.count_nonzero(probe.hidden.linear[lexical]) > 0 and np.delete(probe.hidden.linear, lexical).sum() == 0
    assert not probe.hidden.weights[:, lexical].any()
    compressor = SentinelCompressor(proxy, probe, doc_probe=None, encoding="parallel")
    ex = hotpot_dev(1)[0]
    result = ContextOptimizer(scorer=compressor).optimize(ex["question"], hotpot_docs(ex), ratio=1 / 3)
    assert 0 < result.tokens_after < result.tokens_before
    # a network is sure of rows it never saw alike: the records' lexical match still decides which one is kept
    from tests.helpers import RECORDS_JSON

    lookup = ContextOptimizer(scorer=compressor).optimize(
        "What is the stock of item 42?", [RECORDS_JSON], target_tokens=10
    )
    kept = [RECORDS_JSON[u.start : u.end] for d in lookup.documents for u in d.units if u.kept]
    assert any('"id": 42,' in unit for unit in kept), kept
