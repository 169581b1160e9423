"""Decoded quantized cache entries kept per proxy model (rag_opt.models.question_buffer.DECODED_MAX_BYTES): a
document read again is copied from its decoded states, which give exactly what decoding gives."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import hotpot_dev

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.model


def _docs(ex: dict, n: int) -> list[list[str]]:
    return [[f"{t}\n", *s] for t, s in ex["context"][:n]]


def _parts(proxy, fmt: str, tokens: tuple[int, ...]):
    from rag_opt.models.kv_codec import encode_states

    g = torch.Generator().manual_seed(len(tokens))
    kvh = proxy.model.config.num_key_value_heads
    d = proxy.model.config.hidden_size // proxy.model.config.num_attention_heads
    return [encode_states((torch.randn(2, 4, kvh, n, d, generator=g) * 2).to(proxy.dtype), fmt) for n in tokens]


@pytest.mark.parametrize("fmt", ["k8v2", "k5vh2q6", "k4hw3v2", "k4g32v2"])
def test_a_buffer_from_kept_decoded_states_is_the_decoded_buffer_bit_for_bit(proxy, fmt, monkeypatch):
    from rag_opt.models import question_buffer

    parts = _parts(proxy, fmt, (37, 5, 64))
    c_max = sum(p.tokens for p in parts)
    calls: list[int] = []
    with proxy.lock:
        question_buffer.forget(proxy)
        monkeypatch.setattr(question_buffer, "DECODED_MAX_BYTES", 0)
        decoded = question_buffer.assemble_states(proxy, [parts], 4, c_max, 9).clone()
        assert not proxy.decoded_parts
        monkeypatch.setattr(question_buffer, "DECODED_MAX_BYTES", 256 << 20)
        question_buffer.forget(proxy)
        first = question_buffer.assemble_states(proxy, [parts], 4, c_max, 9).clone()  # decodes, keeps the parts
        assert len(proxy.decoded_parts) == 3
        proxy.question_buffers.clear()  # the next pass assembles a new buffer: from the kept decoded states
        original = type(parts[0]).decode_into
        monkeypatch.setattr(type(parts[0]), "decode_into", lambda self, *a: calls.append(1) or original(self, *a))
        again = question_buffer.assemble_states(proxy, [parts], 4, c_max, 9).clone()
        # a batch of two rows (a buffer in the model's dtype) reads them too
        batch = question_buffer.assemble_states(proxy, [parts, parts[:2]], 4, c_max, 9).clone()
        question_buffer.forget(proxy)
    assert calls == []  # nothing decoded again: every part came from its kept states
    assert torch.equal(first, decoded) and torch.equal(again, decoded)
    assert torch.equal(batch[:, :, 0, :, :c_max].float(), decoded[:, :, 0, :, :c_max])


def test_bf16_entries_are_not_kept_twice_and_the_bound_evicts_the_least_recently_read(proxy, monkeypatch):
    from rag_opt.models import question_buffer

    with proxy.lock:
        question_buffer.forget(proxy)
        plain = _parts(proxy, "bf16", (20, 30))
        question_buffer.assemble_states(proxy, [plain], 4, 50, 9)
        assert not proxy.decoded_parts and proxy.decoded_bytes == 0  # a bf16 entry is copied, not decoded
        a, b, c = _parts(proxy, "k5vh2q6", (40, 41, 42))
        one = 2 * 4 * a.shape[2] * a.shape[4] * proxy.dtype.itemsize  # bytes of one token's decoded states
        monkeypatch.setattr(question_buffer, "DECODED_MAX_BYTES", one * (40 + 41 + 20))  # room for two of them
        for part in (a, b, a, c):  # a read again before c arrives: b is the least recently read
            proxy.question_buffers.clear()
            question_buffer.assemble_states(proxy, [[part]], 4, part.tokens, 9)
        kept = [entry[0] for entry in proxy.decoded_parts.values()]
        assert kept == [a, c]
        assert proxy.decoded_bytes == one * (40 + 42) <= question_buffer.DECODED_MAX_BYTES
        question_buffer.forget(proxy)
        assert proxy.decoded_bytes == 0 and not proxy.decoded_parts


def test_questions_over_documents_read_before_give_what_a_fresh_decoding_gives(proxy, monkeypatch):
    """End to end: other document sets that share documents with an earlier one read those documents' kept decoded
    states, and every feature is what the same pass gives with nothing kept."""
    from rag_opt.models import question_buffer
    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.models.extract import extract

    a, b = hotpot_dev(2)
    docs = _docs(a, 4)
    cache = EncodingCache(format="k5vh2q6")
    with proxy.lock:
        question_buffer.forget(proxy)
    extract(proxy, docs, a["question"], layers=4, encoding="parallel", cache=cache)  # reads and keeps them
    assert len(proxy.decoded_parts) >= 4
    subset = [docs[2], docs[0]]  # another set of the same documents: a new buffer, the parts kept
    from rag_opt.models.kv_codec import EncodedStates

    calls: list[int] = []
    original = EncodedStates.decode_into
    monkeypatch.setattr(EncodedStates, "decode_into", lambda self, *a: calls.append(1) or original(self, *a))
    kept = extract(proxy, subset, b["question"], layers=4, encoding="parallel", cache=cache)
    assert calls == []  # the prefix and both documents came from their kept decoded states
    monkeypatch.undo()
    with proxy.lock:
        question_buffer.forget(proxy)
    fresh = extract(proxy, subset, b["question"], layers=4, encoding="parallel", cache=cache)
    np.testing.assert_array_equal(kept.unit, fresh.unit)
    np.testing.assert_array_equal(kept.doc_mass, fresh.doc_mass)
    with proxy.lock:
        question_buffer.forget(proxy)
