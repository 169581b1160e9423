"""One forward pass of the proxy model → per-unit, per-layer, per-head attention features.

The attention rows come from the hook in :mod:`rag_opt.models.capture`. Two *views* are read per layer and
head:

* ``last``: the attention row of the prompt's final token;
* ``question``: the mean of the rows of the question's own tokens.

Per unit (a sentence, title or protected block) the feature is the mean attention per token of the unit,
expressed relative to uniform attention over the context (so 1.0 means "as much as an average token"),
which keeps features comparable across context lengths. Per document, the share of the context's attention
mass that falls on the document is also returned.
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rag_opt.errors import InvalidInputError
from rag_opt.models.capture import Capture, capturing
from rag_opt.models.prompt import ANSWER_SUFFIX, CONTEXT_PREFIX, QUESTION_PREFIX, VIEWS, PromptLayout, render_prompt
from rag_opt.work import check_proxy_tokens, checkpoint

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.models.loader import ProxyModel

__all__ = ["AttentionFeatures", "extract"]

logger = logging.getLogger(__name__)


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
    capture = Capture(
        ctx_pos=torch.tensor(ctx_pos, dtype=torch.long, device=dev),
        unit_of_ctx=torch.tensor(unit_of, dtype=torch.long, device=dev),
        n_units=n_units,
        q_rows=torch.tensor(rows, dtype=torch.long, device=dev),
        n_question_rows=len(q_rows),
        sums={},
    )
    with capturing(capture), proxy.lock, torch.inference_mode():
        # Only the attention rows are needed: stop before the LM head by running the base model.
        base = getattr(proxy.model, "model", None) or proxy.model.base_model
        base(input_ids=torch.tensor([ids], device=dev), use_cache=False)
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
        raise InvalidInputError("question is empty")
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
        checkpoint()  # between forward passes: stop here if the caller gave up (rag_opt.work)
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
        raise InvalidInputError("no context to score: every document is empty")
    lengths_flat = [len(x) for x in proxy.tokenizer(all_units, add_special_tokens=False)["input_ids"]]
    check_proxy_tokens(sum(lengths_flat))  # before any forward pass (rag_opt.work)
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
