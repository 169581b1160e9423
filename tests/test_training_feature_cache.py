"""The feature cache's shard writes: atomic and collision-free, also with several writers at once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

from rag_opt.models.extract import AttentionFeatures
from rag_opt.training.feature_cache import CachedExample, FeatureCache

ROOT = Path(__file__).resolve().parents[1]


def _example(ex_id: str, seed: int) -> CachedExample:
    rng = np.random.default_rng(seed)
    n_units, n_docs = 3 + seed % 4, 2
    return CachedExample(
        ex_id,
        AttentionFeatures(
            unit=rng.random((n_units, 2, 3, 2)).astype(np.float32),
            doc_mass=rng.random((n_docs, 2, 3, 2)).astype(np.float32),
            unit_tokens=np.arange(n_units, dtype=np.int64),
            context_tokens=10 + seed,
            windows=1,
        ),
    )


def test_a_shard_round_trips_and_leaves_no_temporary_file(tmp_path):
    cache = FeatureCache(tmp_path)
    items = [_example("a", 1), _example("b", 2)]
    path = cache.write_shard(items)
    assert path.name == "shard-00000.npz"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-00000.npz"]
    loaded = cache.load()
    for it in items:
        got = loaded[it.id]
        assert np.allclose(got.unit, it.features.unit, atol=1e-3)
        assert np.array_equal(got.unit_tokens, it.features.unit_tokens)
        assert got.context_tokens == it.features.context_tokens


def _with_cross(item: CachedExample, seed: int) -> CachedExample:
    f = item.features
    rng = np.random.default_rng(seed)
    n = f.unit.shape[0]
    cross = AttentionFeatures(
        f.unit, f.doc_mass, f.unit_tokens, f.context_tokens, f.windows, rng.random((n, 3, 2)), np.arange(n)[::-1]
    )
    return CachedExample(item.id, cross)


def test_cross_document_attention_round_trips_and_a_shard_never_mixes(tmp_path):
    import pytest

    cache = FeatureCache(tmp_path)
    items = [_with_cross(_example("a", 1), 1), _with_cross(_example("b", 2), 2)]
    cache.write_shard(items)
    cache.write_shard([_example("c", 3)])
    loaded = cache.load()
    for it in items:
        got = loaded[it.id]
        assert got.cross is not None and got.cross_sources is not None
        assert np.allclose(got.cross, it.features.cross, atol=1e-3)
        assert np.array_equal(got.cross_sources, it.features.cross_sources)
    assert loaded["c"].cross is None and loaded["c"].cross_sources is None
    with pytest.raises(ValueError, match="mixes examples with and without cross-document attention"):
        cache.write_shard([items[0], _example("d", 4)])


def test_a_stale_view_of_the_folder_never_overwrites_a_shard(tmp_path, monkeypatch):
    # Two writers that listed the folder at the same moment pick the same next name: the second must not
    # replace the first one's shard. A listing that never sees the new shards reproduces that race.
    cache = FeatureCache(tmp_path)
    monkeypatch.setattr(FeatureCache, "shards", lambda self: [])
    paths = [cache.write_shard([_example(f"x{i}", i)]) for i in range(3)]
    monkeypatch.undo()
    assert len(set(paths)) == 3 and cache.shards() == sorted(paths)
    assert cache.ids() == {"x0", "x1", "x2"}


def test_two_concurrent_writer_processes_never_lose_a_shard(tmp_path):
    go = tmp_path / "go"
    cache_dir = tmp_path / "cache"
    script = textwrap.dedent(
        f"""
        import os, sys, time
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from test_training_feature_cache import _example
        from rag_opt.training.feature_cache import FeatureCache

        writer = sys.argv[1]
        cache = FeatureCache({str(cache_dir)!r})
        while not os.path.exists({str(go)!r}):
            time.sleep(0.001)
        for i in range(25):
            cache.write_shard([_example(f"{{writer}}-{{i}}-{{k}}", i * 2 + k) for k in range(2)])
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", script, w], env=env) for w in ("A", "B")]
    time.sleep(1.0)  # both are importing; the barrier releases them together (not needed for correctness)
    go.touch()
    for p in procs:
        assert p.wait(timeout=300) == 0
    cache = FeatureCache(cache_dir)
    assert len(cache.shards()) == 50
    assert [p.name for p in cache_dir.iterdir() if not p.name.startswith("shard-")] == []
    expected = {f"{w}-{i}-{k}" for w in "AB" for i in range(25) for k in range(2)}
    assert cache.ids() == expected
    loaded = cache.load()
    for w in "AB":
        ex = _example(f"{w}-7-1", 15)
        assert np.allclose(loaded[ex.id].unit, ex.features.unit, atol=1e-3)


def test_a_store_merges_deep_enough_caches_and_writes_only_what_none_has(tmp_path):
    from rag_opt.training.feature_cache import FeatureStore, fill_cache

    FeatureCache(tmp_path / "train-bf16").write_shard([_example("full", 1)])  # no -L: all (3) layers
    FeatureCache(tmp_path / "train-bf16-L2").write_shard([_example("two", 2)])
    FeatureCache(tmp_path / "train-bf16-L1").write_shard([_example("shallow", 3)])  # too shallow for 2
    FeatureCache(tmp_path / "train-fp32").write_shard([_example("fp32", 4)])  # another precision
    store = FeatureStore(tmp_path, "train", "bfloat16", layers=2, num_layers=3)
    assert [c.root.name for c in store.caches()] == ["train-bf16", "train-bf16-L2"]
    loaded = store.load()
    assert sorted(loaded) == ["full", "two"]
    assert all(f.num_layers == 2 for f in loaded.values())  # cut to the store's depth
    computed: list[str] = []

    def compute(contexts):  # a shard's contexts at once (what lets extraction batch them)
        computed.extend(q for _, q in contexts)
        return [_example(q, 5).features for _, q in contexts]

    examples = [(i, [["x"]], i) for i in ("full", "two", "shallow", "new")]
    assert fill_cache(store, examples, compute, progress=False) == 2
    assert computed == ["shallow", "new"]
    assert store.target.root.name == "train-bf16-L2" and {"shallow", "new"} <= store.target.ids()
