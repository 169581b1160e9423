"""Document relevance: document-level features, the document probe, shipped calibration profiles, and the
calibrated scores and orderings of ``optimize()`` on real NQ passages with the embedded model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rag_opt.artifacts.position_profiles import PositionProfile, ProfileStore
from rag_opt.compressors.features import FeatureLayout, build_doc_features
from rag_opt.compressors.probe import Probe, shipped_probe
from rag_opt.errors import ProbeMismatchError, ProfileMismatchError
from rag_opt.models.extract import AttentionFeatures
from rag_opt.models.prompt import TEMPLATE_ID
from rag_opt.orderers import resample_slots, slot_attention_for
from rag_opt.training.doc_probe import grouped_recall

EMBEDDED = "embedded:smollm2-135m"


def _attn(n_docs=4, layers=3, heads=2, seed=0, windows=1):
    rng = np.random.default_rng(seed)
    mass = rng.random((n_docs, 2, layers, heads))
    mass /= mass.sum(0, keepdims=True)
    return AttentionFeatures(
        unit=np.ones((n_docs, 2, layers, heads)),
        doc_mass=mass,
        unit_tokens=np.ones(n_docs, dtype=np.int64),
        context_tokens=40,
        windows=windows,
    )


def test_document_layout_validation():
    lay = FeatureLayout(("doc_cal_last", "doc_lexical"), 3, 2, level="document")
    assert lay.size == 3 * 2 + 3
    with pytest.raises(ValueError, match="unknown document-level feature block"):
        FeatureLayout(("attn_last",), 3, 2, level="document")
    with pytest.raises(ValueError, match="unknown unit-level feature block"):
        FeatureLayout(("doc_cal_last",), 3, 2)
    with pytest.raises(ValueError, match="unknown feature level"):
        FeatureLayout(("doc_cal_last",), 3, 2, level="paragraph")


def test_doc_features_are_calibrated_shares_and_lexical():
    attn = _attn()
    base = _attn(seed=1).doc_mass
    texts = ["Paris\nParis is the capital of France.", "Berlin\nBerlin is in Germany.", "x\ny", "z\nw"]
    lay = FeatureLayout(("doc_cal_last", "doc_cal_question", "doc_raw_last", "doc_lexical"), 3, 2, level="document")
    X = build_doc_features(lay, attn, "What is the capital of France?", texts, base)
    assert X.shape == (4, lay.size)
    np.testing.assert_allclose(X[:, :6], ((attn.doc_mass[:, 0] - base[:, 0]) * 4).reshape(4, -1), rtol=1e-5)
    np.testing.assert_allclose(X[:, 6:12], ((attn.doc_mass[:, 1] - base[:, 1]) * 4).reshape(4, -1), rtol=1e-5)
    np.testing.assert_allclose(X[:, 12:18], np.log(attn.doc_mass[:, 0] * 4 + 1e-3).reshape(4, -1), rtol=1e-5)
    bm25_rel = X[:, 18]
    assert bm25_rel[0] == pytest.approx(1.0) and bm25_rel.argmax() == 0 and bm25_rel[2] == 0.0
    ratio = build_doc_features(FeatureLayout(("doc_ratio_question",), 3, 2, level="document"), attn, "q", texts, base)
    expected = np.log((attn.doc_mass[:, 1] * 4 + 1e-3) / (base[:, 1] * 4 + 1e-3)).reshape(4, -1)
    np.testing.assert_allclose(ratio, expected, rtol=1e-5)


def test_position_and_lexical_rank_blocks():
    attn = _attn()
    texts = ["x\ny", "Paris\nParis is the capital of France.", "z\nw", "France\nFrance is a country."]
    blocks = ("doc_lexical", "doc_lexical_rank", "doc_position", "doc_edge_lexical")
    lay = FeatureLayout(blocks, 3, 2, level="document")
    X = build_doc_features(lay, attn, "What is the capital of France?", texts, None)
    assert X.shape == (4, 3 + 2 + 3 + 10) == (4, lay.size)
    lexical, rank, position, edges = X[:, :3], X[:, 3:5], X[:, 5:8], X[:, 8:]
    assert rank[1].tolist() == [0.0, 1.0] and rank[3, 0] == pytest.approx(1 / 3)  # BM25 best, then second
    assert rank[:, 1].sum() == 1.0
    np.testing.assert_allclose(position, [[1, 0, 0], [0, 0, 1 / 3], [0, 0, 2 / 3], [0, 1, 1]], rtol=1e-6)
    # lexical × first slot, then lexical × last slot; zero in the middle slots
    np.testing.assert_allclose(edges[0, :5], np.concatenate([lexical[0], rank[0]]), rtol=1e-6)
    np.testing.assert_allclose(edges[3, 5:], np.concatenate([lexical[3], rank[3]]), rtol=1e-6)
    assert not edges[1:3].any() and not edges[0, 5:].any() and not edges[3, :5].any()


def test_doc_features_refuse_what_they_cannot_compute():
    lay = FeatureLayout(("doc_cal_last",), 3, 2, level="document")
    with pytest.raises(ValueError, match="needs a calibration profile"):
        build_doc_features(lay, _attn(), "q", ["a", "b", "c", "d"], None)
    with pytest.raises(ValueError, match="one forward pass"):
        build_doc_features(lay, _attn(windows=2), "q", ["a", "b", "c", "d"], _attn().doc_mass)
    with pytest.raises(ValueError, match="3 document texts"):
        build_doc_features(lay, _attn(), "q", ["a", "b", "c"], _attn().doc_mass)
    with pytest.raises(ValueError, match="does not match"):
        build_doc_features(lay, _attn(), "q", ["a", "b", "c", "d"], _attn(n_docs=5).doc_mass[:4, :, :2])
    with pytest.raises(ValueError, match="unit-level layout"):
        from rag_opt.compressors.features import build_features
        from rag_opt.text.units import UnitTable

        build_features(lay, _attn(), "q", UnitTable.from_texts([["a"]] * 4, [[True]] * 4))


def test_document_probe_round_trip(tmp_path):
    lay = FeatureLayout(("doc_cal_last", "doc_lexical"), 3, 2, level="document")
    d = lay.size
    p = Probe(EMBEDDED, lay, np.zeros(d), np.ones(d), np.arange(d, dtype=float), 0.5, {"template": TEMPLATE_ID})
    p.save(tmp_path / "p.json")
    back = Probe.load(tmp_path / "p.json")
    assert back.layout == lay and back.layout.level == "document"
    # probes written before levels existed are unit-level
    data = json.loads((tmp_path / "p.json").read_text())
    del data["layout"]["level"]
    data["layout"]["blocks"] = ["lexical"]
    data["mean"], data["scale"], data["weights"] = [0.0] * 8, [1.0] * 8, [0.0] * 8
    assert Probe.from_dict(data).layout.level == "unit"


def test_shipped_document_probe_and_profiles():
    probe = shipped_probe(EMBEDDED, "document")
    assert probe is not None and probe.layout.level == "document"
    from rag_opt.compressors.doc_relevance import DEFAULT_DOC_BLOCKS

    assert probe.layout.blocks == DEFAULT_DOC_BLOCKS  # the shipped probe is what train-doc-probe trains by default
    sentence = shipped_probe(EMBEDDED)
    assert sentence is not None and sentence.layout.level == "unit" and sentence.context is not None
    assert "nq_multidoc train split" in probe.metadata["trained_on"]


def test_shipped_profiles_are_found_after_the_users_own(tmp_path):
    store = ProfileStore(tmp_path)
    assert store.available(EMBEDDED) == [10, 20, 30]
    shipped = store.get(EMBEDDED, 20)
    assert shipped is not None and shipped.n_docs == 20 and shipped.contexts >= 20
    np.testing.assert_allclose(shipped.baseline.sum(0), 1.0, atol=1e-3)
    curve = shipped.slot_attention("last")
    assert curve[-1] > curve[len(curve) // 2] and curve[0] > curve[len(curve) // 2]  # the U-shape
    assert ProfileStore(tmp_path, shipped=False).get(EMBEDDED, 20) is None
    own = PositionProfile(EMBEDDED, TEMPLATE_ID, 20, np.full_like(shipped.baseline, 1 / 20), contexts=3)
    store.put(own)
    got = store.get(EMBEDDED, 20)
    assert got is not None and got.contexts == 3  # the user's profile wins
    assert store.available("other/model") == []


def test_resampled_slot_curve_for_an_uncalibrated_size(tmp_path):
    np.testing.assert_allclose(resample_slots([3.0, 1.0, 2.0], 3), [3.0, 1.0, 2.0])
    r = resample_slots([4.0, 0.0, 0.0, 4.0], 8)
    assert r[0] == r[-1] == 4.0 and r[3] == r[4] == 0.0
    curve, note = slot_attention_for(ProfileStore(tmp_path), EMBEDDED, 20)
    assert note is None and curve is not None and len(curve) == 20
    curve, note = slot_attention_for(ProfileStore(tmp_path), EMBEDDED, 12)
    assert curve is not None and len(curve) == 12 and note is not None and "10-document profile" in note
    curve, note = slot_attention_for(ProfileStore(tmp_path, shipped=False), EMBEDDED, 12)
    assert curve is None and note is not None and "end-placed" in note


def test_grouped_recall_counts_ties_against_gold():
    scores = np.array([0.9, 0.1, 0.5, 0.5, 0.5, 0.2])
    y = np.array([1, 0, 0, 0, 1, 0])
    groups = np.array([0, 0, 0, 1, 1, 1])
    assert grouped_recall(scores, y, groups, 1) == 0.5  # group 1: a tie with the gold document
    assert grouped_recall(scores, y, groups, 2) == 1.0


def test_profile_of_another_size_is_refused_for_document_relevance():
    from rag_opt.compressors.doc_relevance import document_relevance

    probe = shipped_probe(EMBEDDED, "document")
    assert probe is not None
    prof = ProfileStore(shipped=True).get(EMBEDDED, 10)
    assert prof is not None
    attn = _attn(n_docs=4, layers=30, heads=9)
    with pytest.raises(ProfileMismatchError, match="10 documents"):
        document_relevance(probe, attn, "q", [["a"], ["b"], ["c"], ["d"]], prof)
    other = PositionProfile("Qwen/Qwen2.5-0.5B-Instruct", TEMPLATE_ID, 4, np.full((4, 2, 30, 9), 0.25), contexts=1)
    with pytest.raises(ProfileMismatchError, match="Qwen"):
        document_relevance(probe, attn, "q", [["a"], ["b"], ["c"], ["d"]], other)


@pytest.mark.parametrize("ordering", ["calibrated", "attention_sort"])
def test_proxy_orderings_need_the_proxy(ordering):
    from rag_opt import ContextOptimizer
    from rag_opt.compressors import BM25Scorer

    opt = ContextOptimizer(scorer=BM25Scorer())
    with pytest.raises(ValueError, match="needs the proxy model's attention"):
        opt.optimize("who wrote it?", ["Ann wrote it.", "Bob read it."], ordering=ordering)


# -- with the embedded model on real NQ passages --------------------------------------------------------------


def _nq(n: int, split: str = "test"):
    from rag_opt.training.nq_contexts import nq_records
    from tests.helpers import data_path

    return nq_records(data_path("nq_multidoc", "public.jsonl.gz"), split)[:n]


def _docs(ex, n_docs: int, gold_at: int) -> list[dict]:
    return [{"title": d["title"], "text": d["text"]} for d in ex.documents(n_docs, gold_at)]


@pytest.fixture(scope="module")
def nq_result():
    from rag_opt import ContextOptimizer

    ex = _nq(1)[0]
    docs = _docs(ex, 10, 4)
    # Found-in-the-Middle calibration reads jointly; ratio 1: every document kept (ordering only)
    opt = ContextOptimizer(ordering="relevance", encoding="joint", ratio=1.0)
    return ex, docs, opt, opt.optimize(ex.question, docs)


@pytest.mark.model
def test_optimize_reports_calibrated_document_relevance(nq_result):
    from rag_opt import ContextOptimizer

    ex, docs, _, res = nq_result
    assert res.calibrated and res.scorer == "probe"
    assert [w for w in res.warnings if not w.startswith("nothing compressed")] == []  # ratio 1 says so, nothing else
    scores = [d.score for d in res.documents]
    assert all(s is not None and 0.0 < s < 1.0 for s in scores)
    assert scores == sorted(scores, reverse=True)  # relevance ordering follows the calibrated scores
    # without calibration the document score is the best sentence's score: the calibrated run's raw_score
    plain = ContextOptimizer(ordering="relevance", calibrate=False, encoding="joint", ratio=1.0).optimize(
        ex.question, docs
    )
    assert not plain.calibrated
    raw = {d.index: d.raw_score for d in res.documents}
    for d in plain.documents:
        assert d.score == pytest.approx(d.raw_score) == pytest.approx(raw[d.index], abs=1e-6)


@pytest.mark.model
def test_calibrated_ordering_fills_the_most_attended_slots_first(nq_result):
    ex, docs, opt, res = nq_result
    placed = opt.optimize(ex.question, docs, ordering="calibrated")
    assert placed.calibrated and not [w for w in placed.warnings if not w.startswith("nothing compressed")]
    curve = ProfileStore().get(EMBEDDED, 10).slot_attention("last")  # type: ignore[union-attr]
    slots_by_attention = sorted(range(10), key=lambda k: (-curve[k], -k))
    by_score = [d.index for d in res.documents]  # best first
    assert [placed.documents[k].index for k in slots_by_attention] == by_score


@pytest.mark.model
def test_uncalibrated_size_says_so():
    from rag_opt import optimize

    ex = _nq(1)[0]
    res = optimize(ex.question, _docs(ex, 3, 1), ordering="lost_in_the_middle", encoding="joint")
    assert not res.calibrated
    assert any("rag-opt calibrate --n-docs 3" in w for w in res.warnings)
    placed = optimize(ex.question, _docs(ex, 3, 1), ordering="calibrated")  # the default (parallel) encoding too
    # placed are the documents kept (the default budget may leave one with nothing)
    n = len(placed.documents)
    assert any(f"10-document profile resampled to {n} slots" in w for w in placed.warnings), placed.warnings


@pytest.mark.model
def test_attention_sort_ordering_through_optimize(nq_result):
    ex, docs, opt, _ = nq_result
    res = opt.optimize(ex.question, docs[:5], ordering="attention_sort")
    assert sorted(d.index for d in res.documents) == list(range(5)) and res.timings.order_ms > 0


@pytest.mark.model
def test_attention_sort_moves_gold_later_on_real_nq(proxy):
    """Over rounds, attention sorting (the model's retrieval heads) moves the gold passage later more often
    than earlier — on NQ test questions with the gold passage first or in the middle of 10."""
    from rag_opt.orderers import AttentionSort

    sorter = AttentionSort.tuned(proxy, rounds=2)
    assert sorter.head_pairs is not None  # retrieval heads ship with the embedded model
    later = earlier = 0
    for ex in _nq(6):
        for gold_at in (0, 4):
            docs = [f"{d['title']}\n{d['text']}" for d in ex.documents(10, gold_at)]
            perm = sorter.permutation(ex.question, docs)
            assert len(sorter.history) == 3 and sorted(perm) == list(range(10))
            final = perm.index(gold_at)
            later += final > gold_at
            earlier += final < gold_at
    assert later > earlier, (later, earlier)


@pytest.mark.model
def test_attention_sort_validates_its_head_choice(proxy):
    from rag_opt.orderers import AttentionSort

    with pytest.raises(ValueError, match="not both"):
        AttentionSort(proxy, layers=[0], head_pairs=[(0, 0)])
    with pytest.raises(ValueError, match="head_pairs"):
        AttentionSort(proxy, head_pairs=[(proxy.num_layers, 0)])
    with pytest.raises(ValueError, match="rounds"):
        AttentionSort(proxy, rounds=0)


def test_the_retrieval_heads_are_those_the_shipped_document_probe_carries() -> None:
    """Attention sorting reads them from the probe file's metadata (rag_opt.artifacts), not from a built probe."""
    from rag_opt.artifacts.shipped_probes import retrieval_heads

    heads = retrieval_heads(EMBEDDED)
    meta = shipped_probe(EMBEDDED, "document").metadata["attention_sort"]  # type: ignore[union-attr]
    assert heads is not None and heads.view == meta["view"]
    assert heads.head_pairs == tuple((int(a), int(b)) for a, b in meta["head_pairs"])
    assert retrieval_heads("no-such-model") is None


@pytest.mark.model
def test_train_doc_probe_command_end_to_end(tmp_path, capsys):
    from rag_opt.cli import main
    from rag_opt.compressors import SentinelCompressor
    from rag_opt.text.units import UnitTable
    from rag_opt.training.units import titled_units
    from tests.helpers import data_path

    data_path("nq_multidoc", "public.jsonl.gz")
    store = str(tmp_path / "profiles")
    assert main(["calibrate", "--n-docs", "4", "--contexts", "3", "--store", store]) == 0
    png = ProfileStore(store).path(EMBEDDED, 4).with_suffix(".png")
    assert png.stat().st_size > 1000  # the U-curve plot is written next to the profile by default
    out = str(tmp_path / "doc.json")
    args = ["train-doc-probe", "--n-docs", "4", "--limit", "12", "--cache", str(tmp_path / "f"), "--store", store]
    assert main([*args, "--out", out]) == 0
    assert "5-fold Recall@1" in capsys.readouterr().out
    probe = Probe.load(out)
    assert probe.layout.level == "document" and probe.metadata["questions"] == 12
    assert probe.metadata["attention_sort"]["view"] in ("last", "question")
    # the trained probe plugs into the scorer: 4 documents are calibrated with the profile built above
    ex = _nq(1)[0]
    units = titled_units(ex.documents(4, 2))
    sentinel = SentinelCompressor.from_model(doc_probe=out, profiles=store)
    sc = sentinel.score(ex.question, UnitTable.titled(units))
    assert sc.calibrated and sc.doc.shape == (4,) and sc.calibration_note is None
    # a second run reuses the cached features (no forward pass) and writes the same probe
    assert main([*args, "--out", str(tmp_path / "doc2.json")]) == 0
    np.testing.assert_allclose(Probe.load(tmp_path / "doc2.json").weights, probe.weights)
    assert main(["train-doc-probe", "--n-docs", "7", "--out", out, "--store", store, "--limit", "2"]) == 2
    assert "rag-opt calibrate --n-docs 7" in capsys.readouterr().err


@pytest.mark.model
def test_train_doc_probe_parallel_end_to_end(tmp_path, capsys):
    """Under parallel encoding the document probe needs no calibration profile, reads the same passages once for
    every N, is refused under the joint encoding, and scores documents the same in every slot."""
    from rag_opt.cli import main
    from rag_opt.compressors import SentinelCompressor
    from rag_opt.compressors.doc_relevance import PARALLEL_DOC_BLOCKS
    from rag_opt.errors import ProbeMismatchError
    from rag_opt.text.units import UnitTable
    from rag_opt.training.units import titled_units
    from tests.helpers import data_path

    data_path("nq_multidoc", "public.jsonl.gz")
    out = str(tmp_path / "doc.json")
    args = ["train-doc-probe", "--encoding", "parallel", "--n-docs", "3,5", "--limit", "8", "--layers", "4"]
    args += ["--cache", str(tmp_path / "f"), "--store", str(tmp_path / "no-profiles"), "--dtype", "float32"]
    assert main([*args, "--out", out]) == 0
    assert "5-fold Recall@1" in capsys.readouterr().out
    probe = Probe.load(out)
    assert probe.layout.blocks == PARALLEL_DOC_BLOCKS and probe.layout.num_layers == 4
    assert probe.metadata["encoding"] == "parallel" and probe.metadata["template"] == "ctx-q-par-v1"
    assert probe.metadata["questions"] == 8 and probe.metadata["contexts"] == 16  # 8 questions at 3 and at 5 docs
    assert set(probe.metadata["cv_5fold_per_n"]) == {"3", "5"}  # held-out recall at each N (folds by question)
    ex = _nq(1)[0]
    sentinel = SentinelCompressor.from_model(doc_probe=out, encoding="parallel", dtype="float32")
    a = sentinel.score(ex.question, UnitTable.titled(titled_units(ex.documents(4, 0))))
    b = sentinel.score(ex.question, UnitTable.titled(titled_units(ex.documents(4, 3))))
    assert not a.calibrated and a.doc.shape == (4,)
    np.testing.assert_allclose(a.doc[0], b.doc[3], rtol=1e-4)  # the gold passage scores alike in slots 1 and 4
    with pytest.raises(ProbeMismatchError):
        SentinelCompressor.from_model(doc_probe=out, encoding="joint", dtype="float32")
    blocks = ["--blocks", "doc_ratio_last,doc_lexical"]
    assert main([*args, *blocks, "--out", out, "--cached-only"]) == 2
    assert "calibration profile" in capsys.readouterr().err


@pytest.mark.model
def test_cli_calibrated_ordering_and_opt_out(tmp_path, capsys):
    from rag_opt.cli import main

    ex = _nq(1)[0]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in _docs(ex, 10, 9)))
    base = ["optimize", "-q", ex.question, "-i", str(path), "--ordering", "calibrated", "--json", "--encoding", "joint"]
    base += ["--ratio", "1"]  # every document kept: ordering only
    assert main(base) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["calibrated"] is True and out["ordering"] == "calibrated" and len(out["documents"]) == 10
    assert main([*base, "--no-calibrate"]) == 0
    assert json.loads(capsys.readouterr().out)["calibrated"] is False


@pytest.mark.model
def test_a_document_probe_reading_sentence_scores_needs_a_sentence_probe(proxy):
    from rag_opt.compressors import SentinelCompressor

    doc = shipped_probe(EMBEDDED, "document")
    assert doc is not None
    with pytest.raises(ProbeMismatchError, match="needs a sentence probe"):
        SentinelCompressor(proxy, probe=None, doc_probe=doc)
    # the shipped one ("auto") is left out instead: document relevance falls back to the best unit's score
    assert SentinelCompressor(proxy, probe=None).doc_probe is None
    assert SentinelCompressor(proxy).doc_probe is not None
