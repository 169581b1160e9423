"""Cross-document attention under parallel encoding: how much the other documents' sentences read each sentence.

The joint encoding's ``cross_doc`` feature is the attention a sentence receives from the last token of every
sentence of a later document (a bridge sentence draws attention from the paragraph of the entity it names). Under
parallel encoding no document reads another, so it is rebuilt from what each document pass can keep on its own:

* a document pass also keeps the **query states of the last token of each of its units** (every layer,
  rotary embeddings applied at the block's own positions), cached with the block under their own key
  (:func:`rag_opt.models.document_pass.encode_blocks_with_sources`): they depend on the block's tokens only;
* per context, each such *source* query is moved (rotated) to the question pass's first position, right after
  the longest block — where every block's keys sit before it, as for the question's own tokens — and reads the
  keys of every unit token of the context (a softmax over them, per layer and head);
* a unit's value is the attention its tokens receive from the sources of **other** documents, relative to an
  even share (times the context's unit tokens), averaged over those sources and over the unit's tokens — the
  joint feature's normalisation (:attr:`AttentionFeatures.cross`, with :attr:`AttentionFeatures.cross_sources`
  the number of sources averaged).

Nothing here depends on the question or on the order of the documents: a unit's value is the same in every slot.

Its cost is sources × context tokens, quadratic in the context. A context of one document has no other documents'
sources: nothing is computed. A context of more than :data:`MAX_SOURCES` sources (about 25,000 tokens of prose, 150
HotpotQA paragraphs) reads an evenly spaced :data:`MAX_SOURCES` of them, so a long context costs at most linear
time here (a unit's value is then an average over fewer sources, the same in every call).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from rag_opt.errors import InvalidInputError
from rag_opt.models.parallel import ParallelPrompt, context_positions

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from rag_opt.models.kv_codec import EncodedStates
    from rag_opt.models.loader import ProxyModel

__all__ = ["MAX_SOURCES", "SOURCE_CHUNK", "cross_reads"]

SOURCE_CHUNK = 128  # source rows per product (memory: heads × chunk × context tokens floats)
MAX_SOURCES = 1024  # the most sources one context's reading averages over (evenly spaced past it)


def cross_reads(
    proxy: ProxyModel,
    prompt: ParallelPrompt,
    parts: Sequence[EncodedStates],
    queries: Sequence[EncodedStates],
    depth: int,
) -> tuple[np.ndarray, np.ndarray]:
    """``(cross, cross_sources)`` of one context: ``(units, depth, heads)`` and ``(units,)`` (see the module doc).

    ``parts``: the key/value states of the prefix and of each block, ``(2, layers, kv_heads, n, head_dim)``, in
    prompt order; ``queries``: each block's source queries ``(layers, heads, sources, head_dim)``, its sources
    being :attr:`~rag_opt.models.parallel.Block.ends`."""
    import torch

    if len(parts) != len(prompt.blocks) + 1 or len(queries) != len(prompt.blocks):
        raise ValueError("cross_reads needs the prefix's states, and the states and source queries of every block")
    ctx_pos, unit_of = context_positions(prompt)
    n_units = prompt.n_units
    cross = np.zeros((n_units, depth, proxy.num_heads), dtype=np.float32)
    doc_of_unit = np.full(n_units, -1, dtype=np.int64)
    for b in prompt.blocks:
        for u in b.unit_of:
            if u >= 0:
                doc_of_unit[u] = b.doc
    src_doc = np.asarray([b.doc for b in prompt.blocks for _ in b.ends], dtype=np.int64)
    if not len(ctx_pos) or len(np.unique(src_doc)) < 2:  # no source, or none of another document than a unit's
        return cross, np.zeros(n_units, dtype=np.int64)
    src_pos_all = np.asarray([len(prompt.prefix) + i for b in prompt.blocks for i in b.ends], dtype=np.int64)
    q_all = torch.cat([q.decode(depth=depth) for q in queries], dim=2)  # (L, H, S, d)
    if len(src_doc) > MAX_SOURCES:  # evenly spaced sources: linear cost past it (see the module doc)
        pick = np.unique(np.linspace(0, len(src_doc) - 1, MAX_SOURCES).round().astype(np.int64))
        src_doc, src_pos_all = src_doc[pick], src_pos_all[pick]
        q_all = q_all.index_select(2, torch.from_numpy(pick))
    # sources of other documents than each unit's: what the unit's value averages
    per_doc = np.bincount(src_doc, minlength=prompt.n_docs)
    n_sources = np.where(doc_of_unit >= 0, len(src_doc) - per_doc[np.maximum(doc_of_unit, 0)], 0)
    counts = np.bincount(np.asarray(unit_of, dtype=np.int64), minlength=n_units)
    dev = torch.device(proxy.device)  # the cached states live on the CPU; the reading runs where the model does
    ctx = torch.tensor(ctx_pos, dtype=torch.long, device=dev)
    units = torch.tensor(unit_of, dtype=torch.long, device=dev)
    sdoc = torch.from_numpy(src_doc).to(dev)
    n_ctx = float(len(ctx_pos))
    # each source moves from its own position to the question pass's first position
    src_pos = torch.from_numpy(src_pos_all).to(dev)
    cos, sin = _rotation(proxy, prompt.question_start - src_pos)
    keys = torch.cat([part.decode_keys(depth) for part in parts], dim=2).to(dev)  # (L, KVH, C_all, d)
    q_all = q_all.to(dev)
    heads = q_all.shape[1]
    kvh = keys.shape[1]
    scale = float(q_all.shape[-1]) ** -0.5  # the model's own scaling (head_dim ** -0.5)
    sums = torch.zeros(depth, heads, n_units, dtype=torch.float32, device=dev)
    # the even-share scale where a unit is another document's than the source's, else 0: (sources, units)
    unit_doc = torch.from_numpy(doc_of_unit).to(dev)
    weight = (sdoc[:, None] != unit_doc[None, :]).float() * n_ctx
    # the context's tokens come unit by unit (positions in prompt order): a unit is a run of columns, summed by
    # np.add.reduceat on the CPU (one pass; index_add_ over the last axis costs several), index_add_ elsewhere
    present = np.unique(np.asarray(unit_of, dtype=np.int64))
    starts = np.searchsorted(np.asarray(unit_of, dtype=np.int64), present)
    present_t = torch.from_numpy(present).to(dev)
    on_cpu = dev.type == "cpu"
    for layer in range(depth):
        k = keys[layer].index_select(1, ctx).float().transpose(-1, -2)  # (KVH, d, C)
        q = _rotate(q_all[layer].float(), cos, sin).mul_(scale)  # (H, S, d)
        for a in range(0, len(src_doc), SOURCE_CHUNK):
            qc = q[:, a : a + SOURCE_CHUNK]
            rows = qc.shape[1]
            logits = torch.matmul(qc.reshape(kvh, (heads // kvh) * rows, -1), k).reshape(heads, rows, -1)
            # softmax, in place and unnormalised (one (H, S, C) tensor, no copies); each row's sum divides the
            # per-unit sums instead, (H, S, U): a hundredth of the size
            e = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
            row_sums = e.sum(dim=-1, keepdim=True)
            per_unit = torch.zeros(heads, rows, n_units, dtype=torch.float32, device=dev)
            if on_cpu:
                runs = np.add.reduceat(e.numpy(), starts, axis=-1)
                per_unit[:, :, present_t] = torch.from_numpy(runs)
            else:
                per_unit.index_add_(2, units, e)
            sums[layer] += (per_unit.div_(row_sums) * weight[None, a : a + SOURCE_CHUNK]).sum(dim=1)
    total = sums.permute(2, 0, 1).cpu().numpy()  # (U, L, H)
    ok = (n_sources > 0) & (counts > 0)
    cross[ok] = total[ok] / (n_sources[ok] * counts[ok])[:, None, None]
    return cross, n_sources.astype(np.int64)


def _rotation(proxy: ProxyModel, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``(S, head_dim)`` of the rotary embedding at offsets ``delta`` (applied to a query already
    rotated at position p, they give the query at p + delta: rotations compose)."""
    import torch

    base = getattr(proxy.model, "model", None) or proxy.model.base_model
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None:
        raise InvalidInputError(
            f"the cross-document reading under parallel encoding needs a rotary-embedding model; {proxy.name} has none"
        )
    probe = torch.zeros(1, dtype=torch.float32, device=delta.device)
    cos, sin = rotary(probe, delta[None].to(torch.long))
    scaling = float(getattr(rotary, "attention_scaling", 1.0) or 1.0)  # applied once already, at the source
    return cos[0].float() / scaling, sin[0].float() / scaling


def _rotate(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``q`` (heads, S, d) rotated by each source's offset (transformers' rotate-half convention)."""
    import torch

    half = q.shape[-1] // 2
    rotated = torch.cat([-q[..., half:], q[..., :half]], dim=-1)
    return q * cos[None] + rotated * sin[None]
