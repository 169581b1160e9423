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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rag_opt.errors import InvalidInputError
from rag_opt.models.parallel import ParallelPrompt, context_positions
from rag_opt.work import checkpoint

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
    if len(parts) != len(prompt.blocks) + 1 or len(queries) != len(prompt.blocks):
        raise ValueError("cross_reads needs the prefix's states, and the states and source queries of every block")
    ctx_pos, unit_of = context_positions(prompt)
    n_units = prompt.n_units
    cross = np.zeros((n_units, depth, proxy.num_heads), dtype=np.float32)
    doc_of_unit = _unit_documents(prompt)
    src_doc = np.asarray([b.doc for b in prompt.blocks for _ in b.ends], dtype=np.int64)
    if not len(ctx_pos) or len(np.unique(src_doc)) < 2:  # no source, or none of another document than a unit's
        return cross, np.zeros(n_units, dtype=np.int64)
    sources = _Sources.of(prompt, queries, src_doc, depth)
    # sources of other documents than each unit's: what the unit's value averages
    per_doc = np.bincount(sources.doc, minlength=prompt.n_docs)
    n_sources = np.where(doc_of_unit >= 0, len(sources.doc) - per_doc[np.maximum(doc_of_unit, 0)], 0)
    counts = np.bincount(np.asarray(unit_of, dtype=np.int64), minlength=n_units)
    total = _unit_attention(proxy, prompt, parts, sources, (ctx_pos, unit_of, doc_of_unit), depth)  # (U, L, H)
    ok = (n_sources > 0) & (counts > 0)
    cross[ok] = total[ok] / (n_sources[ok] * counts[ok])[:, None, None]
    return cross, n_sources.astype(np.int64)


def _unit_documents(prompt: ParallelPrompt) -> np.ndarray:
    """The document of each unit of ``prompt`` (-1: a unit no block holds)."""
    doc_of_unit = np.full(prompt.n_units, -1, dtype=np.int64)
    for b in prompt.blocks:
        for u in b.unit_of:
            if u >= 0:
                doc_of_unit[u] = b.doc
    return doc_of_unit


@dataclass(frozen=True)
class _Sources:
    """The sources one context's reading averages over: each one's document, its position in the prompt and its
    query states ``(layers, heads, sources, head_dim)``; at most :data:`MAX_SOURCES`, evenly spaced past it (linear
    cost, see the module doc)."""

    doc: np.ndarray
    positions: np.ndarray
    queries: torch.Tensor

    @classmethod
    def of(cls, prompt: ParallelPrompt, queries: Sequence[EncodedStates], src_doc: np.ndarray, depth: int) -> _Sources:
        import torch

        positions = np.asarray([len(prompt.prefix) + i for b in prompt.blocks for i in b.ends], dtype=np.int64)
        q_all = torch.cat([q.decode(depth=depth) for q in queries], dim=2)  # (L, H, S, d)
        if len(src_doc) > MAX_SOURCES:
            pick = np.unique(np.linspace(0, len(src_doc) - 1, MAX_SOURCES).round().astype(np.int64))
            src_doc, positions = src_doc[pick], positions[pick]
            q_all = q_all.index_select(2, torch.from_numpy(pick))
        return cls(src_doc, positions, q_all)


@dataclass(frozen=True)
class _UnitRuns:
    """How a row of attention over the context's tokens sums into units: the context's tokens come unit by unit
    (positions in prompt order), so a unit is a run of columns, summed by ``np.add.reduceat`` on the CPU (one pass;
    ``index_add_`` over the last axis costs several) and by ``index_add_`` elsewhere."""

    n_units: int
    units: torch.Tensor  # the unit of each context token, on the model's device
    present: torch.Tensor  # the units with tokens, on the model's device
    starts: np.ndarray  # where each present unit's run starts
    on_cpu: bool

    @classmethod
    def of(cls, unit_of: Sequence[int], n_units: int, dev: torch.device) -> _UnitRuns:
        import torch

        present = np.unique(np.asarray(unit_of, dtype=np.int64))
        starts = np.searchsorted(np.asarray(unit_of, dtype=np.int64), present)
        units = torch.tensor(unit_of, dtype=torch.long, device=dev)
        return cls(n_units, units, torch.from_numpy(present).to(dev), starts, dev.type == "cpu")


def _unit_attention(
    proxy: ProxyModel,
    prompt: ParallelPrompt,
    parts: Sequence[EncodedStates],
    sources: _Sources,
    context: tuple[list[int], list[int], np.ndarray],
    depth: int,
) -> np.ndarray:
    """``(units, depth, heads)``: the attention each unit's tokens receive from the sources of other documents,
    relative to an even share, summed over those sources and tokens (each source's softmax over every unit token of
    the context, per layer and head). ``context``: the positions of the context's unit tokens and the unit of each
    (:func:`~rag_opt.models.parallel.context_positions`), and each unit's document."""
    import torch

    ctx_pos, unit_of, doc_of_unit = context
    dev = torch.device(proxy.device)  # the cached states live on the CPU; the reading runs where the model does
    ctx = torch.tensor(ctx_pos, dtype=torch.long, device=dev)
    # each source moves from its own position to the question pass's first position
    cos, sin = _rotation(proxy, prompt.question_start - torch.from_numpy(sources.positions).to(dev))
    keys = torch.cat([part.decode_keys(depth) for part in parts], dim=2).to(dev)  # (L, KVH, C_all, d)
    q_all = sources.queries.to(dev)
    scale = float(q_all.shape[-1]) ** -0.5  # the model's own scaling (head_dim ** -0.5)
    runs = _UnitRuns.of(unit_of, prompt.n_units, dev)
    sums = torch.zeros(depth, q_all.shape[1], prompt.n_units, dtype=torch.float32, device=dev)
    # the even-share scale where a unit is another document's than the source's, else 0: (sources, units)
    weight = (torch.from_numpy(sources.doc).to(dev)[:, None] != torch.from_numpy(doc_of_unit).to(dev)[None, :]).float()
    weight = weight * float(len(ctx_pos))
    for layer in range(depth):
        k = keys[layer].index_select(1, ctx).float().transpose(-1, -2)  # (KVH, d, C)
        q = _rotate(q_all[layer].float(), cos, sin).mul_(scale)  # (H, S, d)
        for a in range(0, len(sources.doc), SOURCE_CHUNK):
            checkpoint()  # a long context's reading stops soon after its caller gives up (rag_opt.work)
            sums[layer] += _chunk_reading(q[:, a : a + SOURCE_CHUNK], k, weight[a : a + SOURCE_CHUNK], runs)
    return np.asarray(sums.permute(2, 0, 1).cpu().numpy())


def _chunk_reading(qc: torch.Tensor, k: torch.Tensor, weight: torch.Tensor, runs: _UnitRuns) -> torch.Tensor:
    """``(heads, units)``: what one chunk of sources ``qc`` ``(H, rows, d)`` gives each unit over the keys ``k``
    ``(KVH, d, C)``, weighted by ``weight`` ``(rows, units)``."""
    import torch

    heads, rows, kvh = qc.shape[0], qc.shape[1], k.shape[0]
    logits = torch.matmul(qc.reshape(kvh, (heads // kvh) * rows, -1), k).reshape(heads, rows, -1)
    # softmax, in place and unnormalised (one (H, S, C) tensor, no copies); each row's sum divides the per-unit sums
    # instead, (H, S, U): a hundredth of the size
    e = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
    row_sums = e.sum(dim=-1, keepdim=True)
    per_unit = torch.zeros(heads, rows, runs.n_units, dtype=torch.float32, device=qc.device)
    if runs.on_cpu:
        per_unit[:, :, runs.present] = torch.from_numpy(np.add.reduceat(e.numpy(), runs.starts, axis=-1))
    else:
        per_unit.index_add_(2, runs.units, e)
    return (per_unit.div_(row_sums) * weight[None]).sum(dim=1)


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
