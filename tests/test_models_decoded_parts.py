"""Decoded copies of compact cache entries kept for question passes (rag_opt.models.decoded_entries, an encoding
cache's ``decoded``): a document read again is copied from its decoded states, which give exactly what decoding
gives, within the bound."""

from __future__ import annotations

import numpy as np
import pytest

from rag_opt.errors import InvalidInputError
from tests.helpers import hotpot_dev

torch = pytest.importorskip("torch")


def _docs(ex: dict, n: int) -> list[list[str]]:
    return [[f"{t}\n", *s] for t, s in ex["context"][:n]]


def _parts(proxy, fmt: str, tokens: tuple[int, ...]):
    from rag_opt.models.kv_codec import encode_states

    g = torch.Generator().manual_seed(len(tokens))
    kvh = proxy.model.config.num_key_value_heads
    d = proxy.model.config.hidden_size // proxy.model.config.num_attention_heads
    return [encode_states((torch.randn(2, 4, kvh, n, d, generator=g) * 2).to(proxy.dtype), fmt) for n in tokens]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "256"])
def test_a_bad_bound_is_refused_by_name(bad) -> None:
    from rag_opt.models.decoded_entries import DecodedEntries
    from rag_opt.models.encoding_cache import EncodingCache

    with pytest.raises(InvalidInputError, match="decoded entries' max_bytes"):
        DecodedEntries(bad)
    with pytest.raises(InvalidInputError, match="decoded entries' max_bytes"):
        EncodingCache(decoded_bytes=bad)


def test_a_cache_without_a_memory_tier_keeps_none(tmp_path) -> None:
    from rag_opt.models.encoding_cache import EncodingCache

    assert EncodingCache().decoded.max_bytes == 256 << 20
    assert EncodingCache(0, disk=tmp_path).decoded.max_bytes == 0  # its reads are new objects: never found again


@pytest.mark.model
@pytest.mark.parametrize("fmt", ["k8v2", "k5vh2q6", "k4hw3v2", "k4g32v2"])
def test_a_buffer_from_kept_decoded_states_is_the_decoded_buffer_bit_for_bit(proxy, fmt, monkeypatch):
    from rag_opt.models import question_buffer
    from rag_opt.models.decoded_entries import DecodedEntries

    parts = _parts(proxy, fmt, (37, 5, 64))
    c_max = sum(p.tokens for p in parts)
    calls: list[int] = []
    kept = DecodedEntries()
    with proxy.lock:
        question_buffer.forget(proxy)
        decoded = question_buffer.assemble_states(proxy, [parts], 4, c_max, 9).clone()  # none kept
        question_buffer.forget(proxy)
        first = question_buffer.assemble_states(proxy, [parts], 4, c_max, 9, kept).clone()  # decodes, keeps them
        assert len(kept) == 3 and (kept.hits, kept.misses) == (0, 3)
        proxy.question_buffers.clear()  # the next pass assembles a new buffer: from the kept decoded states
        original = type(parts[0]).decode_into
        monkeypatch.setattr(type(parts[0]), "decode_into", lambda self, *a: calls.append(1) or original(self, *a))
        again = question_buffer.assemble_states(proxy, [parts], 4, c_max, 9, kept).clone()
        # a batch of two rows (a buffer in the model's dtype) reads them too
        batch = question_buffer.assemble_states(proxy, [parts, parts[:2]], 4, c_max, 9, kept).clone()
        question_buffer.forget(proxy)
    assert calls == []  # nothing decoded again: every part came from its kept states
    assert kept.hits == 3 + 5
    assert torch.equal(first, decoded) and torch.equal(again, decoded)
    assert torch.equal(batch[:, :, 0, :, :c_max].float(), decoded[:, :, 0, :, :c_max])


@pytest.mark.model
def test_bf16_entries_are_not_kept_twice_and_the_bound_evicts_the_least_recently_read(proxy):
    from rag_opt.models import question_buffer
    from rag_opt.models.decoded_entries import DecodedEntries

    plain = _parts(proxy, "bf16", (20, 30))
    a, b, c = _parts(proxy, "k5vh2q6", (40, 41, 42))
    one = 2 * 4 * a.shape[2] * a.shape[4] * proxy.dtype.itemsize  # bytes of one token's decoded states
    kept = DecodedEntries(one * (40 + 41 + 20))  # room for two of them
    with proxy.lock:
        question_buffer.forget(proxy)
        question_buffer.assemble_states(proxy, [plain], 4, 50, 9, kept)
        assert len(kept) == 0 and kept.bytes == 0  # a bf16 entry is copied, not decoded
        for part in (a, b, a, c):  # a read again before c arrives: b is the least recently read
            proxy.question_buffers.clear()
            question_buffer.assemble_states(proxy, [[part]], 4, part.tokens, 9, kept)
        question_buffer.forget(proxy)
    assert kept.parts() == [a, c]
    assert kept.bytes == one * (40 + 42) <= kept.max_bytes
    too_large = DecodedEntries(one * 39)  # smaller than any of them: none is kept, each is decoded
    with proxy.lock:
        question_buffer.assemble_states(proxy, [[a]], 4, a.tokens, 9, too_large)
        question_buffer.forget(proxy)
    assert len(too_large) == 0 and too_large.bytes == 0
    kept.clear()
    assert kept.bytes == 0 and len(kept) == 0


@pytest.mark.model
def test_questions_over_documents_read_before_give_what_a_fresh_decoding_gives(proxy, monkeypatch):
    """End to end: other document sets that share documents with an earlier one read those documents' kept decoded
    states, and every feature is what the same pass gives with nothing kept."""
    from rag_opt.models import question_buffer
    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.models.extract import extract
    from rag_opt.models.kv_codec import EncodedStates

    a, b = hotpot_dev(2)
    docs = _docs(a, 4)
    cache = EncodingCache(format="k5vh2q6")
    with proxy.lock:
        question_buffer.forget(proxy)
    extract(proxy, docs, a["question"], layers=4, encoding="parallel", cache=cache)  # reads and keeps them
    assert len(cache.decoded) >= 4 and cache.stats().decoded_entries == len(cache.decoded)
    subset = [docs[2], docs[0]]  # another set of the same documents: a new buffer, the parts kept
    calls: list[int] = []
    original = EncodedStates.decode_into
    monkeypatch.setattr(EncodedStates, "decode_into", lambda self, *a: calls.append(1) or original(self, *a))
    kept = extract(proxy, subset, b["question"], layers=4, encoding="parallel", cache=cache)
    assert calls == []  # the prefix and both documents came from their kept decoded states
    assert cache.stats().decoded_hits >= 3
    monkeypatch.undo()
    cache.decoded.clear()
    with proxy.lock:
        question_buffer.forget(proxy)
    fresh = extract(proxy, subset, b["question"], layers=4, encoding="parallel", cache=cache)
    np.testing.assert_array_equal(kept.unit, fresh.unit)
    np.testing.assert_array_equal(kept.doc_mass, fresh.doc_mass)
    with proxy.lock:
        question_buffer.forget(proxy)


@pytest.mark.model
def test_without_a_cache_nothing_is_kept(proxy, monkeypatch):
    """With no cache a document is encoded again for every request: its decoded states would never be read again,
    so a question pass decodes them straight into its buffer."""
    from rag_opt.models import question_buffer
    from rag_opt.models.decoded_entries import DecodedEntries
    from rag_opt.models.extract import extract

    made: list[DecodedEntries] = []
    original = DecodedEntries.decode_into
    monkeypatch.setattr(DecodedEntries, "decode_into", lambda self, *a: made.append(self) or original(self, *a))
    (a,) = hotpot_dev(1)
    extract(proxy, _docs(a, 3), a["question"], layers=4, encoding="parallel", cache=None)
    with proxy.lock:
        question_buffer.forget(proxy)
    assert made == []
