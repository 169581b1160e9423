from __future__ import annotations

import json

import numpy as np
import pytest

from rag_opt.artifacts.position_profiles import PositionProfile, ProfileStore
from rag_opt.errors import ProfileMismatchError
from rag_opt.models.prompt import TEMPLATE_ID
from rag_opt.orderers import CalibratedPlacement, OrderItem, end_placement, placement


def _profile(n=5, model="embedded:smollm2-135m", seed=0):
    rng = np.random.default_rng(seed)
    base = rng.random((n, 2, 3, 4))
    return PositionProfile(model=model, template=TEMPLATE_ID, n_docs=n, baseline=base / base.sum(0), contexts=7)


def test_store_round_trip_and_keying(tmp_path):
    store = ProfileStore(tmp_path)
    p = _profile()
    path = store.put(p)
    assert path.name == "embedded-smollm2-135m__" + TEMPLATE_ID + "__n5.json"
    got = store.get("embedded:smollm2-135m", 5)
    assert got is not None and np.allclose(got.baseline, p.baseline) and got.contexts == 7
    assert store.get("embedded:smollm2-135m", 6) is None  # another N: not cached
    assert store.get("other/model", 5) is None


def test_profile_for_another_model_or_n_is_refused(tmp_path):
    store = ProfileStore(tmp_path)
    p = _profile()
    store.put(p)
    # a file renamed to another key must not be used for that key
    src = store.path("embedded:smollm2-135m", 5)
    src.rename(store.path("embedded:smollm2-135m", 7))
    with pytest.raises(ProfileMismatchError, match="5 documents"):
        store.get("embedded:smollm2-135m", 7)
    with pytest.raises(ProfileMismatchError, match="model"):
        p.check("Qwen/Qwen2.5-0.5B-Instruct", 5)


def test_invalid_profile_file(tmp_path):
    store = ProfileStore(tmp_path)
    store.root.mkdir(parents=True, exist_ok=True)
    path = store.path("m", 3)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        store.get("m", 3)
    data = _profile(3, model="m").to_dict()
    data["baseline"] = data["baseline"][:-1]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="baseline has"):
        store.get("m", 3)


def test_calibrated_equals_raw_minus_profile():
    p = _profile()
    raw = np.random.default_rng(1).random(p.baseline.shape)
    np.testing.assert_allclose(p.calibrate(raw), raw - p.baseline)
    with pytest.raises(ProfileMismatchError):
        p.calibrate(raw[:4])


def test_placement_puts_best_documents_in_most_attended_slots():
    # U-shaped attention: slots 0 and 4 best, then 3, 1, 2
    att = [0.30, 0.15, 0.05, 0.20, 0.30]
    rel = [0.1, 0.9, 0.5, 0.7, 0.2]  # ranks: doc1 > doc3 > doc2 > doc4 > doc0
    perm = placement(rel, att)
    assert sorted(perm) == list(range(5))
    assert perm[4] == 1 and perm[0] == 3  # tie between slots 0 and 4: the later slot ranks first
    assert perm[3] == 2 and perm[1] == 4 and perm[2] == 0
    with pytest.raises(ValueError, match="3 slots"):
        placement([1, 2], [1, 2, 3])


def _items(scores):
    return [OrderItem(f"doc {i}", s) for i, s in enumerate(scores)]


def test_calibrated_placement_uses_the_profile_for_exactly_n_and_says_when_it_resamples(tmp_path):
    store = ProfileStore(tmp_path, shipped=False)
    p = _profile(4)
    store.put(p)
    cp = CalibratedPlacement(store, p.model)
    exact = cp.order("q", _items([0.1, 0.2, 0.3, 0.4]))
    assert exact.permutation == placement([0.1, 0.2, 0.3, 0.4], p.slot_attention("last").tolist())
    assert exact.warnings == []
    resampled = cp.order("q", _items([0.1, 0.5, 0.2, 0.3, 0.4]))
    assert sorted(resampled.permutation) == [0, 1, 2, 3, 4]
    assert len(resampled.warnings) == 1 and "rag-opt calibrate --n-docs 5" in resampled.warnings[0]


def test_calibrated_placement_without_a_profile_end_places_and_says_so(tmp_path):
    cp = CalibratedPlacement(ProfileStore(tmp_path, shipped=False), "embedded:smollm2-135m")
    got = cp.order("q", _items([0.1, 0.5, 0.2, 0.3]))
    assert got.permutation == end_placement([0.1, 0.5, 0.2, 0.3])
    assert len(got.warnings) == 1 and "end-placed" in got.warnings[0]


@pytest.mark.model
def test_calibrate_command_builds_caches_and_plots(tmp_path, capsys):
    from rag_opt.cli import main
    from tests.helpers import data_path

    data_path("nq_multidoc", "public.jsonl.gz")
    args = [
        "calibrate",
        "--n-docs",
        "3",
        "--contexts",
        "2",
        "--store",
        str(tmp_path),
        "--plot",
        str(tmp_path / "u.png"),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and (tmp_path / "u.png").stat().st_size > 1000
    profile = ProfileStore(tmp_path).get("embedded:smollm2-135m", 3)
    assert profile is not None and profile.contexts == 2
    # shares of the context's attention: each view/layer/head sums to one over the slots
    np.testing.assert_allclose(profile.baseline.sum(0), 1.0, atol=1e-4)
    assert main(args) == 0
    assert "using cached" in capsys.readouterr().out


def test_calibration_contexts_fill_up_beyond_one_records_distractors():
    from rag_opt.training.calibration import nq_calibration_contexts
    from tests.helpers import data_path

    path = data_path("nq_multidoc", "public.jsonl.gz")
    ctx = nq_calibration_contexts(30, 5, path)  # NQ records have at most 29 distractors
    assert len(ctx) == 5
    for docs, question in ctx:
        assert len(docs) == 30 == len(set(docs)) and question.strip()
    ten = nq_calibration_contexts(10, 3, path)
    assert [d[:10] for d, _ in ten] == [d[:10] for d, _ in ctx[:3]]  # the same records, their own distractors first
