"""The encoding cache: content keys, a memory bound in bytes, a disk tier that never trusts a bad file."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from rag_opt.errors import InvalidInputError  # noqa: E402
from rag_opt.models.encoding_cache import EncodingCache, encoding_key, resolve_cache  # noqa: E402


def _states(tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, 3, tokens, 8, generator=g).to(torch.bfloat16)


BASE = {"model": "embedded:smollm2-135m", "dtype": "bfloat16", "depth": 16, "template": "ctx-q-par-v1"}


def test_the_key_changes_with_tokens_model_dtype_depth_and_template():
    ids = [1, 2, 3]
    k = encoding_key(ids, **BASE)
    assert k == encoding_key(list(ids), **BASE)
    assert k != encoding_key([1, 2, 4], **BASE)
    assert k != encoding_key([1, 2, 3, 0], **BASE)
    for field, other in [("model", "hf:gpt2"), ("dtype", "float32"), ("depth", 15), ("template", "ctx-q-v2")]:
        assert k != encoding_key(ids, **{**BASE, field: other}), field
    assert k != encoding_key(ids, **BASE, kind="prefix")


def test_memory_tier_is_an_lru_bounded_in_bytes():
    one = _states(10)
    size = one.numel() * one.element_size()
    cache = EncodingCache(max_bytes=3 * size)
    for i in range(3):
        cache.put(f"k{i}", _states(10, i))
    assert cache.get("k0") is not None  # k0 is now the most recent
    cache.put("k3", _states(10, 3))  # evicts k1, the least recently used
    assert cache.get("k1") is None
    assert all(cache.get(k) is not None for k in ("k0", "k2", "k3"))
    st = cache.stats()
    assert st.entries == 3 and st.bytes == 3 * size <= st.max_bytes and st.evictions == 1
    assert (st.hits, st.misses) == (4, 1)
    cache.put("huge", _states(1000))  # larger than the bound: never kept, nothing evicted for it
    assert cache.get("huge") is None and cache.stats().entries == 3


def test_the_bound_holds_under_concurrent_writers():
    one = _states(10)
    size = one.numel() * one.element_size()
    cache = EncodingCache(max_bytes=5 * size)

    def work(t: int) -> None:
        for i in range(50):
            cache.put(f"t{t}-{i}", one)
            cache.get(f"t{t}-{i // 2}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    st = cache.stats()
    assert st.bytes <= st.max_bytes and st.entries == 5 and st.evictions == 200 - 5


def test_disk_tier_round_trip_and_sharing(tmp_path):
    states = _states(7)
    writer = EncodingCache(disk=tmp_path)
    key = encoding_key([5, 6, 7], **BASE)
    writer.put(key, states)
    assert writer.stats().disk_writes == 1
    files = list(tmp_path.rglob("*.safetensors"))
    assert len(files) == 1 and not list(tmp_path.rglob("*.tmp"))
    reader = EncodingCache(disk=tmp_path)  # another worker, same folder
    got = reader.get(key)
    assert got is not None and torch.equal(got, states) and got.dtype == torch.bfloat16
    assert reader.stats().disk_hits == 1
    assert key in reader


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "other-key"])
def test_a_bad_disk_file_is_detected_removed_and_recomputed(tmp_path, damage):
    key = encoding_key([9, 9], **BASE)
    EncodingCache(disk=tmp_path).put(key, _states(6))
    path = next(tmp_path.rglob("*.safetensors"))
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        path.write_bytes(data[:-3] + bytes([data[-3] ^ 0xFF]) + data[-2:])
    elif damage == "garbage":
        path.write_bytes(b"not a safetensors file at all")
    else:  # a valid file copied under another key's name
        other = encoding_key([1], **BASE)
        EncodingCache(disk=tmp_path).put(other, _states(6))
        path.write_bytes(next(p for p in tmp_path.rglob("*.safetensors") if other in p.name).read_bytes())
    cache = EncodingCache(disk=tmp_path)
    assert cache.get(key) is None
    st = cache.stats()
    assert st.disk_corrupt == 1 and st.misses == 1
    assert not path.exists()  # removed: the next writer recomputes it
    cache.put(key, _states(6))
    assert torch.equal(EncodingCache(disk=tmp_path).get(key), _states(6))


def test_resolve_cache_options(tmp_path):
    assert resolve_cache(None) is None and resolve_cache(False) is None
    assert resolve_cache("auto").max_bytes == 512 * 2**20
    assert resolve_cache(1024).max_bytes == 1024
    assert resolve_cache(str(tmp_path)).disk == tmp_path
    c = EncodingCache(10)
    assert resolve_cache(c) is c
    with pytest.raises(InvalidInputError, match="max_bytes"):
        EncodingCache(-1)
    with pytest.raises(InvalidInputError, match="cache must be"):
        resolve_cache(1.5)  # type: ignore[arg-type]
