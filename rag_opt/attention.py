"""One forward pass of the proxy model → per-unit, per-layer, per-head attention features.

The proxy runs with its fast attention (PyTorch SDPA). A registered attention function wraps SDPA and, only
while an extraction is active, also computes the attention rows we need — those of the question's tokens and
of the prompt's final token — from the layer's query and key states (rotary embeddings already applied, GQA
key heads repeated), restricted to the context tokens. This is exactly eager attention renormalised over the
context, at the cost of ``rows × context`` dot products per head instead of a full ``T × T`` matrix.

Two *views* are read per layer and head:

* ``last``: the attention row of the prompt's final token;
* ``question``: the mean of the rows of the question's own tokens.

Per unit (a sentence, title or protected block) the feature is the mean attention per token of the unit,
expressed relative to uniform attention over the context (so 1.0 means "as much as an average token"),
which keeps features comparable across context lengths. Per document, the share of the context's attention
mass that falls on the document is also returned.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from rag_opt.proxy import ProxyModel

logger = logging.getLogger(__name__)

VIEWS = ("last", "question")
CONTEXT_PREFIX = "Documents:\n"  # takes the first position, whose attention-sink role would distort document 1
QUESTION_PREFIX = "Question: "
ANSWER_SUFFIX = "\nAnswer:"
DOC_SEPARATOR = "\n\n"
TEMPLATE_ID = "ctx-q-v2"  # changes whenever the prompt layout below changes (keys calibration caches)


@dataclass(frozen=True)
class PromptLayout:
    """A rendered prompt with the character span of every unit and of the question."""

    text: str
    unit_spans: list[tuple[int, int]]
    unit_doc: list[int]
    question_span: tuple[int, int]


def render_prompt(docs: Sequence[Sequence[str]], question: str) -> PromptLayout:
    """Render ``docs`` (each a sequence of unit strings, concatenated verbatim) and the question.

    Layout: ``Documents:``, the documents separated by a blank line, then ``Question: <question>`` and
    ``Answer:``. The prefix keeps the model's attention sink (the first token) out of the documents.
    """
    parts: list[str] = [CONTEXT_PREFIX]
    spans: list[tuple[int, int]] = []
    unit_doc: list[int] = []
    pos = len(CONTEXT_PREFIX)
    for d, units in enumerate(docs):
        if d:
            parts.append(DOC_SEPARATOR)
            pos += len(DOC_SEPARATOR)
        for unit in units:
            parts.append(unit)
            spans.append((pos, pos + len(unit)))
            unit_doc.append(d)
            pos += len(unit)
    parts.append(DOC_SEPARATOR + QUESTION_PREFIX)
    pos += len(DOC_SEPARATOR) + len(QUESTION_PREFIX)
    q_span = (pos, pos + len(question))
    parts.append(question)
    parts.append(ANSWER_SUFFIX)
    return PromptLayout("".join(parts), spans, unit_doc, q_span)


@dataclass
class AttentionFeatures:
    """Attention read from one forward pass (or several windows) of the proxy model."""

    unit: np.ndarray  # (n_units, n_views, n_layers, n_heads): mean attention per token / uniform
    doc_mass: np.ndarray  # (n_docs, n_views, n_layers, n_heads): share of context attention on each doc
    unit_tokens: np.ndarray  # (n_units,) proxy tokens per unit (0 when a unit got no token of its own)
    context_tokens: int  # context tokens in the largest window
    windows: int

    @property
    def num_layers(self) -> int:
        return int(self.unit.shape[2])

    @property
    def num_heads(self) -> int:
        return int(self.unit.shape[3])


# ---------------------------------------------------------------------------------------------------------
# The attention function: SDPA plus the rows we need while a capture is active.


@dataclass
class _Capture:
    ctx_pos: torch.Tensor  # (n_ctx,) token positions of context tokens
    unit_of_ctx: torch.Tensor  # (n_ctx,) unit index of each context token
    n_units: int
    q_rows: torch.Tensor  # rows: question tokens then the final token
    n_question_rows: int
    sums: dict[int, torch.Tensor]  # layer -> (n_views, n_heads, n_units) attention summed per unit


_ACTIVE: contextvars.ContextVar[_Capture | None] = contextvars.ContextVar("rag_opt_capture", default=None)
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
        _record(capture, module, query, key, scaling)
    out: tuple[torch.Tensor, None] = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
    return out


def _record(capture: _Capture, module: Any, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
    import torch

    n_heads = query.shape[1]
    head_dim = query.shape[-1]
    scale = scaling if scaling is not None else head_dim**-0.5
    q = query[0].index_select(1, capture.q_rows).float()  # (H, R, d)
    k = key[0].index_select(1, capture.ctx_pos).float()  # (KVH, C, d)
    if k.shape[0] != n_heads:
        k = k.repeat_interleave(n_heads // k.shape[0], dim=0)
    probs = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale, dim=-1)  # (H, R, C)
    nq = capture.n_question_rows
    views = torch.stack([probs[:, -1, :], probs[:, :nq, :].mean(dim=1) if nq else probs[:, -1, :]])  # (V,H,C)
    sums = torch.zeros(views.shape[0], n_heads, capture.n_units, dtype=torch.float32, device=views.device)
    sums.index_add_(2, capture.unit_of_ctx, views)
    layer = int(getattr(module, "layer_idx", len(capture.sums)))
    capture.sums[layer] = sums


def register_attention() -> None:
    """Register rag-opt's attention function with transformers (idempotent)."""
    global _registered
    with _REGISTER_LOCK:
        if _registered:
            return
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        from rag_opt.proxy import ATTN_IMPLEMENTATION

        AttentionInterface.register(ATTN_IMPLEMENTATION, _rows_attention)
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
        _registered = True


# ---------------------------------------------------------------------------------------------------------
# Extraction


def _token_units(offsets: list[tuple[int, int]], layout: PromptLayout) -> tuple[list[int], list[int], list[int]]:
    """Assign prompt tokens to units (by each token's last character) and find the question's tokens."""
    starts = [s for s, _ in layout.unit_spans]
    ctx_pos: list[int] = []
    unit_of: list[int] = []
    q_rows: list[int] = []
    qs, qe = layout.question_span
    for i, (s, e) in enumerate(offsets):
        if e <= s:
            continue
        last = e - 1
        if qs <= last and s < qe:
            q_rows.append(i)
            continue
        j = bisect_right(starts, last) - 1
        if j >= 0 and layout.unit_spans[j][0] <= last < layout.unit_spans[j][1]:
            ctx_pos.append(i)
            unit_of.append(j)
    return ctx_pos, unit_of, q_rows


def _run_window(proxy: ProxyModel, docs: Sequence[Sequence[str]], question: str) -> tuple[np.ndarray, np.ndarray, int]:
    """One forward pass. Returns (unit sums (U, V, L, H), unit token counts (U,), context tokens)."""
    import torch

    layout = render_prompt(docs, question)
    enc = proxy.tokenizer(layout.text, return_offsets_mapping=True, add_special_tokens=True)
    ids: list[int] = list(enc["input_ids"])
    offsets: list[tuple[int, int]] = [(int(s), int(e)) for s, e in enc["offset_mapping"]]
    ctx_pos, unit_of, q_rows = _token_units(offsets, layout)
    n_units = len(layout.unit_spans)
    last = len(ids) - 1
    rows = q_rows + [last]
    dev = proxy.device
    capture = _Capture(
        ctx_pos=torch.tensor(ctx_pos, dtype=torch.long, device=dev),
        unit_of_ctx=torch.tensor(unit_of, dtype=torch.long, device=dev),
        n_units=n_units,
        q_rows=torch.tensor(rows, dtype=torch.long, device=dev),
        n_question_rows=len(q_rows),
        sums={},
    )
    token = _ACTIVE.set(capture)
    try:
        with proxy.lock, torch.inference_mode():
            # Only the attention rows are needed: stop before the LM head by running the base model.
            base = getattr(proxy.model, "model", None) or proxy.model.base_model
            base(input_ids=torch.tensor([ids], device=dev), use_cache=False)
    finally:
        _ACTIVE.reset(token)
    n_layers = proxy.num_layers
    if len(capture.sums) != n_layers:
        raise RuntimeError(
            f"captured attention from {len(capture.sums)} of {n_layers} layers: the proxy model's attention "
            "does not dispatch through transformers' AttentionInterface"
        )
    stacked = torch.stack([capture.sums[i] for i in range(n_layers)])  # (L, V, H, U)
    unit_sums = stacked.permute(3, 1, 0, 2).cpu().numpy()  # (U, V, L, H)
    counts = np.bincount(np.asarray(unit_of, dtype=np.int64), minlength=n_units)
    return unit_sums, counts, len(ctx_pos)


def extract(
    proxy: ProxyModel,
    docs: Sequence[Sequence[str]],
    question: str,
    *,
    max_tokens: int = 2048,
) -> AttentionFeatures:
    """Attention features for every unit of ``docs`` (each a list of unit strings) given ``question``.

    Contexts longer than ``max_tokens`` proxy tokens are processed in windows of whole documents (a document
    longer than a window is split between units); every window repeats the question. Windows never exceed the
    model's own context length.
    """
    if not question.strip():
        raise ValueError("question is empty")
    windows = _plan_windows(proxy, docs, question, min(max_tokens, proxy.max_positions))
    n_units = sum(len(u) for u in docs)
    n_docs = len(docs)
    L, H = proxy.num_layers, proxy.num_heads
    unit = np.zeros((n_units, len(VIEWS), L, H), dtype=np.float32)
    doc_mass = np.zeros((n_docs, len(VIEWS), L, H), dtype=np.float32)
    unit_tokens = np.zeros(n_units, dtype=np.int64)
    first_unit = np.cumsum([0] + [len(u) for u in docs])
    max_ctx = 0
    for window in windows:
        w_docs = [docs[d][a:b] for d, a, b in window]
        sums, counts, n_ctx = _run_window(proxy, w_docs, question)
        max_ctx = max(max_ctx, n_ctx)
        k = 0
        for d, a, b in window:
            for j in range(a, b):
                g = first_unit[d] + j
                unit_tokens[g] = counts[k]
                if counts[k]:
                    unit[g] = sums[k] / counts[k] * n_ctx
                doc_mass[d] += sums[k]
                k += 1
    return AttentionFeatures(unit, doc_mass, unit_tokens, max_ctx, len(windows))


def _plan_windows(
    proxy: ProxyModel, docs: Sequence[Sequence[str]], question: str, max_tokens: int
) -> list[list[tuple[int, int, int]]]:
    """Group (doc, unit_start, unit_end) pieces into windows that fit ``max_tokens`` with the question."""
    all_units = [u for units in docs for u in units]
    if not all_units:
        raise ValueError("no context to score: every document is empty")
    lengths_flat = [len(x) for x in proxy.tokenizer(all_units, add_special_tokens=False)["input_ids"]]
    overhead = len(proxy.tokenizer(CONTEXT_PREFIX + QUESTION_PREFIX + question + ANSWER_SUFFIX)["input_ids"]) + 8
    budget = max(max_tokens - overhead, 64)
    windows: list[list[tuple[int, int, int]]] = [[]]
    used = 0
    k = 0
    for d, units in enumerate(docs):
        lengths = lengths_flat[k : k + len(units)]
        k += len(units)
        a = 0
        while a < len(units):
            # take as many units of this document as fit in the current window
            b, size = a, 2
            while b < len(units) and used + size + lengths[b] <= budget:
                size += lengths[b]
                b += 1
            if b == a:
                if windows[-1]:
                    windows.append([])
                    used = 0
                    continue
                b, size = a + 1, 2 + lengths[a]  # a single unit larger than a window: give it its own
                logger.warning("a unit of %d proxy tokens exceeds the window of %d tokens", lengths[a], budget)
            windows[-1].append((d, a, b))
            used += size
            a = b
    return [w for w in windows if w]
