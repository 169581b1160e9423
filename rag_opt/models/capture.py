"""The attention hook: PyTorch SDPA plus, while a capture is active, the attention rows rag-opt reads.

A registered transformers attention function wraps SDPA and, only inside :func:`capturing`, also computes the
attention rows we need — those of the question's tokens and of the prompt's final token — from the layer's query
and key states (rotary embeddings already applied, GQA key heads repeated), restricted to the context tokens.
This is exactly eager attention renormalised over the context, at the cost of ``rows × context`` dot products
per head instead of a full ``T × T`` matrix (never ``output_attentions=True``).
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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


@dataclass
class Capture:
    """The attention rows to read during one forward pass over a batch of prompts, and what was read.

    ``stop_after``: the last layer needed (early exit): the forward pass is abandoned once that layer's rows are
    recorded, so deeper layers cost nothing.
    """

    items: list[CaptureItem]
    stop_after: int | None = None
    sums: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # layer -> per item (views, heads, units)


class StopForward(Exception):
    """Raised inside the forward pass once the last needed layer is recorded (caught by the extractor)."""


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
        layer = _record(capture, module, query, key, scaling)
        if capture.stop_after is not None and layer >= capture.stop_after:
            raise StopForward
    out: tuple[torch.Tensor, None] = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
    return out


def _record(capture: Capture, module: Any, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> int:
    """Record this layer's rows for every prompt of the batch; returns the layer index."""
    import torch

    n_heads = query.shape[1]
    head_dim = query.shape[-1]
    scale = scaling if scaling is not None else head_dim**-0.5
    per_item = []
    for b, item in enumerate(capture.items):
        q = query[b].index_select(1, item.q_rows).float()  # (H, R, d)
        k = key[b].index_select(1, item.ctx_pos).float()  # (KVH, C, d)
        if k.shape[0] != n_heads:
            k = k.repeat_interleave(n_heads // k.shape[0], dim=0)
        probs = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale, dim=-1)  # (H, R, C)
        nq = item.n_question_rows
        views = torch.stack([probs[:, -1, :], probs[:, :nq, :].mean(dim=1) if nq else probs[:, -1, :]])  # (V,H,C)
        sums = torch.zeros(views.shape[0], n_heads, item.n_units, dtype=torch.float32, device=views.device)
        sums.index_add_(2, item.unit_of_ctx, views)
        per_item.append(sums)
    layer = int(getattr(module, "layer_idx", len(capture.sums)))
    capture.sums[layer] = per_item
    return layer


def register_attention() -> None:
    """Register rag-opt's attention function with transformers (idempotent)."""
    global _registered
    with _REGISTER_LOCK:
        if _registered:
            return
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(ATTN_IMPLEMENTATION, _rows_attention)
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
        _registered = True


@contextmanager
def capturing(capture: Capture) -> Iterator[Capture]:
    """Record attention rows into ``capture`` for forward passes run inside this block (this context only)."""
    token = _ACTIVE.set(capture)
    try:
        yield capture
    finally:
        _ACTIVE.reset(token)
