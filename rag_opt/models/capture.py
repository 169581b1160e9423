"""The attention hook: PyTorch SDPA plus, while a capture is active, the attention rows rag-opt reads.

A registered transformers attention function wraps SDPA and, only inside :func:`capturing`, also computes the
attention rows we need — those of the question's tokens and of the prompt's final token — from the layer's query
and key states (rotary embeddings already applied, GQA key heads repeated), restricted to the context tokens.
This is exactly eager attention renormalised over the context, at the cost of ``rows × context`` dot products
per head instead of a full ``T × T`` matrix (never ``output_attentions=True``).

A question pass of parallel encoding (:mod:`rag_opt.models.parallel`: every query row is a question's token, and
the capture reads them all) computes its attention once, question by question, for both the recorded rows and the
layer's output (:func:`_question_attention`), instead of SDPA plus a second product.

Optionally (``CaptureItem.sources``) it also reads *cross-document* rows: the attention of the last token of each
sentence over the context before it (causal), summed per unit, for the units of *other, earlier* documents only —
how much the documents that follow read each sentence. These rows are computed in chunks, so memory stays
``chunk × context`` per head.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rag_opt.work import checkpoint

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["ATTN_IMPLEMENTATION", "Capture", "CaptureItem", "StopForward", "capturing", "register_attention"]

ATTN_IMPLEMENTATION = "rag_opt_rows"


@dataclass
class CaptureItem:
    """What to read from one prompt of the batch."""

    ctx_pos: torch.Tensor  # (n_ctx,) token positions of context tokens
    unit_of_ctx: torch.Tensor  # (n_ctx,) unit index of each context token
    n_units: int
    q_rows: torch.Tensor  # rows: question tokens then the final token
    n_question_rows: int
    # cross-document rows (optional): the last token of each source unit; per (source, context token) the causal
    # mask as an additive bias (0, or -inf after the source) and the weight the token's attention counts with (the
    # source row's prefix length when the token's unit is an earlier unit of another document, else 0)
    sources: torch.Tensor | None = None  # (S,) token positions
    source_bias: torch.Tensor | None = None  # (S, C)
    source_weight: torch.Tensor | None = None  # (S, C)
    row: int | None = None  # the batch row it reads (None: its own index in the capture's items)
    # a question pass (rag_opt.models.parallel): the pass's rows [start, end) that are this question's tokens, and
    # how many cached tokens its batch row holds (its keys/values before the pass's own, at Capture.room_at)
    rows: tuple[int, int] | None = None
    cached: int | None = None


@dataclass
class Capture:
    """The attention rows to read during one forward pass over a batch of prompts, and what was read.

    ``stop_after``: the last layer needed (early exit): the forward pass is abandoned once that layer's rows are
    recorded, so deeper layers cost nothing.
    """

    items: list[CaptureItem]
    stop_after: int | None = None
    # parallel encoding (rag_opt.models.parallel): ``keep_kv`` keeps every layer's key/value states (a document
    # pass); ``past`` holds per layer the cached states (B, KVH, C, d) that this pass's tokens attend to before
    # their own (a question pass over cached documents: every item has ``rows`` and ``cached``)
    keep_kv: bool = False
    past: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    # where ``past``'s tensors have room for the pass's own states (they are written there, nothing is copied)
    room_at: int = 0
    # a question pass: per item, what every layer reads the same way (see _question_setup)
    setup: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # a document pass that also keeps some tokens' query states (rotary embeddings applied): per batch row the
    # token positions to keep (``keep_q``), and per layer, per row, their queries (heads, rows, head_dim) in ``q``
    keep_q: list[torch.Tensor] | None = None
    q: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    # a packed document pass (rag_opt.models.document_pass): batch row 0 holds several sequences one after the
    # other, each [start, end) attending causally to itself only (no mask is made: see _rows_mask)
    segments: list[tuple[int, int]] | None = None
    sums: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # layer -> per item (views, heads, units)
    # layer -> per item (heads, units): sum over the unit's sources of (attention on the unit × source prefix), or
    # None for an item without sources
    cross: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)


class StopForward(Exception):
    """Raised inside the forward pass once the last needed layer is recorded (caught by the extractor)."""


CROSS_CHUNK = 128  # source rows per matmul in the cross-document read

_ACTIVE: contextvars.ContextVar[Capture | None] = contextvars.ContextVar("rag_opt_capture", default=None)
_REGISTER_LOCK = threading.Lock()
_registered = False


def _rows_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    capture = _ACTIVE.get()
    if capture is not None:
        checkpoint()  # layer by layer: a long pass stops within a layer of its caller giving up (rag_opt.work)
        index = int(getattr(module, "layer_idx", len(capture.sums)))
        if capture.past is not None:  # a question pass: its own states go into the room after the cached ones
            past_k, past_v = capture.past[index]
            end = capture.room_at + key.shape[2]
            past_k[:, :, capture.room_at : end] = key
            past_v[:, :, capture.room_at : end] = value
            return _question_attention(capture, module, query, past_k[:, :, :end], past_v[:, :, :end], scaling), None
        if capture.keep_kv:
            capture.kv[index] = (key, value)
        if capture.keep_q is not None:
            capture.q[index] = [query[b].index_select(1, rows) for b, rows in enumerate(capture.keep_q)]
        layer = _record(capture, module, query, key, scaling)
        if capture.stop_after is not None and layer >= capture.stop_after:
            raise StopForward
        if capture.segments is not None:
            return _segment_attention(capture.segments, query, key, value, scaling), None
    out: tuple[torch.Tensor, None] = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
    return out


def _segment_attention(
    segments: list[tuple[int, int]], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """A packed pass's attention: each segment of row 0 causally over itself only, SDPA's causal path per segment
    (no ``T x T`` mask over the packed row). Returns ``(1, T, H, d)`` like transformers' SDPA function."""
    import torch

    gqa = key.shape[1] != query.shape[1]
    out = torch.empty_like(query)
    for s, e in segments:
        out[:, :, s:e] = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True, scale=scaling, enable_gqa=gqa
        )
    return out.transpose(1, 2).contiguous()


def _rows_mask(*args: Any, **kwargs: Any) -> Any:
    """transformers' SDPA mask, except in a packed document pass, whose attention needs none (its restarting
    position ids would otherwise make a ``T x T`` packed-sequence mask)."""
    from transformers.masking_utils import sdpa_mask

    capture = _ACTIVE.get()
    if capture is not None and capture.segments is not None:
        return None
    return sdpa_mask(*args, **kwargs)


def _question_attention(
    capture: Capture, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """A question pass's attention, question by question, computed once for both uses.

    Every token of a question pass belongs to one question (:attr:`CaptureItem.rows`), which reads its row's
    cached tokens and, causally, its own tokens, never another question's. So each question's attention is a
    small product over its row's first keys, up to its own last token (grouped-query heads read their shared
    key/value head without repeating it), in float32, with the keys it may not read (the row's padding, earlier
    questions' tokens, its own future tokens) masked: no keys are copied per question, and a row's states are
    converted to float32 once for all its questions. Its probabilities give the recorded rows (renormalised over
    the context tokens, as :func:`_record` computes them) and, times the values, the layer's output. This replaces
    SDPA over the whole packed row plus a second product for the recorded rows. Returns ``(B, T, H, d)`` like
    transformers' SDPA function; raises :class:`StopForward` after the last layer needed, before its output is
    computed."""
    import torch

    b_, h, t, d = query.shape
    kvh = key.shape[1]
    g = h // kvh
    scale = scaling if scaling is not None else d**-0.5
    room = capture.room_at
    layer = int(getattr(module, "layer_idx", len(capture.sums)))
    last = capture.stop_after is not None and layer >= capture.stop_after
    out = None if last else query.new_zeros(b_, h, t, d)
    per_item: list[torch.Tensor] = []
    states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per batch row, its keys/values in float32
    for i, item in enumerate(capture.items):
        b = i if item.row is None else item.row
        a, e, c = _question_span(item)
        n, keys = e - a, room + e
        in_ctx, unit_of, rel, future = _question_setup(capture, i, item, a, keys)
        if b not in states:  # a row's questions read the same states: converted once (a view when already float32)
            states[b] = (key[b, :, : room + t].float(), value[b, :, : room + t].float())
        k, v = states[b]
        # its keys are the row's first ``keys`` (contiguous, nothing copied): the cached tokens, then padding and
        # the earlier questions' tokens (masked), then its own tokens (causal)
        q = (query[b, :, a:e].float() * scale).reshape(kvh, g * n, d)  # head k*g + j reads key/value head k
        logits = torch.matmul(q, k[:, :keys].transpose(-1, -2)).view(h, n, keys)
        if room + a > c:
            logits[:, :, c : room + a] = float("-inf")
        logits[:, :, room + a :].masked_fill_(future, float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # (H, n, keys)
        per_item.append(_question_sums(item, probs, in_ctx, unit_of, rel))
        if out is not None:
            out[b, :, a:e] = torch.matmul(probs.view(kvh, g * n, keys), v[:, :keys]).view(h, n, d).to(out.dtype)
    capture.sums[layer] = per_item
    capture.cross[layer] = [None] * len(per_item)
    if out is None:
        raise StopForward
    return out.transpose(1, 2).contiguous()


def _question_span(item: CaptureItem) -> tuple[int, int, int]:
    """(first row, end row, cached tokens) of a question pass's item."""
    if item.rows is None or item.cached is None:
        raise ValueError("every item of a question pass needs its rows and its row's cached token count")
    return item.rows[0], item.rows[1], item.cached


def _question_setup(
    capture: Capture, i: int, item: CaptureItem, start: int, keys: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What every layer of a question pass reads the same way for item ``i`` (rows ``start`` to ``start + n``),
    made once per pass: over its ``keys`` keys (the row's first), which are context tokens (1.0) and the unit of
    each (``n_units``: none); its recorded rows relative to ``start``; and the mask of each own token's future
    tokens."""
    import torch

    got = capture.setup.get(i)
    if got is None:
        a, e, _ = _question_span(item)
        dev = item.ctx_pos.device
        in_ctx = torch.zeros(keys, dtype=torch.float32, device=dev)
        in_ctx[item.ctx_pos] = 1.0
        unit_of = torch.full((keys,), item.n_units, dtype=torch.long, device=dev)
        unit_of[item.ctx_pos] = item.unit_of_ctx
        future = torch.ones(e - a, e - a, dtype=torch.bool, device=dev).triu(1)
        got = capture.setup[i] = (in_ctx, unit_of, item.q_rows - start, future)
    return got


def _question_sums(
    item: CaptureItem, probs: torch.Tensor, in_ctx: torch.Tensor, unit_of: torch.Tensor, rel: torch.Tensor
) -> torch.Tensor:
    """:func:`_unit_sums` of a question's probabilities over its keys (``probs``: ``(H, n, K)``; ``in_ctx``,
    ``unit_of`` and ``rel`` from :func:`_question_setup`), without copying them: each recorded row is renormalised
    over the context tokens by a weight (its mass there), and the question rows' mean is one weighted sum over the
    rows."""
    import torch

    h, n, _ = probs.shape
    mass = torch.matmul(probs, in_ctx)  # (H, n): each row's attention on the context tokens
    final = int(rel[-1])
    last = probs[:, final, :] / mass[:, final : final + 1]
    nq = item.n_question_rows
    if nq:
        weight = torch.zeros(h, n, dtype=probs.dtype, device=probs.device)
        weight.index_add_(1, rel[:nq], 1.0 / (nq * mass.index_select(1, rel[:nq])))
        question = torch.bmm(weight.unsqueeze(1), probs).squeeze(1)  # (H, K)
    else:
        question = last
    views = torch.stack([last, question])  # (V, H, K)
    sums = torch.zeros(views.shape[0], h, item.n_units + 1, dtype=torch.float32, device=probs.device)
    sums.index_add_(2, unit_of, views)
    return sums[..., : item.n_units]


def _record(capture: Capture, module: Any, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> int:
    """Record this layer's rows for every prompt of the batch; returns the layer index.

    Items that read the same context of the same batch row (several questions over one document set, packed in
    one question pass) share one selection of its keys; each item's product stays its own (one product over all
    their rows would leave the caches, and cost more)."""
    import torch

    n_heads = query.shape[1]
    head_dim = query.shape[-1]
    scale = scaling if scaling is not None else head_dim**-0.5
    per_item: list[torch.Tensor] = []
    cross: list[torch.Tensor | None] = []
    keys: dict[tuple[int, int], torch.Tensor] = {}
    for i, item in enumerate(capture.items):
        b = i if item.row is None else item.row
        q = query[b].index_select(1, item.q_rows).float()  # (H, R, d)
        k = keys.get((b, id(item.ctx_pos)))
        if k is None:
            k = keys[(b, id(item.ctx_pos))] = key[b].index_select(1, item.ctx_pos).float()  # (KVH, C, d)
        kvh, rows = k.shape[0], q.shape[1]
        # grouped: the query heads that share a key/value head read it together (no repeated keys)
        logits = torch.matmul(q.reshape(kvh, (n_heads // kvh) * rows, -1), k.transpose(-1, -2))
        probs = torch.softmax(logits.reshape(n_heads, rows, -1) * scale, dim=-1)  # (H, R, C)
        per_item.append(_unit_sums(item, probs))
        if item.sources is not None and k.shape[0] != n_heads:
            k = k.repeat_interleave(n_heads // k.shape[0], dim=0)
        cross.append(_cross_rows(item, query[b], k, scale) if item.sources is not None else None)
    layer = int(getattr(module, "layer_idx", len(capture.sums)))
    capture.sums[layer] = per_item
    capture.cross[layer] = cross
    return layer


def _unit_sums(item: CaptureItem, probs: torch.Tensor) -> torch.Tensor:
    """``(views, heads, units)``: the final token's row and the question rows' mean (``probs``: (H, R, C)),
    summed over each unit's context tokens."""
    import torch

    nq = item.n_question_rows
    views = torch.stack([probs[:, -1, :], probs[:, :nq, :].mean(dim=1) if nq else probs[:, -1, :]])  # (V, H, C)
    sums = torch.zeros(views.shape[0], probs.shape[0], item.n_units, dtype=torch.float32, device=views.device)
    sums.index_add_(2, item.unit_of_ctx, views)
    return sums


def _cross_rows(item: CaptureItem, query: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Per head and unit: Σ over the unit's sources of the source row's attention on the unit's tokens (causal,
    renormalised over the context the row sees), times the row's prefix length (relative to uniform)."""
    import torch

    assert item.sources is not None and item.source_bias is not None and item.source_weight is not None
    n_heads = k.shape[0]
    per_token = torch.zeros(n_heads, k.shape[1], dtype=torch.float32, device=k.device)  # (H, C)
    for a in range(0, int(item.sources.shape[0]), CROSS_CHUNK):
        q = query.index_select(1, item.sources[a : a + CROSS_CHUNK]).float()  # (H, S, d)
        logits = torch.baddbmm(
            item.source_bias[a : a + CROSS_CHUNK].expand(n_heads, -1, -1), q, k.transpose(-1, -2), alpha=scale
        )  # (H, S, C), -inf after each source
        probs = torch.softmax(logits, dim=-1)
        per_token += (probs * item.source_weight[None, a : a + CROSS_CHUNK]).sum(dim=1)
    out = torch.zeros(n_heads, item.n_units, dtype=torch.float32, device=k.device)
    out.index_add_(1, item.unit_of_ctx, per_token)
    return out


def register_attention() -> None:
    """Register rag-opt's attention function with transformers (idempotent)."""
    global _registered
    with _REGISTER_LOCK:
        if _registered:
            return
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, _rows_attention)
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _rows_mask)
        _registered = True


@contextmanager
def capturing(capture: Capture) -> Iterator[Capture]:
    """Record attention rows into ``capture`` for forward passes run inside this block (this context only)."""
    token = _ACTIVE.set(capture)
    try:
        yield capture
    finally:
        _ACTIVE.reset(token)
