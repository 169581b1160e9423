from __future__ import annotations

import json

import numpy as np
import pytest

from rag_opt.compressors.features import FeatureLayout
from rag_opt.compressors.probe import Probe, shipped_probe
from rag_opt.errors import ProbeMismatchError


def _probe(layers=30, heads=9, blocks=("attn_last", "lexical"), model="embedded:smollm2-135m"):
    layout = FeatureLayout(blocks, layers, heads)
    d = layout.size
    rng = np.random.default_rng(0)
    return Probe(model, layout, rng.random(d), rng.random(d) + 0.5, rng.standard_normal(d), 0.1, {"k": "v"})


def test_save_load_round_trip(tmp_path):
    p = _probe()
    p.save(tmp_path / "p.json")
    q = Probe.load(tmp_path / "p.json")
    assert q.model == p.model and q.layout == p.layout and q.metadata == {"k": "v"}
    X = np.random.default_rng(1).random((5, p.layout.size))
    np.testing.assert_allclose(q.predict_proba(X), p.predict_proba(X))


def test_layout_mismatch_is_refused(tmp_path):
    p = _probe(layers=24, heads=14)  # a probe for a Qwen2.5-0.5B-shaped model
    with pytest.raises(ProbeMismatchError, match="24 layers × 14 heads"):
        p.check_compatible("embedded:smollm2-135m", 30, 9)
    with pytest.raises(ProbeMismatchError, match="trained for proxy model"):
        _probe(model="other").check_compatible("embedded:smollm2-135m", 30, 9)
    with pytest.raises(ProbeMismatchError, match="expects"):
        p.predict_proba(np.zeros((2, 3)))
    old = _probe()
    old.metadata["template"] = "ctx-q-v1"
    with pytest.raises(ProbeMismatchError, match="prompt template"):
        old.check_compatible("embedded:smollm2-135m", 30, 9)


def test_invalid_probe_files(tmp_path):
    f = tmp_path / "p.json"
    f.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        Probe.load(f)
    data = _probe().to_dict()
    data["weights"] = data["weights"][:-1]
    f.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="weights has shape"):
        Probe.load(f)
    data = _probe().to_dict()
    data["layout"]["blocks"] = ["attn_everything"]
    f.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unknown unit-level feature block"):
        Probe.load(f)
    with pytest.raises(FileNotFoundError):
        Probe.load(tmp_path / "missing.json")


def test_shipped_probe_matches_the_embedded_model():
    p = shipped_probe("embedded:smollm2-135m")
    if p is None:
        pytest.skip("no probe shipped yet for the embedded model")
    p.check_compatible("embedded:smollm2-135m", 30, 9)
    assert "trained_on" in p.metadata and "hotpot" in p.metadata["trained_on"]


def test_shipped_qwen_probe_matches_its_architecture():
    p = shipped_probe("embedded:qwen2.5-coder-0.5b")
    assert p is not None
    p.check_compatible("embedded:qwen2.5-coder-0.5b", 24, 14)
    with pytest.raises(ProbeMismatchError):
        p.check_compatible("embedded:smollm2-135m", 30, 9)


@pytest.mark.model
def test_mismatched_probe_file_refused_by_the_compressor(proxy, tmp_path):
    from rag_opt.compressors import SentinelCompressor

    path = tmp_path / "qwen_probe.json"
    _probe(layers=24, heads=14, model="Qwen/Qwen2.5-0.5B-Instruct").save(path)
    with pytest.raises(ProbeMismatchError, match="24 layers × 14 heads"):
        SentinelCompressor(proxy, str(path))


@pytest.mark.model
def test_train_probe_command_on_real_hotpotqa(tmp_path):
    from rag_opt.cli import main
    from rag_opt.compressors.context_features import DEFAULT_CONTEXT
    from rag_opt.models.loader import load_proxy_model
    from rag_opt.training.sentence_probe import feature_store
    from tests.helpers import data_path

    data = data_path("hotpotqa", "train.jsonl.gz")
    out = tmp_path / "probe.json"
    args = ["train-probe", "--data", str(data), "--out", str(out), "--limit", "6", "--cache", str(tmp_path / "c")]
    assert main(args) == 0
    probe = Probe.load(out)
    assert probe.model == "embedded:smollm2-135m" and probe.layout.num_layers == 30
    assert "6 questions" in probe.metadata["trained_on"]
    assert probe.context is not None and probe.context.names == DEFAULT_CONTEXT  # the second stage, by default
    assert probe.layout.needs_cross  # the default blocks read cross-document attention: a cache of its own
    cache = feature_store(tmp_path / "c", load_proxy_model(), "train-cross").target  # at the default precision
    assert len(cache.ids()) == 6
    # a second run reuses the cached features: same probe, no new shard
    shards = cache.shards()
    assert main(args) == 0
    assert cache.shards() == shards
    np.testing.assert_allclose(Probe.load(out).weights, probe.weights)


@pytest.mark.model
def test_a_probe_with_cross_document_attention_trains_on_its_own_cache_and_runs(proxy, tmp_path):
    from rag_opt.cli import main
    from rag_opt.compressors import SentinelCompressor
    from rag_opt.models.loader import load_proxy_model
    from rag_opt.training.sentence_probe import feature_store
    from tests.helpers import data_path, hotpot_dev

    data = data_path("hotpotqa", "train.jsonl.gz")
    out = tmp_path / "probe.json"
    blocks = "attn_question,lexical,cross_doc"
    args = ["train-probe", "--data", str(data), "--out", str(out), "--limit", "5", "--cache", str(tmp_path / "c")]
    assert main([*args, "--blocks", blocks, "--layers", "4", "--context", "none"]) == 0
    probe = Probe.load(out)
    assert probe.layout.needs_cross and probe.layout.size == 4 * 9 + 8 + 4 * 9 + 1
    default = load_proxy_model()  # the command extracts at the default precision
    feats = feature_store(tmp_path / "c", default, "train-cross", 4).load()
    assert len(feats) == 5 and all(f.cross is not None for f in feats.values())  # a cache of its own
    plain_store = feature_store(tmp_path / "c", default, "train", 4)
    assert not plain_store.target.root.exists()  # written to a cache of its own, which also serves probes
    assert plain_store.ids() == set(feats)  # without the block: it holds the same features and more
    compressor = SentinelCompressor(proxy, probe, doc_probe=None)
    assert compressor.cross
    ex = hotpot_dev(1)[0]
    units = [[f"{t}\n", *s] for t, s in ex["context"]]
    from rag_opt.text.units import UnitTable

    table = UnitTable.from_texts(units, [[False] + [True] * (len(u) - 1) for u in units])
    scores = compressor.score(ex["question"], table)
    assert scores.attention is not None and scores.attention.cross is not None
    assert np.isfinite(scores.unit).all() and scores.unit.shape == (sum(len(u) for u in units),)
    # features without cross-document attention are refused by name, never scored with zeros
    from rag_opt.compressors.features import build_features
    from rag_opt.models.extract import extract

    plain = extract(proxy, units, ex["question"], layers=4)
    with pytest.raises(ProbeMismatchError, match="cross_doc"):
        build_features(probe.layout, plain, ex["question"], table)


@pytest.mark.model
def test_train_probe_cached_only_trains_on_what_is_cached_and_extracts_nothing(tmp_path, capsys):
    from rag_opt.cli import main
    from rag_opt.models.loader import load_proxy_model
    from rag_opt.training.sentence_probe import feature_store
    from tests.helpers import data_path

    data = data_path("hotpotqa", "train.jsonl.gz")
    out = tmp_path / "probe.json"
    base = ["train-probe", "--data", str(data), "--out", str(out), "--cache", str(tmp_path / "c")]
    base += ["--encoding", "parallel", "--layers", "2", "--context", "none"]
    assert main([*base, "--cached-only"]) != 0
    assert "no cached features" in capsys.readouterr().err
    assert main([*base, "--limit", "4"]) == 0  # an extraction that stopped after 4 questions
    # the default blocks are the shipped parallel probe's: with its cross-document reading (a store of its own)
    cache = feature_store(tmp_path / "c", load_proxy_model(), "train-cross", 2, "parallel").target
    shards = cache.shards()
    assert main([*base, "--limit", "8", "--cached-only"]) == 0
    assert cache.shards() == shards and len(cache.ids()) == 4  # nothing extracted
    assert "4 questions" in Probe.load(out).metadata["trained_on"]
    assert Probe.load(out).layout.blocks == shipped_probe("embedded:smollm2-135m", encoding="parallel").layout.blocks
