"""The row-attention features agree with eager attention (output_attentions=True) on real input."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import hotpot_dev

pytestmark = pytest.mark.model


def _eager(proxy, docs, question):
    """Eager attention (``output_attentions=True``, the reference only) over the rendered prompt, with the
    prompt's context positions, their units and the question's rows."""
    import torch
    from transformers import AutoModelForCausalLM

    from rag_opt.models.extract import _token_units
    from rag_opt.models.gguf import converted_gguf_dir
    from rag_opt.models.prompt import render_prompt

    eager = AutoModelForCausalLM.from_pretrained(str(converted_gguf_dir(proxy.source)), attn_implementation="eager")
    layout = render_prompt(docs, question)
    enc = proxy.tokenizer(layout.text, return_offsets_mapping=True)
    ctx_pos, unit_of, q_rows = _token_units([tuple(o) for o in enc["offset_mapping"]], layout)
    with torch.no_grad():
        out = eager(torch.tensor([enc["input_ids"]]), output_attentions=True)
    return out.attentions, np.asarray(ctx_pos), np.asarray(unit_of), q_rows, len(layout.unit_spans)


def _reference(proxy, docs, question):
    attentions, ctx_pos, unit_of, q_rows, n_units = _eager(proxy, docs, question)
    ref = np.zeros((n_units, 2, len(attentions), proxy.num_heads))
    for layer, att in enumerate(attentions):
        a = att[0].numpy()  # (H, T, T)
        rows = a[:, q_rows + [a.shape[1] - 1]][:, :, ctx_pos]
        rows = rows / rows.sum(-1, keepdims=True)  # renormalise over the context
        views = np.stack([rows[:, -1], rows[:, :-1].mean(1)])  # (2, H, C)
        for u in range(n_units):
            sel = unit_of == u
            ref[u, :, layer] = views[:, :, sel].mean(-1) * len(ctx_pos)
    return ref


def test_features_match_eager_attention(proxy):
    from rag_opt.models.extract import extract

    ex = hotpot_dev(1)[0]
    docs = [[f"{t}\n", *s] for t, s in ex["context"][:3]]
    feats = extract(proxy, docs, ex["question"])
    ref = _reference(proxy, docs, ex["question"])
    assert proxy.model.config.num_key_value_heads < proxy.num_heads  # the embedded model uses GQA
    assert feats.unit.shape == ref.shape
    np.testing.assert_allclose(feats.unit, ref, rtol=1e-3, atol=1e-4)
    # document mass is a share of the context's attention: it sums to one per view, layer and head
    np.testing.assert_allclose(feats.doc_mass.sum(0), 1.0, atol=1e-4)


def test_windows_cover_every_unit(proxy):
    from rag_opt.models.extract import extract

    ex = hotpot_dev(2)[1]
    docs = [[f"{t}\n", *s] for t, s in ex["context"]]
    one = extract(proxy, docs, ex["question"], max_tokens=4096)
    split = extract(proxy, docs, ex["question"], max_tokens=300)
    assert one.windows == 1 and split.windows > 1
    assert (split.unit_tokens > 0).all()
    # a unit may tokenize one token differently at a window's start than after a document separator
    assert np.abs(split.unit_tokens - one.unit_tokens).max() <= 1
    assert np.isfinite(split.unit).all()


def test_empty_question_is_refused(proxy):
    from rag_opt.models.extract import extract

    with pytest.raises(ValueError, match="question is empty"):
        extract(proxy, [["Some text."]], "  ")


def _contexts(n: int) -> list[tuple[list[list[str]], str]]:
    return [([[f"{t}\n", *s] for t, s in ex["context"]], ex["question"]) for ex in hotpot_dev(n)]


def test_early_exit_reads_exactly_the_first_layers(proxy):
    from rag_opt.models.extract import extract

    docs, question = _contexts(1)[0]
    full = extract(proxy, docs, question, max_tokens=8192)
    early = extract(proxy, docs, question, max_tokens=8192, layers=12)
    assert early.num_layers == 12 and full.num_layers == proxy.num_layers
    assert np.array_equal(early.unit, full.unit[:, :, :12])  # the forward stops; lower layers are unchanged
    assert np.array_equal(early.doc_mass, full.doc_mass[:, :, :12])
    assert np.array_equal(full.first_layers(12).unit, early.unit)
    with pytest.raises(ValueError, match="layers must be in 1"):
        extract(proxy, docs, question, layers=proxy.num_layers + 1)


def test_batched_extraction_equals_one_at_a_time(proxy):
    from rag_opt.models.extract import extract, extract_batch

    contexts = _contexts(3)
    contexts.append((contexts[0][0][:4], "Which film came out first?"))  # a shorter prompt: padding in the batch
    single = [extract(proxy, d, q, max_tokens=8192) for d, q in contexts]
    batched = extract_batch(proxy, contexts, max_tokens=8192)
    for a, b in zip(single, batched, strict=True):
        assert a.unit.shape == b.unit.shape and a.windows == b.windows
        np.testing.assert_allclose(b.unit, a.unit, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(b.doc_mass, a.doc_mass, rtol=1e-4, atol=1e-6)


def _cross_reference(proxy, docs, question):
    """Cross-document attention from eager attention: per unit, the mean over later sentences of other documents
    of the attention from the sentence's last token, renormalised over the context it sees, per token of the unit
    relative to uniform."""
    attentions, ctx_pos, unit_of, _, _ = _eager(proxy, docs, question)
    doc = np.concatenate([[d] * len(u) for d, u in enumerate(docs)])
    n_units = len(doc)
    ref = np.zeros((n_units, len(attentions), proxy.num_heads))
    n_src = np.zeros(n_units, dtype=int)
    for u in range(n_units):
        sources = [s for s in range(u + 1, n_units) if doc[s] != doc[u] and (unit_of == s).any()]
        n_src[u] = len(sources)
        for layer, att in enumerate(attentions):
            a = att[0].numpy()
            vals = []
            for s in sources:
                end = ctx_pos[unit_of == s].max()
                seen = ctx_pos <= end
                row = a[:, end][:, ctx_pos[seen]]
                row = row / row.sum(-1, keepdims=True)
                vals.append(row[:, unit_of[seen] == u].sum(-1) * seen.sum() / (unit_of == u).sum())
            if vals:
                ref[u, layer] = np.mean(vals, axis=0)
    return ref, n_src


def test_cross_document_attention_matches_eager_attention(proxy):
    from rag_opt.models.extract import extract

    ex = hotpot_dev(1)[0]
    docs = [[f"{t}\n", *s] for t, s in ex["context"][:3]]
    plain = extract(proxy, docs, ex["question"])
    feats = extract(proxy, docs, ex["question"], cross=True)
    assert plain.cross is None and feats.cross is not None and feats.cross_sources is not None
    np.testing.assert_array_equal(feats.unit, plain.unit)  # the extra rows change nothing else
    ref, n_src = _cross_reference(proxy, docs, ex["question"])
    np.testing.assert_array_equal(feats.cross_sources, n_src)
    assert (n_src[-len(docs[-1]) :] == 0).all() and (n_src[: len(docs[0])] > 0).all()
    np.testing.assert_allclose(feats.cross, ref, rtol=1e-3, atol=1e-4)
    assert feats.first_layers(4).cross.shape == (len(n_src), 4, proxy.num_heads)


def test_cross_document_attention_is_read_per_window_and_per_batch(proxy):
    from rag_opt.models.extract import extract, extract_batch

    contexts = _contexts(2)
    one = [extract(proxy, d, q, max_tokens=8192, cross=True) for d, q in contexts]
    batched = extract_batch(proxy, contexts, max_tokens=8192, cross=True)
    for a, b in zip(one, batched, strict=True):
        np.testing.assert_array_equal(a.cross_sources, b.cross_sources)
        np.testing.assert_allclose(b.cross, a.cross, rtol=1e-4, atol=1e-4)
    docs, question = contexts[0]
    split = extract(proxy, docs, question, max_tokens=300, cross=True)
    assert split.windows > 1 and split.cross is not None
    # sources are counted within a window only: fewer than in one pass, never more
    assert (split.cross_sources <= one[0].cross_sources).all()
    assert split.cross_sources.sum() < one[0].cross_sources.sum()
    assert np.isfinite(split.cross).all()
