"""Parallel encoding on the real embedded model: one masked pass equals the cached path; documents are independent."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import hotpot_dev

pytestmark = pytest.mark.model


def _docs(ex: dict, n: int) -> list[list[str]]:
    return [[f"{t}\n", *s] for t, s in ex["context"][:n]]


def _masked_single_pass(proxy, docs, question, depth):
    """The reference: the whole parallel prompt in ONE forward pass, with a 4D block mask and restarted position
    ids (no cache involved), read through the same capture."""
    import torch

    from rag_opt.models.capture import Capture, CaptureItem, StopForward, capturing
    from rag_opt.models.parallel import context_positions, parallel_prompt

    prompt = parallel_prompt(proxy.tokenizer, docs, question, max_block_tokens=4096)
    p = len(prompt.prefix)
    ids = list(prompt.prefix)
    pos = list(range(p))
    spans = []
    for b in prompt.blocks:
        spans.append((len(ids), len(ids) + len(b.ids)))
        ids += b.ids
        pos += range(p, p + len(b.ids))
    c = len(ids)
    ids += prompt.question_ids
    pos += range(prompt.question_start, prompt.question_start + len(prompt.question_ids))
    t = len(ids)
    allow = torch.zeros(t, t, dtype=torch.bool)
    allow[:p, :p] = torch.tril(torch.ones(p, p, dtype=torch.bool))
    for a, e in spans:
        allow[a:e, :p] = True
        allow[a:e, a:e] = torch.tril(torch.ones(e - a, e - a, dtype=torch.bool))
    allow[c:, :c] = True
    allow[c:, c:] = torch.tril(torch.ones(t - c, t - c, dtype=torch.bool))
    mask = torch.where(allow, 0.0, torch.finfo(torch.float32).min)[None, None]
    ctx_pos, unit_of = context_positions(prompt)
    item = CaptureItem(
        ctx_pos=torch.tensor(ctx_pos),
        unit_of_ctx=torch.tensor(unit_of),
        n_units=prompt.n_units,
        q_rows=torch.tensor([c + i for i in prompt.q_rows] + [t - 1]),
        n_question_rows=len(prompt.q_rows),
    )
    capture = Capture(items=[item], stop_after=depth - 1)
    with capturing(capture), torch.inference_mode():
        try:
            proxy.model.model(
                input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]), attention_mask=mask, use_cache=False
            )
        except StopForward:
            pass
    sums = torch.stack([capture.sums[layer][0] for layer in range(depth)]).permute(3, 1, 0, 2).numpy()
    counts = np.bincount(np.asarray(unit_of), minlength=prompt.n_units)
    return sums / np.maximum(counts, 1)[:, None, None, None] * len(ctx_pos)


def test_cached_path_equals_one_masked_pass(proxy):
    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.models.extract import extract

    ex = hotpot_dev(1)[0]
    docs = _docs(ex, 4)
    ref = _masked_single_pass(proxy, docs, ex["question"], depth=6)
    cache = EncodingCache(format="bf16")  # the states unchanged (the default format quantizes them)
    cold = extract(proxy, docs, ex["question"], layers=6, encoding="parallel", cache=cache)
    warm = extract(proxy, docs, ex["question"], layers=6, encoding="parallel", cache=cache)
    assert (cold.cache_hits, cold.cache_misses) == (0, 4)
    assert (warm.cache_hits, warm.cache_misses) == (4, 0)
    assert cold.encoding == "parallel" and cold.windows == 1
    np.testing.assert_allclose(cold.unit, ref, rtol=1e-3, atol=1e-4)
    np.testing.assert_array_equal(warm.unit, cold.unit)  # the cached encodings are the computed ones
    np.testing.assert_allclose(cold.doc_mass.sum(0), 1.0, atol=1e-4)


def test_a_document_encoding_does_not_depend_on_its_neighbours(proxy):
    """The states a block is cached with are the same alone or among other documents, in any slot (the question
    pass, which reads all of them, is what differs between contexts)."""
    a, b = hotpot_dev(2)
    docs = _docs(a, 5)
    question = a["question"]
    others = [*_docs(b, 3), docs[0], *docs[1:3]]  # docs[0] in slot 4 among other paragraphs
    from rag_opt.models.document_pass import encode_blocks
    from rag_opt.models.parallel import parallel_prompt

    p1 = parallel_prompt(proxy.tokenizer, docs[:1], question, max_block_tokens=4096)
    p2 = parallel_prompt(proxy.tokenizer, others, "another question?", max_block_tokens=4096)
    assert p1.blocks[0].ids == p2.blocks[3].ids
    _, s1 = encode_blocks(proxy, p1.prefix, [p1.blocks[0].ids], 3)
    _, s2 = encode_blocks(proxy, p2.prefix, [b.ids for b in p2.blocks], 3)  # packed with the others in one row
    np.testing.assert_allclose(s1[0].numpy(), s2[3].numpy(), rtol=1e-4, atol=1e-5)
    joint_alone = _joint_states(proxy, p1.prefix, p1.blocks[0].ids)
    np.testing.assert_allclose(s1[0].numpy(), joint_alone, rtol=1e-4, atol=1e-5)


def _joint_states(proxy, prefix, ids):
    """Key/value states of ``prefix + ids`` from transformers' own cache (no rag-opt capture)."""
    import torch

    with torch.inference_mode():
        out = proxy.model.model(input_ids=torch.tensor([[*prefix, *ids]]), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    p = len(prefix)
    layers = [cache.layers[i] for i in range(3)]
    keys = torch.stack([layer.keys[0, :, p:] for layer in layers])
    values = torch.stack([layer.values[0, :, p:] for layer in layers])
    return torch.stack([keys, values]).numpy()


def test_reordering_documents_changes_no_feature(proxy):
    """No position bias over documents: reversed input, the same features per document."""
    from rag_opt.models.extract import extract

    ex = hotpot_dev(1)[0]
    docs = _docs(ex, 5)
    fwd = extract(proxy, docs, ex["question"], layers=4, encoding="parallel")
    rev = extract(proxy, docs[::-1], ex["question"], layers=4, encoding="parallel")
    _same_per_document(docs, fwd.unit, rev.unit, atol=1e-4)
    for d in range(len(docs)):
        np.testing.assert_allclose(fwd.doc_mass[d], rev.doc_mass[len(docs) - 1 - d], rtol=1e-3, atol=1e-5)


def _same_per_document(docs, forward, reversed_, atol):
    """Per-unit values of ``docs`` read in order equal those read in reverse order, document by document."""
    starts = np.cumsum([0] + [len(d) for d in docs])
    rstarts = np.cumsum([0] + [len(d) for d in docs[::-1]])
    for d in range(len(docs)):
        r = len(docs) - 1 - d
        np.testing.assert_allclose(
            forward[starts[d] : starts[d + 1]], reversed_[rstarts[r] : rstarts[r + 1]], rtol=1e-3, atol=atol
        )


def test_block_tokens_are_those_of_the_prompt(proxy):
    """A block is tokenized as it stands before the following text, not as a text of its own."""
    from rag_opt.models.parallel import block_tokens

    units = ["Paris is the capital of France."]
    ids, unit_of = block_tokens(proxy.tokenizer, units, 0)
    joint = proxy.tokenizer(units[0] + "\n\nQuestion", add_special_tokens=False)["input_ids"]
    assert list(joint[: len(ids)]) == ids
    assert unit_of.count(-1) >= 1 and set(unit_of) == {0, -1}  # the separator belongs to no unit


def test_a_document_longer_than_a_block_is_split_into_blocks_of_whole_units(proxy):
    from rag_opt.models.extract import extract
    from rag_opt.models.parallel import parallel_prompt

    ex = hotpot_dev(1)[0]
    doc = [s for _, sents in ex["context"][:4] for s in sents]  # one long document
    prompt = parallel_prompt(proxy.tokenizer, [doc], ex["question"], max_block_tokens=64)
    assert len(prompt.blocks) > 1
    seen = [u for b in prompt.blocks for u in dict.fromkeys(x for x in b.unit_of if x >= 0)]
    assert seen == sorted(seen) and len(set(seen)) == len(seen)  # every unit in one block only, in order
    assert set(seen) == set(range(len(doc)))
    feats = extract(proxy, [doc], ex["question"], layers=2, encoding="parallel", max_tokens=200)
    assert feats.windows == 1 and (feats.unit_tokens > 0).all()


def test_an_unknown_encoding_is_refused(proxy):
    from rag_opt.errors import InvalidInputError
    from rag_opt.models.extract import extract

    with pytest.raises(InvalidInputError, match="unknown encoding"):
        extract(proxy, [["A sentence."]], "q?", layers=2, encoding="sideways")


def _reference_cross(proxy, docs, question, depth):
    """Cross-document reading computed independently of rag-opt's capture: keys from transformers' own cache of
    ``prefix + block``, each source's query from the layer's input (hidden states, input norm, q_proj) with the
    rotary embedding applied directly at the question pass's first position, then the softmax over the context's
    unit tokens and the average over other documents' sources (see rag_opt.models.parallel_cross)."""
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from rag_opt.models.parallel import parallel_prompt

    assert depth <= 3  # _joint_states reads three layers
    prompt = parallel_prompt(proxy.tokenizer, docs, question, max_block_tokens=4096)
    base = proxy.model.model
    heads, kvh = proxy.num_heads, proxy.model.config.num_key_value_heads
    p = len(prompt.prefix)
    keys, tok_unit, tok_doc, src_q, src_doc = [], [], [], [], []
    for block in prompt.blocks:
        k = _joint_states(proxy, prompt.prefix, block.ids)[0]  # (3 layers, KVH, n, d)
        qs = []
        with torch.inference_mode():
            hs = base(input_ids=torch.tensor([[*prompt.prefix, *block.ids]]), output_hidden_states=True).hidden_states
            for layer in range(depth):
                attn = base.layers[layer].self_attn
                x = base.layers[layer].input_layernorm(hs[layer])[0, [p + i for i in block.ends]]  # (S, hidden)
                q = attn.q_proj(x).view(len(block.ends), heads, -1).transpose(0, 1)[None]  # (1, H, S, d)
                cos, sin = base.rotary_emb(q, torch.full((1, len(block.ends)), prompt.question_start))
                q, _ = apply_rotary_pos_emb(q, q, cos, sin)
                qs.append(q[0])
        src_q.append(torch.stack(qs))  # (L, H, S, d)
        src_doc += [block.doc] * len(block.ends)
        keep = [i for i, u in enumerate(block.unit_of) if u >= 0]
        keys.append(torch.from_numpy(k[:, :, keep]))
        tok_unit += [block.unit_of[i] for i in keep]
        tok_doc += [block.doc] * len(keep)
    key = torch.cat(keys, dim=2)  # (L, KVH, C, d)
    q_all = torch.cat(src_q, dim=2)  # (L, H, S, d)
    tok_unit, tok_doc, src_doc = np.array(tok_unit), np.array(tok_doc), np.array(src_doc)
    n_ctx = len(tok_unit)
    out = np.zeros((prompt.n_units, depth, heads))
    for layer in range(depth):
        k = key[layer].repeat_interleave(heads // kvh, dim=0)  # (H, C, d)
        probs = torch.softmax(q_all[layer] @ k.transpose(-1, -2) / q_all.shape[-1] ** 0.5, dim=-1).numpy()
        for u in range(prompt.n_units):
            others = src_doc != tok_doc[tok_unit == u][0]
            toks = tok_unit == u
            out[u, layer] = probs[:, others][:, :, toks].sum(axis=(1, 2)) * n_ctx / (others.sum() * toks.sum())
    return out


def test_cross_reading_equals_an_independent_reference(proxy):
    """The parallel cross-document reading (cached source queries moved by rotation, read against the cached
    keys) equals the same quantity computed from transformers' own states with no rag-opt capture."""
    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.models.extract import extract

    ex = hotpot_dev(1)[0]
    docs = _docs(ex, 3)
    exact = EncodingCache(format="bf16")  # the states unchanged (the default format quantizes them)
    feats = extract(proxy, docs, ex["question"], layers=3, encoding="parallel", cross=True, cache=exact)
    ref = _reference_cross(proxy, docs, ex["question"], 3)
    assert feats.cross is not None and feats.cross_sources is not None
    np.testing.assert_allclose(feats.cross, ref, rtol=2e-3, atol=1e-5)
    sizes = [len(d) for d in docs]  # every unit of a document averages the sources of the other documents
    assert feats.cross_sources.tolist() == [sum(sizes) - n for n in sizes for _ in range(n)]


def test_cross_reading_past_its_source_cap_reads_evenly_spaced_sources_and_one_document_reads_none(proxy, monkeypatch):
    """Past MAX_SOURCES a context's units average an evenly spaced MAX_SOURCES of the other documents' sources
    (cost linear past it, not quadratic); a lone document has no other documents' sources and computes nothing."""
    from rag_opt.models import parallel_cross, parallel_features
    from rag_opt.models.extract import extract

    ex = hotpot_dev(1)[0]
    docs = _docs(ex, 4)
    full = extract(proxy, docs, ex["question"], layers=2, encoding="parallel", cross=True)
    total = sum(len(d) for d in docs)
    monkeypatch.setattr(parallel_cross, "MAX_SOURCES", total)  # at the cap: unchanged
    parallel_features.CROSS_READS.clear()
    same = extract(proxy, docs, ex["question"], layers=2, encoding="parallel", cross=True)
    np.testing.assert_array_equal(same.cross, full.cross)
    monkeypatch.setattr(parallel_cross, "MAX_SOURCES", 8)
    parallel_features.CROSS_READS.clear()
    capped = extract(proxy, docs, ex["question"], layers=2, encoding="parallel", cross=True)
    assert capped.cross_sources.max() <= 8 and capped.cross_sources.min() > 0
    assert np.isfinite(capped.cross).all() and not np.array_equal(capped.cross, full.cross)
    one = extract(proxy, docs[:1], ex["question"], layers=2, encoding="parallel", cross=True)
    assert not one.cross.any() and not one.cross_sources.any()


def test_cross_reading_is_cached_and_depends_on_no_order_or_question(proxy):
    """Cached and uncached cross readings are identical; a block cached without its source queries is encoded
    again; reversed documents and another question give each unit the same values."""
    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.models.extract import extract

    ex = hotpot_dev(1)[0]
    docs = _docs(ex, 4)
    cache = EncodingCache()
    plain = extract(proxy, docs, ex["question"], layers=3, encoding="parallel", cache=cache)
    assert plain.cross is None and plain.cache_misses == len(docs)
    cold = extract(proxy, docs, ex["question"], layers=3, encoding="parallel", cross=True, cache=cache)
    assert cold.cache_misses == len(docs)  # cached without source queries: read again, with them
    warm = extract(proxy, docs, ex["question"], layers=3, encoding="parallel", cross=True, cache=cache)
    assert warm.cache_hits == len(docs) and warm.cache_misses == 0
    np.testing.assert_array_equal(warm.cross, cold.cross)
    np.testing.assert_array_equal(warm.unit, plain.unit)  # the other features do not change
    rev = extract(proxy, docs[::-1], "Which one is it?", layers=3, encoding="parallel", cross=True)
    _same_per_document(docs, cold.cross, rev.cross, atol=1e-5)


def test_question_mask_masks_padding_and_other_questions():
    import torch

    from rag_opt.models.question_pass import question_mask

    m = question_mask([3, 5], [[2], [1]], torch.float32)
    assert m.shape == (2, 1, 2, 7)
    allowed = m == 0
    assert allowed[0, 0, 0].tolist() == [True, True, True, False, False, True, False]
    assert allowed[0, 0, 1].tolist() == [True, True, True, False, False, True, True]
    assert allowed[1, 0, 0].tolist() == [True] * 5 + [True, False]
    assert allowed[1, 0, 1].tolist() == [True] + [False] * 6  # a padded query row sees one key (never read)
    packed = question_mask([2], [[1, 2]], torch.float32) == 0  # two questions over the same cached documents
    assert packed[0, 0].tolist() == [
        [True, True, True, False, False],
        [True, True, False, True, False],
        [True, True, False, True, True],
    ]


def test_questions_over_the_same_documents_are_packed_and_equal_single_calls(proxy):
    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.models.extract import extract, extract_batch

    a, b, c = hotpot_dev(3)
    docs = _docs(a, 3)
    other = _docs(c, 2)
    cache = EncodingCache()
    contexts = [(docs, a["question"]), (docs, b["question"]), (other, c["question"]), (docs, c["question"])]
    batched = extract_batch(proxy, contexts, layers=4, encoding="parallel", cache=cache)
    for (d, q), got in zip(contexts, batched, strict=True):
        alone = extract(proxy, d, q, layers=4, encoding="parallel", cache=cache)
        np.testing.assert_allclose(got.unit, alone.unit, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got.doc_mass, alone.doc_mass, rtol=1e-4, atol=1e-6)


def test_a_document_set_is_read_across_once_for_every_question(proxy, monkeypatch):
    """The cross-document reading depends on the document set only: a second question over the same documents
    reuses it (the same values), another set computes its own."""
    from rag_opt.models import parallel_features
    from rag_opt.models.extract import extract

    calls = []
    real = parallel_features.cross_reads

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(parallel_features, "cross_reads", counting)
    parallel_features.CROSS_READS.clear()
    ex = hotpot_dev(1)[0]
    docs = _docs(ex, 3)
    first = extract(proxy, docs, ex["question"], layers=2, encoding="parallel", cross=True)
    second = extract(proxy, docs, "Another question?", layers=2, encoding="parallel", cross=True)
    assert len(calls) == 1
    np.testing.assert_array_equal(first.cross, second.cross)
    second.cross[:] = 0.0  # callers get their own copy
    third = extract(proxy, docs[:2], ex["question"], layers=2, encoding="parallel", cross=True)
    assert len(calls) == 2 and third.cross.shape[0] == sum(len(d) for d in docs[:2])
    np.testing.assert_array_equal(
        extract(proxy, docs, "q?", layers=2, encoding="parallel", cross=True).cross, first.cross
    )


def test_a_question_pass_over_the_same_documents_reuses_their_assembled_states(proxy):
    """Questions over one document set copy its cached states into the pass's buffer once: the next question
    reuses the buffer, and reads exactly what a fresh one gives (its own states overwrite the room after them)."""
    from rag_opt.models import question_buffer
    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.models.extract import extract

    a, b, c = hotpot_dev(3)
    docs = _docs(a, 3)
    cache = EncodingCache()
    proxy.question_buffers.clear()
    first = extract(proxy, docs, a["question"], layers=4, encoding="parallel", cache=cache)
    assert len(proxy.question_buffers) == 1
    (buf,) = [entry.buf for entry in proxy.question_buffers.values()]
    longer = b["question"] + " " + c["question"]  # another question, longer than the first
    reused = extract(proxy, docs, longer, layers=4, encoding="parallel", cache=cache)
    assert len(proxy.question_buffers) == 1 and next(iter(proxy.question_buffers.values())).buf is buf
    proxy.question_buffers.clear()  # the same question with a fresh buffer
    fresh = extract(proxy, docs, longer, layers=4, encoding="parallel", cache=cache)
    np.testing.assert_array_equal(reused.unit, fresh.unit)
    np.testing.assert_array_equal(reused.doc_mass, fresh.doc_mass)
    again = extract(proxy, docs, a["question"], layers=4, encoding="parallel", cache=cache)
    np.testing.assert_array_equal(again.unit, first.unit)  # the longer question left nothing behind
    # another depth, a question longer than the room, and other documents get buffers of their own; few are kept
    extract(proxy, docs, a["question"], layers=2, encoding="parallel", cache=cache)
    extract(proxy, docs, "why " * (question_buffer.BUFFER_ROOM + 8), layers=4, encoding="parallel", cache=cache)
    extract(proxy, _docs(c, 2), c["question"], layers=4, encoding="parallel", cache=cache)
    assert len(proxy.question_buffers) == question_buffer.ASSEMBLED_KEEP


def test_a_pass_over_new_documents_reuses_the_evicted_buffers_memory_and_reads_what_a_fresh_one_gives(proxy):
    """A one-row pass over other documents writes into the memory of the buffer it evicts (no fresh allocation's
    page faults) and reads exactly what a freshly allocated buffer gives, shorter or longer than the last."""
    from rag_opt.models import question_buffer
    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.models.extract import extract

    a, b = hotpot_dev(2)
    long_docs, short_docs = _docs(a, 5), _docs(b, 2)
    cache = EncodingCache()
    proxy.question_buffers.clear()
    fresh_short = extract(proxy, short_docs, b["question"], layers=4, encoding="parallel", cache=cache)
    proxy.question_buffers.clear()
    fresh_long = extract(proxy, long_docs, a["question"], layers=4, encoding="parallel", cache=cache)
    (long_buf,) = [entry.buf for entry in proxy.question_buffers.values()]
    reused_short = extract(proxy, short_docs, b["question"], layers=4, encoding="parallel", cache=cache)
    (short_buf,) = [entry.buf for entry in proxy.question_buffers.values()]
    assert short_buf.untyped_storage().data_ptr() == long_buf.untyped_storage().data_ptr()
    assert short_buf.numel() < long_buf.numel()
    np.testing.assert_array_equal(reused_short.unit, fresh_short.unit)
    np.testing.assert_array_equal(reused_short.doc_mass, fresh_short.doc_mass)
    # back to the longer set: the whole storage is reused again, not the shorter view of it
    reused_long = extract(proxy, long_docs, a["question"], layers=4, encoding="parallel", cache=cache)
    (again,) = [entry.buf for entry in proxy.question_buffers.values()]
    assert again.untyped_storage().data_ptr() == long_buf.untyped_storage().data_ptr()
    np.testing.assert_array_equal(reused_long.unit, fresh_long.unit)
    assert len(proxy.question_buffers) == question_buffer.ASSEMBLED_KEEP


def test_a_packed_document_pass_makes_no_mask_over_its_row(proxy, monkeypatch):
    """Blocks packed in one row read only themselves through the attention function, so transformers is given
    no packed-sequence mask to build (it would be T x T over the whole row)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from rag_opt.models import capture
    from rag_opt.models.document_pass import encode_blocks
    from rag_opt.models.parallel import parallel_prompt

    made: list[object] = []
    real = capture._rows_mask

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        made.append(out)
        return out

    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, capture.ATTN_IMPLEMENTATION, spy)
    a = hotpot_dev(1)[0]
    prompt = parallel_prompt(proxy.tokenizer, _docs(a, 4), a["question"], max_block_tokens=4096)
    _, states = encode_blocks(proxy, prompt.prefix, [b.ids for b in prompt.blocks], 2)
    assert made and all(m is None for m in made)
    assert [s.shape[3] for s in states] == [len(b.ids) for b in prompt.blocks]


def test_blocks_split_over_several_packed_passes_keep_their_order_states_and_sources(proxy, monkeypatch):
    """However many passes the blocks are packed into (a pass holds at most PASS_TOKENS tokens), every block gets
    its own states and its sources' query states, in the order given."""
    from rag_opt.models import document_pass
    from rag_opt.models.parallel import parallel_prompt

    a = hotpot_dev(1)[0]
    prompt = parallel_prompt(proxy.tokenizer, _docs(a, 5), a["question"], max_block_tokens=4096)
    ids = [b.ids for b in prompt.blocks][::-1]  # not sorted by length
    ends = [b.ends for b in prompt.blocks][::-1]
    pre1, one, q1 = document_pass.encode_blocks_with_sources(proxy, prompt.prefix, ids, ends, 3)
    monkeypatch.setattr(document_pass, "PASS_TOKENS", max(len(x) for x in ids) + len(prompt.prefix))
    pre2, split, q2 = document_pass.encode_blocks_with_sources(proxy, prompt.prefix, ids, ends, 3)
    assert sum(len(x) + len(prompt.prefix) for x in ids) > document_pass.PASS_TOKENS  # several passes
    np.testing.assert_allclose(pre1.float().numpy(), pre2.float().numpy(), rtol=1e-2, atol=1e-2)
    for blk, e, s1, s2, a1, a2 in zip(ids, ends, one, split, q1, q2, strict=True):
        assert s1.shape == s2.shape == (2, 3, s1.shape[2], len(blk), s1.shape[4])
        assert a1.shape == a2.shape and a1.shape[2] == len(e)
        np.testing.assert_allclose(s1.float().numpy(), s2.float().numpy(), rtol=1e-2, atol=1e-2)
        np.testing.assert_allclose(a1.float().numpy(), a2.float().numpy(), rtol=1e-2, atol=1e-2)
    # blocks without a source read nothing for it (an empty query tensor each), alone or with others
    _, _, none = document_pass.encode_blocks_with_sources(proxy, prompt.prefix, ids[:2], [(), ()], 3)
    assert [q.shape[2] for q in none] == [0, 0]


def test_a_one_row_question_pass_reads_its_states_in_float32_exactly_as_converted_per_layer(monkeypatch):
    """In bfloat16 a one-row pass assembles its cached states in float32 (converted once while copied, not per
    layer and question); what it reads is exactly what the per-layer conversion gave. A batch of rows keeps the
    model's dtype."""
    import torch

    from rag_opt.models import question_buffer
    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.models.extract import extract, extract_batch
    from rag_opt.models.loader import load_proxy_model

    bf16 = load_proxy_model(dtype="bfloat16")
    a, b = hotpot_dev(2)
    docs = _docs(a, 3)
    cache = EncodingCache(format="bf16")  # the states in the model's dtype (a quantized entry decodes to either)
    bf16.question_buffers.clear()
    got = extract(bf16, docs, a["question"], layers=4, encoding="parallel", cache=cache)
    (entry,) = bf16.question_buffers.values()
    assert entry.buf.dtype == torch.float32
    monkeypatch.setattr(question_buffer, "ASSEMBLE_ONE_ROW_IN_FLOAT32", False)
    bf16.question_buffers.clear()
    want = extract(bf16, docs, a["question"], layers=4, encoding="parallel", cache=cache)
    (entry,) = bf16.question_buffers.values()
    assert entry.buf.dtype == torch.bfloat16
    np.testing.assert_array_equal(got.unit, want.unit)
    np.testing.assert_array_equal(got.doc_mass, want.doc_mass)
    monkeypatch.setattr(question_buffer, "ASSEMBLE_ONE_ROW_IN_FLOAT32", True)
    seen: list[torch.dtype] = []
    original = question_buffer.assemble_states

    def spy(*args):
        buf = original(*args)
        seen.append(buf.dtype)
        return buf

    monkeypatch.setattr(question_buffer, "assemble_states", spy)
    contexts = [(docs, a["question"]), (_docs(b, 3), b["question"])]
    extract_batch(bf16, contexts, layers=4, encoding="parallel", cache=cache)
    assert seen == [torch.bfloat16]  # one pass, two batch rows
