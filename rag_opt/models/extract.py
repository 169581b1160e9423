"""One forward pass of the proxy model → per-unit, per-layer, per-head attention features.

The attention rows come from the hook in :mod:`rag_opt.models.capture`. Two *views* are read per layer and
head:

* ``last``: the attention row of the prompt's final token;
* ``question``: the mean of the rows of the question's own tokens.

Per unit (a sentence, title or protected block) the feature is the mean attention per token of the unit,
expressed relative to uniform attention over the context (so 1.0 means "as much as an average token"),
which keeps features comparable across context lengths. Per document, the share of the context's attention
mass that falls on the document is also returned.

With ``cross=True`` a third reading is added per unit, layer and head: *cross-document attention*, the mean
attention per token the unit receives from the last token of every sentence of another, later document in the
same pass (each row relative to uniform over the context it sees). A bridge sentence that names an entity draws
attention from that entity's own paragraph. Under parallel encoding the sources are the sentence ends of every
other document, read from their cached query states (:mod:`rag_opt.models.parallel_cross`).
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rag_opt.errors import InvalidInputError
from rag_opt.models.capture import Capture, CaptureItem, StopForward, capturing
from rag_opt.models.prompt import (
    ANSWER_SUFFIX,
    CONTEXT_PREFIX,
    QUESTION_PREFIX,
    VIEWS,
    PromptLayout,
    render_prompt,
    template_for,
)
from rag_opt.work import check_proxy_tokens, checkpoint

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.models.loader import ProxyModel

__all__ = ["AttentionFeatures", "extract", "extract_batch"]

logger = logging.getLogger(__name__)


@dataclass
class AttentionFeatures:
    """Attention read from one forward pass (or several windows) of the proxy model."""

    unit: np.ndarray  # (n_units, n_views, n_layers, n_heads): mean attention per token / uniform
    doc_mass: np.ndarray  # (n_docs, n_views, n_layers, n_heads): share of context attention on each doc
    unit_tokens: np.ndarray  # (n_units,) proxy tokens per unit (0 when a unit got no token of its own)
    context_tokens: int  # context tokens in the largest window
    windows: int
    cross: np.ndarray | None = None  # (n_units, n_layers, n_heads): cross-document attention (``extract(cross=True)``)
    cross_sources: np.ndarray | None = None  # (n_units,) how many later sentences of other documents it averages
    encoding: str = "joint"  # how the context was read: "joint" (one causal pass) or "parallel"
    cache_hits: int = 0  # parallel encoding: blocks whose encoding came from the cache
    cache_misses: int = 0  # ... and blocks encoded by this call

    @property
    def num_layers(self) -> int:
        return int(self.unit.shape[2])

    @property
    def num_heads(self) -> int:
        return int(self.unit.shape[3])

    def first_layers(self, k: int) -> AttentionFeatures:
        """The features of the first ``k`` layers only (what an early exit after layer ``k`` reads)."""
        if not 1 <= k <= self.num_layers:
            raise InvalidInputError(f"cannot take {k} layers of features with {self.num_layers}")
        if k == self.num_layers:
            return self
        return AttentionFeatures(
            self.unit[:, :, :k],
            self.doc_mass[:, :, :k],
            self.unit_tokens,
            self.context_tokens,
            self.windows,
            None if self.cross is None else self.cross[:, :k],
            self.cross_sources,
            self.encoding,
            self.cache_hits,
            self.cache_misses,
        )


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


@dataclass(frozen=True)
class _Prompt:
    """One forward-pass prompt: a window of one context, tokenized, with what to read from it."""

    context: int
    window: list[tuple[int, int, int]]
    ids: list[int]
    ctx_pos: list[int]
    unit_of: list[int]
    q_rows: list[int]
    n_units: int


def _prompt(
    proxy: ProxyModel, context: int, window: list[tuple[int, int, int]], docs: Sequence[Sequence[str]], question: str
) -> _Prompt:
    layout = render_prompt([docs[d][a:b] for d, a, b in window], question)
    enc = proxy.tokenizer(layout.text, return_offsets_mapping=True, add_special_tokens=True)
    offsets: list[tuple[int, int]] = [(int(s), int(e)) for s, e in enc["offset_mapping"]]
    ctx_pos, unit_of, q_rows = _token_units(offsets, layout)
    return _Prompt(context, window, list(enc["input_ids"]), ctx_pos, unit_of, q_rows, len(layout.unit_spans))


@dataclass(frozen=True)
class _Read:
    """What one prompt's forward pass gave."""

    sums: np.ndarray  # (U, V, L, H) attention summed over each unit's tokens
    counts: np.ndarray  # (U,) tokens per unit
    n_ctx: int  # context tokens
    cross: np.ndarray | None = None  # (U, L, H) Σ over sources of attention × prefix (see capture._cross_rows)
    cross_sources: np.ndarray | None = None  # (U,) sources per unit


@dataclass(frozen=True)
class _Sources:
    """Cross-document rows of a prompt (see :class:`~rag_opt.models.capture.CaptureItem`)."""

    ends: np.ndarray  # (S,) token position of the last token of each unit that has tokens
    ok: np.ndarray  # (S, U) bool: the source is a later unit of another document than the unit
    bias: np.ndarray  # (S, C) float32: 0 up to the source's own position, -inf after (causal)
    weight: np.ndarray  # (S, C) float32: the source's prefix length where the token's unit is ``ok``, else 0


def _cross_sources(prompt: _Prompt) -> _Sources:
    unit_of = np.asarray(prompt.unit_of, dtype=np.int64)
    ctx = np.asarray(prompt.ctx_pos, dtype=np.int64)
    doc = np.concatenate([[d] * (b - a) for d, a, b in prompt.window]).astype(np.int64)
    src_units = np.unique(unit_of)
    last = np.zeros(len(src_units), dtype=np.int64)
    np.maximum.at(last, np.searchsorted(src_units, unit_of), np.arange(len(unit_of)))
    ends = ctx[last]
    units = np.arange(prompt.n_units)
    ok = (doc[src_units][:, None] != doc[None, :]) & (src_units[:, None] > units[None, :])
    bias = np.where(ctx[None, :] > ends[:, None], -np.inf, 0.0).astype(np.float32)
    weight = (ok[:, unit_of] * (last + 1)[:, None]).astype(np.float32)  # prefix: context tokens the row sees
    return _Sources(ends, ok, bias, weight)


def _run_prompts(proxy: ProxyModel, prompts: Sequence[_Prompt], layers: int, cross: bool = False) -> list[_Read]:
    """One forward pass over a batch of prompts (right-padded), stopping after ``layers`` layers."""
    import torch

    dev = proxy.device
    items = []
    sources: list[_Sources] = []
    for p in prompts:
        item = CaptureItem(
            ctx_pos=torch.tensor(p.ctx_pos, dtype=torch.long, device=dev),
            unit_of_ctx=torch.tensor(p.unit_of, dtype=torch.long, device=dev),
            n_units=p.n_units,
            q_rows=torch.tensor(p.q_rows + [len(p.ids) - 1], dtype=torch.long, device=dev),
            n_question_rows=len(p.q_rows),
        )
        if cross:
            src = _cross_sources(p)
            sources.append(src)
            item.sources = torch.tensor(src.ends, dtype=torch.long, device=dev)
            item.source_bias = torch.from_numpy(src.bias).to(dev)
            item.source_weight = torch.from_numpy(src.weight).to(dev)
        items.append(item)
    capture = Capture(items=items, stop_after=layers - 1 if layers < proxy.num_layers else None)
    width = max(len(p.ids) for p in prompts)
    pad = proxy.tokenizer.pad_token_id
    pad = pad if pad is not None else proxy.tokenizer.eos_token_id or 0
    ids = torch.tensor([p.ids + [pad] * (width - len(p.ids)) for p in prompts], device=dev)
    # Right padding and no attention mask: attention is causal, so no real token ever attends to the padding that
    # follows it, every prompt keeps its positions, and SDPA keeps its fast causal path (a padding mask would send
    # it down the masked path, slower on a CPU than one prompt at a time). Only real positions are read.
    with capturing(capture), proxy.lock, torch.inference_mode():
        if dev == "cpu":
            proxy.threads.apply()
        # Only the attention rows are needed: stop before the LM head by running the base model, and stop
        # after the last layer needed (early exit).
        base = getattr(proxy.model, "model", None) or proxy.model.base_model
        try:
            base(input_ids=ids, use_cache=False)
        except StopForward:
            pass
    if len(capture.sums) != layers:
        raise RuntimeError(
            f"captured attention from {len(capture.sums)} of {layers} layers: the proxy model's attention "
            "does not dispatch through transformers' AttentionInterface"
        )
    out = []
    for b, p in enumerate(prompts):
        stacked = torch.stack([capture.sums[i][b] for i in range(layers)])  # (L, V, H, U)
        unit_sums = stacked.permute(3, 1, 0, 2).cpu().numpy()  # (U, V, L, H)
        counts = np.bincount(np.asarray(p.unit_of, dtype=np.int64), minlength=p.n_units)
        read = _Read(unit_sums, counts, len(p.ctx_pos))
        if cross:
            rows = [capture.cross[i][b] for i in range(layers)]
            assert all(r is not None for r in rows)
            per_layer = torch.stack([r for r in rows if r is not None])  # (L, H, U)
            n_src = sources[b].ok.sum(axis=0)
            read = _Read(unit_sums, counts, len(p.ctx_pos), per_layer.permute(2, 0, 1).cpu().numpy(), n_src)
        out.append(read)
    return out


def extract(
    proxy: ProxyModel,
    docs: Sequence[Sequence[str]],
    question: str,
    *,
    max_tokens: int = 2048,
    layers: int | None = None,
    cross: bool = False,
    encoding: str = "joint",
    cache: EncodingCache | None = None,
) -> AttentionFeatures:
    """Attention features for every unit of ``docs`` (each a list of unit strings) given ``question``.

    Contexts longer than ``max_tokens`` proxy tokens are processed in windows of whole documents (a document
    longer than a window is split between units); every window repeats the question. Windows never exceed the
    model's own context length. ``layers``: run only the first this many layers (early exit; default all).
    ``cross``: also read cross-document attention (:attr:`AttentionFeatures.cross`; within each window).
    ``encoding``: ``"joint"`` (one causal pass over the whole prompt) or ``"parallel"`` (each document on its
    own, then a question pass: :mod:`rag_opt.models.parallel`; no windows, ``max_tokens`` bounds a block), whose
    document encodings ``cache`` keeps.
    """
    return extract_batch(
        proxy, [(docs, question)], max_tokens=max_tokens, layers=layers, cross=cross, encoding=encoding, cache=cache
    )[0]


def extract_batch(
    proxy: ProxyModel,
    contexts: Sequence[tuple[Sequence[Sequence[str]], str]],
    *,
    max_tokens: int = 2048,
    layers: int | None = None,
    batch_tokens: int = 6144,
    cross: bool = False,
    encoding: str = "joint",
    cache: EncodingCache | None = None,
) -> list[AttentionFeatures]:
    """:func:`extract` for several ``(docs, question)`` contexts, several prompts per forward pass.

    Prompts are sorted by length and padded into batches of at most ``batch_tokens`` tokens (padded size), which
    keeps padding small and bounds memory; the features equal those of one-at-a-time calls up to float rounding.
    """
    depth = proxy.num_layers if layers is None else int(layers)
    if not 1 <= depth <= proxy.num_layers:
        raise InvalidInputError(f"layers must be in 1..{proxy.num_layers}, got {layers}")
    template_for(encoding)  # refuses an unknown encoding
    if encoding == "parallel":
        if not contexts:
            return []
        from rag_opt.models.parallel_features import extract_parallel

        for _, question in contexts:
            if not question.strip():
                raise InvalidInputError("question is empty")
        return extract_parallel(
            proxy, contexts, layers=depth, max_tokens=max_tokens, cache=cache, batch_tokens=batch_tokens, cross=cross
        )
    prompts: list[_Prompt] = []
    for c, (docs, question) in enumerate(contexts):
        if not question.strip():
            raise InvalidInputError("question is empty")
        for window in _plan_windows(proxy, docs, question, min(max_tokens, proxy.max_positions)):
            prompts.append(_prompt(proxy, c, window, docs, question))
    results: dict[int, _Read] = {}
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i].ids))
    batch: list[int] = []
    for i in [*order, -1]:
        if batch and (i < 0 or len(prompts[i].ids) * (len(batch) + 1) > batch_tokens):
            checkpoint()  # between forward passes: stop here if the caller gave up (rag_opt.work)
            for j, res in zip(batch, _run_prompts(proxy, [prompts[j] for j in batch], depth, cross), strict=True):
                results[j] = res
            batch = []
        if i >= 0:
            batch.append(i)
    return [
        _assemble(
            contexts[c][0],
            [(prompts[i], results[i]) for i in range(len(prompts)) if prompts[i].context == c],
            depth,
            proxy.num_heads,
            cross,
        )
        for c in range(len(contexts))
    ]


def _assemble(
    docs: Sequence[Sequence[str]],
    windows: list[tuple[_Prompt, _Read]],
    n_layers: int,
    n_heads: int,
    cross: bool = False,
) -> AttentionFeatures:
    n_units = sum(len(u) for u in docs)
    unit = np.zeros((n_units, len(VIEWS), n_layers, n_heads), dtype=np.float32)
    cross_units = np.zeros((n_units, n_layers, n_heads), dtype=np.float32) if cross else None
    cross_sources = np.zeros(n_units, dtype=np.int64) if cross else None
    doc_mass = np.zeros((len(docs), len(VIEWS), n_layers, n_heads), dtype=np.float32)
    unit_tokens = np.zeros(n_units, dtype=np.int64)
    first_unit = np.cumsum([0] + [len(u) for u in docs])
    max_ctx = 0
    for prompt, read in windows:
        sums, counts, n_ctx = read.sums, read.counts, read.n_ctx
        max_ctx = max(max_ctx, n_ctx)
        k = 0
        for d, a, b in prompt.window:
            for j in range(a, b):
                g = first_unit[d] + j
                unit_tokens[g] = counts[k]
                if counts[k]:
                    unit[g] = sums[k] / counts[k] * n_ctx
                if cross_units is not None and cross_sources is not None:
                    assert read.cross is not None and read.cross_sources is not None
                    cross_sources[g] = read.cross_sources[k]
                    if counts[k] and read.cross_sources[k]:
                        cross_units[g] = read.cross[k] / (read.cross_sources[k] * counts[k])
                doc_mass[d] += sums[k]
                k += 1
    return AttentionFeatures(unit, doc_mass, unit_tokens, max_ctx, len(windows), cross_units, cross_sources)


def _plan_windows(
    proxy: ProxyModel, docs: Sequence[Sequence[str]], question: str, max_tokens: int
) -> list[list[tuple[int, int, int]]]:
    """Group (doc, unit_start, unit_end) pieces into windows that fit ``max_tokens`` with the question."""
    all_units = [u for units in docs for u in units]
    if not all_units:
        raise InvalidInputError(
            "no context to score: " + ("no documents were given" if not docs else "every document is empty")
        )
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
    planned = [w for w in windows if w]
    check_proxy_tokens(sum(lengths_flat) + overhead * len(planned))  # the question goes into every window
    return planned
