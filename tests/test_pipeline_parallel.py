"""optimize() under parallel encoding on the real embedded model: the cache changes nothing but the cost."""

from __future__ import annotations

import pytest

from tests.helpers import hotpot_dev, hotpot_docs

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def examples():
    return hotpot_dev(3)


def _spans(result):
    return [(d.id, d.kept_spans) for d in result.documents]


def test_cached_and_uncached_results_are_identical(examples):
    from rag_opt import ContextOptimizer
    from rag_opt.models.encoding_cache import EncodingCache

    cache = EncodingCache()
    cached = ContextOptimizer(encoding="parallel", cache=cache, dtype="float32", ratio=1 / 3)
    uncached = ContextOptimizer(encoding="parallel", cache=None, dtype="float32", ratio=1 / 3)
    ex = examples[0]
    docs = hotpot_docs(ex)
    cached.optimize(examples[1]["question"], docs)  # another question fills the cache with these documents
    warm = cached.optimize(ex["question"], docs)
    cold = uncached.optimize(ex["question"], docs)
    assert (warm.encoding, warm.cache_hits, warm.cache_misses) == ("parallel", len(docs), 0)
    assert (cold.cache_hits, cold.cache_misses) == (0, len(docs))
    assert _spans(warm) == _spans(cold)
    assert [u.score for d in warm.documents for u in d.units] == pytest.approx(
        [u.score for d in cold.documents for u in d.units], abs=1e-6
    )
    assert warm.context() == cold.context()
    assert warm.tokens_after <= warm.token_budget


def test_a_compact_cache_format_answers_a_cold_request_as_a_warm_one(examples):
    """A quantized entry changes the states: the request that encodes a document must read what the cache keeps, so
    cold and warm requests agree exactly (and an entry read back from disk is the same entry)."""
    from rag_opt import ContextOptimizer
    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.models.parallel_features import CROSS_READS

    ex = examples[2]
    docs = hotpot_docs(ex)
    cache = EncodingCache(format="k4v4")
    opt = ContextOptimizer(encoding="parallel", cache=cache, ratio=1 / 3, threads=1)
    cold = opt.optimize(ex["question"], docs)
    CROSS_READS.clear()
    opt.scorer().proxy.question_buffers.clear()
    warm = opt.optimize(ex["question"], docs)
    assert (cold.cache_misses, warm.cache_hits, warm.cache_misses) == (len(docs), len(docs), 0)
    assert _spans(warm) == _spans(cold)
    assert [u.score for d in warm.documents for u in d.units] == [u.score for d in cold.documents for u in d.units]
    bf16 = ContextOptimizer(encoding="parallel", cache=EncodingCache(format="bf16"), ratio=1 / 3, threads=1)
    plain = bf16.optimize(ex["question"], docs)
    # quantized, not identical to bf16 entries (the format is in the store key: the two never mix)
    assert [u.score for d in plain.documents for u in d.units] != [u.score for d in cold.documents for u in d.units]
    assert cache.stats().entries > 0 and cache.stats().format == "k4v4"


def test_shipped_parallel_probe_is_used_and_refused_under_the_joint_encoding(examples):
    from rag_opt import ContextOptimizer
    from rag_opt.compressors.probe import shipped_probe
    from rag_opt.compressors.sentinel import SentinelCompressor
    from rag_opt.errors import ProbeMismatchError
    from rag_opt.models.loader import load_proxy_model

    proxy = load_proxy_model(dtype="float32")
    probe = shipped_probe(proxy.name, "unit", "parallel")
    assert probe is not None and probe.metadata["template"] == "ctx-q-par-v1"
    opt = ContextOptimizer(encoding="parallel", dtype="float32")
    res = opt.optimize(examples[2]["question"], hotpot_docs(examples[2]), ratio=1 / 3)
    assert res.scorer == "probe" and res.encoding == "parallel"
    with pytest.raises(ProbeMismatchError, match="encoding='parallel'"):
        SentinelCompressor(proxy, probe, encoding="joint")


def test_optimize_batch_equals_single_calls_under_parallel_encoding(examples):
    from rag_opt import ContextOptimizer

    opt = ContextOptimizer(encoding="parallel", dtype="float32", ratio=1 / 3)
    docs = hotpot_docs(examples[0])
    questions = [ex["question"] for ex in examples]
    batched = opt.optimize_batch(questions, [docs, docs, hotpot_docs(examples[2])])
    single = [opt.optimize(q, d) for q, d in zip(questions, [docs, docs, hotpot_docs(examples[2])], strict=True)]
    assert [_spans(r) for r in batched] == [_spans(r) for r in single]


def test_two_readings_need_the_joint_encoding():
    from rag_opt.compressors.sentinel import SentinelCompressor
    from rag_opt.errors import InvalidInputError
    from rag_opt.models.loader import load_proxy_model

    with pytest.raises(InvalidInputError, match="passes=2 needs encoding='joint'"):
        SentinelCompressor(load_proxy_model(dtype="float32"), None, encoding="parallel", passes=2)


def test_the_same_tokens_cut_into_other_units_are_not_read_from_the_cache(examples):
    """A title given as a field and the same line at the head of the text are the same tokens cut into other units
    (here the line ends with '!', so it is not read as a heading, and holds two sentences, so the text cuts it in
    two): the cross-document reading, read at each unit's
    last token, must not come from the other cut (it did: a feature block of the wrong length)."""
    from rag_opt import ContextOptimizer
    from rag_opt.models.encoding_cache import EncodingCache

    ex = examples[0]
    fielded = [{**d, "title": d["title"] + "! See more!"} for d in hotpot_docs(ex)]
    in_text = [{"id": d["id"], "text": f"{d['title']}\n{d['text']}"} for d in fielded]
    cache = EncodingCache()
    cached = ContextOptimizer(encoding="parallel", cache=cache, dtype="float32", ratio=1 / 3)
    cached.optimize(ex["question"], fielded)
    warm = cached.optimize(ex["question"], in_text)
    cold = ContextOptimizer(encoding="parallel", cache=None, dtype="float32", ratio=1 / 3).optimize(
        ex["question"], in_text
    )
    assert [d.title_source for d in warm.documents] == [None] * len(warm.documents)
    assert _spans(warm) == _spans(cold)
    assert [u.score for d in warm.documents for u in d.units] == pytest.approx(
        [u.score for d in cold.documents for u in d.units], abs=1e-6
    )
