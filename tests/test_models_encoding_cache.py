"""The encoding cache: content keys, store keys (format, namespace), compact entries, a memory bound in bytes, and
store tiers (disk, shared) that never take optimization down and never hand out a bad entry."""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from rag_opt.errors import InvalidInputError  # noqa: E402
from rag_opt.models.cache_store import TierCounters, TierStats  # noqa: E402
from rag_opt.models.encoding_cache import (  # noqa: E402
    EncodingCache,
    block_key,
    cache_namespace,
    encoding_key,
    resolve_cache,
    sources_kind,
)
from rag_opt.models.kv_codec import FORMATS, EncodedStates, encode_states, from_bytes  # noqa: E402


def _states(tokens: int, seed: int = 0, layers: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, layers, 3, tokens, 8, generator=g).to(torch.bfloat16)


BASE = {"model": "embedded:smollm2-135m", "dtype": "bfloat16", "depth": 16, "template": "ctx-q-par-v1"}


class DictTier:
    """A store tier kept in a dict (the protocol's plainest implementation), counting its calls."""

    name = "shared"

    def __init__(self, fail: bool = False) -> None:
        self.data: dict[str, bytes] = {}
        self.fail = fail
        self.counters = TierCounters("shared")

    def get(self, key: str) -> bytes | None:
        if self.fail:
            raise OSError("the store is on fire")
        blob = self.data.get(key)
        self.counters.add(hits=blob is not None, misses=blob is None)
        return blob

    def put(self, key: str, blob: bytes) -> None:
        if self.fail:
            raise OSError("the store is on fire")
        self.data[key] = blob
        self.counters.add(writes=1)

    def discard(self, key: str) -> None:
        self.data.pop(key, None)

    def stats(self) -> TierStats:
        return self.counters.snapshot()

    def close(self) -> None:
        pass


def test_the_key_changes_with_tokens_model_dtype_depth_and_template():
    ids = [1, 2, 3]
    k = encoding_key(ids, **BASE)
    assert k == encoding_key(list(ids), **BASE)
    assert k != encoding_key([1, 2, 4], **BASE)
    assert k != encoding_key([1, 2, 3, 0], **BASE)
    for field, other in [("model", "hf:gpt2"), ("dtype", "float32"), ("depth", 15), ("template", "ctx-q-v2")]:
        assert k != encoding_key(ids, **{**BASE, field: other}), field
    assert k != encoding_key(ids, **BASE, kind="prefix")


def test_a_block_key_is_the_content_key_entries_were_written_under():
    """block_key (the one key function of the optimizer and of rag-opt index) is encoding_key with the proxy's name
    and precision and the parallel template; the pinned digests are those entries written before it existed carry,
    so an index or a disk tier filled earlier is still found (change them only with the key's version, _FORMAT)."""
    from types import SimpleNamespace

    proxy: Any = SimpleNamespace(name=BASE["model"], precision=BASE["dtype"])
    sources = sources_kind([0, 2])
    for kind in ("block", "prefix", sources):
        assert block_key([1, 2, 3], proxy, depth=16, kind=kind) == encoding_key([1, 2, 3], **BASE, kind=kind)
    assert block_key([1, 2, 3], proxy, depth=16) == "e8a59423d19527471bc149499118193195afceb708059728499564324a70ba5f"
    assert block_key((1, 2, 3), proxy, depth=16, kind="prefix") == (
        "f2d016a650cc8fbd1bb433300f013846fa0c25356359037f70e4812e346297a4"
    )
    assert block_key([1, 2, 3], proxy, depth=16, kind=sources) == (
        "614b5eb32e81e6475a9e70e77428199e097d2bb974485121ad5e02f3051cd8e3"
    )


def test_the_store_key_holds_the_format_and_the_namespace():
    key = encoding_key([1, 2, 3], **BASE)
    bf16, int8 = EncodingCache(format="bf16"), EncodingCache(format="int8")
    assert bf16.store_key(key) != int8.store_key(key)
    plain = bf16.store_key(key)
    with cache_namespace("tenant-a"):
        a = bf16.store_key(key)
    with cache_namespace("tenant-b"):
        b = bf16.store_key(key)
    assert len({plain, a, b}) == 3
    assert EncodingCache(namespace="x").store_key(key) != plain
    with pytest.raises(InvalidInputError, match="unknown cache format 'int3'"):
        EncodingCache(format="int3")


def test_tenants_never_see_each_others_entries():
    cache = EncodingCache()
    with cache_namespace("tenant-a"):
        cache.put("k", _states(5))
        assert cache.get("k") is not None
    with cache_namespace("tenant-b"):
        assert cache.get("k") is None
    assert cache.get("k") is None  # nor the common namespace


def test_memory_tier_is_an_lru_bounded_in_bytes():
    size = encode_states(_states(10)).nbytes
    cache = EncodingCache(max_bytes=3 * size)
    for i in range(3):
        cache.put(f"k{i}", _states(10, i))
    assert cache.get("k0") is not None  # k0 is now the most recent
    cache.put("k3", _states(10, 3))  # evicts k1, the least recently used
    assert cache.get("k1") is None
    assert all(cache.get(k) is not None for k in ("k0", "k2", "k3"))
    st = cache.stats()
    assert st.entries == 3 and st.bytes == 3 * size <= st.max_bytes and st.evictions == 1
    assert (st.hits, st.misses, st.memory_hits) == (4, 1, 4)
    cache.put("huge", _states(1000))  # larger than the bound: never kept, nothing evicted for it
    assert cache.get("huge") is None and cache.stats().entries == 3


def test_a_compact_format_holds_more_entries_in_the_same_bytes():
    bound = 4 * encode_states(_states(64), "bf16").nbytes
    counts = {}
    for fmt in ("bf16", "int8", "k4v4"):
        cache = EncodingCache(max_bytes=bound, format=fmt)
        for i in range(40):
            cache.put(f"k{i}", _states(64, i))
        counts[fmt] = cache.stats().entries
    assert counts["bf16"] == 4 < counts["int8"] < counts["k4v4"]


def test_the_bound_holds_under_concurrent_writers():
    one = _states(10)
    size = encode_states(one).nbytes
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


def test_put_returns_the_entry_as_stored_which_a_later_get_returns_unchanged():
    states = _states(12)
    cache = EncodingCache(format="k4v4")
    stored = cache.put("k", states)
    again = cache.get("k")
    assert again is stored
    assert torch.equal(stored.decode(), again.decode())
    assert not torch.equal(stored.decode(), states)  # quantized: the caller reads what the cache keeps


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_format_round_trips_within_its_precision(fmt):
    g = torch.Generator().manual_seed(1)
    kv = (torch.randn(2, 6, 3, 37, 64, generator=g) * torch.linspace(0.1, 8, 64)).to(torch.bfloat16)
    rows = torch.randn(6, 9, 5, 64, generator=g).to(torch.bfloat16)
    f = FORMATS[fmt]
    entry = encode_states(kv, fmt)
    out = entry.decode(torch.float32)
    assert out.shape == kv.shape and entry.tokens == 37
    bound = {16: 0.0, 8: 0.01, 6: 0.04, 5: 0.08, 4: 0.15, 2: 0.6}
    ref = kv.float()
    kerr = float((out[0] - ref[0]).norm() / ref[0].norm())
    verr = float((out[1, :-1] - ref[1, :-1]).norm() / ref[1, :-1].norm())
    assert kerr <= bound[f.key_bits] and verr <= bound[f.value_bits], (kerr, verr)
    if f.quantized:
        assert torch.count_nonzero(out[1, -1]) == 0  # the last layer's values are never read: not stored
        assert entry.nbytes < encode_states(kv, "bf16").nbytes
    else:
        assert torch.equal(out, ref)
    keys = entry.decode_keys(4, torch.float32)
    assert torch.equal(keys, out[0, :4])
    r = encode_states(rows, fmt)
    rerr = float((r.decode(torch.float32) - rows.float()).norm() / rows.float().norm())
    assert rerr <= bound[f.query_bits] and r.tokens == 5
    # serialized and read back: the same tensors
    blob = entry.to_bytes("key")
    back = from_bytes(blob, "key")
    assert back.format == entry.format and torch.equal(back.decode(torch.float32), out)


def test_decode_into_writes_a_strided_buffer_slice_exactly():
    kv = _states(9, layers=5)
    for fmt in ("bf16", "int8", "k4v2"):
        entry = encode_states(kv, fmt)
        buf = torch.full((2, 5, 2, 3, 20, 8), 7.0)
        entry.decode_into(buf[:, :4, 1, :, 3:12], 4)
        assert torch.equal(buf[:, :4, 1, :, 3:12], entry.decode(torch.float32, depth=4))
        assert torch.all(buf[:, :, 0] == 7.0) and torch.all(buf[:, 4] == 7.0)  # nothing else touched


def test_a_blob_for_another_key_or_damaged_is_refused():
    blob = encode_states(_states(4), "int8").to_bytes("key-a")
    with pytest.raises(ValueError, match="another key"):
        from_bytes(blob, "key-b")
    with pytest.raises(ValueError):
        from_bytes(blob[: len(blob) // 2], "key-a")
    flipped = blob[:-3] + bytes([blob[-3] ^ 0xFF]) + blob[-2:]
    with pytest.raises(ValueError, match="checksum"):
        from_bytes(flipped, "key-a")


def _as_stored(states: torch.Tensor) -> torch.Tensor:
    """``states`` as the default format stores them (decoded): what every tier must give back, bit for bit."""
    from rag_opt.models.kv_codec import DEFAULT_FORMAT

    return encode_states(states, DEFAULT_FORMAT).decode()


def test_disk_tier_round_trip_and_sharing(tmp_path):
    states = _states(7)
    writer = EncodingCache(disk=tmp_path)
    key = encoding_key([5, 6, 7], **BASE)
    writer.put(key, states)
    assert writer.flush(10)
    assert writer.stats().disk_writes == 1
    files = list(tmp_path.rglob("*.safetensors"))
    assert len(files) == 1 and not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob("*.lock"))
    reader = EncodingCache(disk=tmp_path)  # another worker, same folder
    got = reader.get(key)
    assert (
        isinstance(got, EncodedStates) and torch.equal(got.decode(), _as_stored(states)) and got.dtype == torch.bfloat16
    )
    st = reader.stats()
    assert st.disk_hits == 1 and st.memory_hits == 0
    assert reader.get(key) is not None and reader.stats().memory_hits == 1  # promoted into memory
    assert key in reader
    writer.close()
    reader.close()


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "other-key"])
def test_a_bad_disk_file_is_detected_removed_and_recomputed(tmp_path, damage):
    key = encoding_key([9, 9], **BASE)
    first = EncodingCache(disk=tmp_path)
    first.put(key, _states(6))
    first.close()
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
        second = EncodingCache(disk=tmp_path)
        second.put(other, _states(6))
        second.close()
        other_path = next(p for p in tmp_path.rglob("*.safetensors") if p != path)
        path.write_bytes(other_path.read_bytes())
    cache = EncodingCache(disk=tmp_path)
    assert cache.get(key) is None
    st = cache.stats()
    assert st.disk_corrupt == 1 and st.misses == 1
    assert not path.exists()  # removed: the next writer recomputes it
    cache.put(key, _states(6))
    cache.close()
    again = EncodingCache(disk=tmp_path)
    assert torch.equal(again.get(key).decode(), _as_stored(_states(6)))
    again.close()


def test_a_shared_hit_is_promoted_to_the_tiers_above(tmp_path):
    shared = DictTier()
    EncodingCache(shared=shared).put("k", _states(8))
    assert len(shared.data) == 1
    other = EncodingCache(disk=tmp_path, shared=shared)  # another replica: its own memory and disk
    got = other.get("k")
    assert got is not None and torch.equal(got.decode(), _as_stored(_states(8)))
    st = other.stats()
    assert (st.shared_hits, st.disk_hits, st.memory_hits) == (1, 0, 0)
    other.flush(10)
    third = EncodingCache(disk=tmp_path, shared=DictTier())  # the same host later: the disk has it now
    assert third.get("k") is not None and third.stats().disk_hits == 1
    other.close()
    third.close()


def test_a_failing_store_tier_is_a_miss_never_an_error():
    cache = EncodingCache(shared=DictTier(fail=True))
    entry = cache.put("k", _states(3))  # the tier's failure is logged, the entry kept in memory
    assert cache.get("k") is entry
    cache.clear()
    assert cache.get("k") is None and cache.stats().misses == 1


def test_resolve_cache_options(tmp_path):
    assert resolve_cache(None) is None and resolve_cache(False) is None
    assert resolve_cache("auto").max_bytes == 512 * 2**20
    assert resolve_cache(1024).max_bytes == 1024
    assert resolve_cache(str(tmp_path)).disk == tmp_path
    c = EncodingCache(10)
    assert resolve_cache(c) is c
    pytest.importorskip("redis")
    from rag_opt.models.cache_redis import RedisTier

    for url in ("redis://127.0.0.1:1/0", "valkey://127.0.0.1:1", "unix:///tmp/nowhere.sock"):
        shared = resolve_cache(url)
        assert isinstance(shared.shared_tier, RedisTier) and shared.disk_tier is None, url
        assert shared.get("k") is None  # nothing listens there: a miss, never an error
        shared.close()
    with pytest.raises(InvalidInputError, match="max_bytes"):
        EncodingCache(-1)
    with pytest.raises(InvalidInputError, match="cache must be"):
        resolve_cache(1.5)  # type: ignore[arg-type]


def test_wide_key_layers_keep_8_bit_keys_and_the_rest_their_format_bits():
    from rag_opt.models.kv_codec import KVFormat

    g = torch.Generator().manual_seed(5)
    kv = (torch.randn(2, 6, 3, 41, 64, generator=g) * torch.linspace(0.1, 8, 64)).to(torch.bfloat16)
    ref = kv.float()
    mixed = KVFormat("mixed", 4, 2, 8, wide_key_layers=(1, 4, 9))  # layer 9: past the entry's 6, ignored
    entry = encode_states(kv, mixed)
    out = entry.decode(torch.float32)

    def err(layer: int) -> float:
        return float((out[0, layer] - ref[0, layer]).norm() / ref[0, layer].norm())

    assert max(err(1), err(4)) < 0.01 < min(err(i) for i in (0, 2, 3, 5))  # 8-bit keys where asked, 4-bit elsewhere
    assert torch.equal(out[0, 1], encode_states(kv, "k8v2").decode(torch.float32)[0, 1])
    assert torch.equal(out[0, 2], encode_states(kv, "k4v2").decode(torch.float32)[0, 2])
    assert encode_states(kv, "k4v2").nbytes < entry.nbytes < encode_states(kv, "k8v2").nbytes
    for depth in (1, 2, 3, 5):  # any prefix of the layers decodes the same as the whole entry's
        assert torch.equal(entry.decode_keys(depth, torch.float32), out[0, :depth])
    buf = torch.full((2, 6, 2, 3, 50, 64), 7.0)
    entry.decode_into(buf[:, :5, 1, :, 4:45], 5)  # a strided slice of a question buffer
    assert torch.equal(buf[:, :5, 1, :, 4:45], entry.decode(torch.float32, depth=5))
    assert torch.all(buf[:, :, 0] == 7.0) and torch.all(buf[:, 5] == 7.0)


def test_rotated_values_and_five_bit_keys_decode_within_their_precision():
    from rag_opt.models.kv_codec import KVFormat

    g = torch.Generator().manual_seed(6)
    kv = torch.randn(2, 4, 3, 40, 64, generator=g)
    kv[1, :, :, :, 5] *= 20  # an outlier channel in the values: rotation spreads it over the head
    kv = kv.to(torch.bfloat16)
    ref = kv.float()

    def verr(fmt: KVFormat) -> float:
        out = encode_states(kv, fmt).decode(torch.float32)
        return float((out[1, :-1] - ref[1, :-1]).norm() / ref[1, :-1].norm())

    assert verr(KVFormat("r", 8, 4, 8, value_rotated=True)) < 0.8 * verr(KVFormat("p", 8, 4, 8))
    five = encode_states(kv, KVFormat("k5", 5, 16, 8))
    kerr = float((five.decode(torch.float32)[0] - ref[0]).norm() / ref[0].norm())
    four = encode_states(kv, KVFormat("k4", 4, 16, 8))
    assert kerr < 0.6 * float((four.decode(torch.float32)[0] - ref[0]).norm() / ref[0].norm())
    assert five.tensors["k"].shape[-1] == 40  # 64 five-bit codes in 40 bytes


def test_rotated_keys_decode_through_an_orthonormal_rotation():
    from rag_opt.models.kv_quant import hadamard as _hadamard

    for d in (64, 96, 80):
        h = _hadamard(d)
        assert torch.allclose(h @ h, torch.eye(d), atol=1e-6) and torch.equal(h, h.T)  # its own inverse
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 4, 3, 50, 64, generator=g)
    kv[0, :, :, :, 7] *= 30  # one channel far larger than the rest, as keys have
    kv = kv.to(torch.bfloat16)
    out = encode_states(kv, "k4hv2").decode(torch.float32)
    err = float((out[0] - kv[0].float()).norm() / kv[0].float().norm())
    assert err < 0.12, err  # 4-bit codes of the rotated keys, rotated back
