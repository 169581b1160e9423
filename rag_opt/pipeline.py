"""``ContextOptimizer`` wires the stages: segment → score → select → order → result.

Each stage takes the previous stage's output and returns its own; nothing reaches back.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from rag_opt.compressors.base import Scorer
from rag_opt.compressors.selection import Candidate, SelectionOptions, select
from rag_opt.features import ContextUnits
from rag_opt.orderers.lost_in_the_middle import end_placement
from rag_opt.text import segment
from rag_opt.tokens import TokenCounter, get_token_counter
from rag_opt.types import Document, DocumentLike, OptimizeResult, OutputDocument, Timings, Unit, to_documents

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.compressors.sentinel import SentinelCompressor

logger = logging.getLogger(__name__)

Ordering = Literal["input", "lost_in_the_middle", "relevance"]
ORDERINGS: tuple[str, ...] = ("input", "lost_in_the_middle", "relevance", "calibrated", "attention_sort")
PROXY_ORDERINGS = ("calibrated", "attention_sort")  # orderings that need the Sentinel proxy model


@dataclass
class _DocUnits:
    """A document's units: an optional title line, then the segments of its text."""

    doc: Document
    title: str | None
    spans: list[tuple[int, int]]  # segment spans in doc.text
    kinds: list[str]
    tokens: list[int]  # per segment, target tokens
    title_tokens: int
    text_tokens: int  # the whole text (BPE merges across segments make it differ from the sum)

    @property
    def candidates(self) -> list[bool]:
        """Which units the scorer ranks: sentences and blocks, not the title or headings."""
        return ([False] if self.title else []) + [k != "heading" for k in self.kinds]

    @property
    def unit_texts(self) -> list[str]:
        texts = [self.doc.text[s:e] for s, e in self.spans]
        return ([f"{self.title}\n"] if self.title else []) + texts


def _title_of(doc: Document) -> str | None:
    if doc.title:
        return doc.title
    t = doc.metadata.get("title")
    return t if isinstance(t, str) and t.strip() else None


def check_budget_args(ratio: float | None, target_tokens: int | None, threshold: float | None) -> None:
    """Validate the compression settings (at most one of ratio / target_tokens / threshold)."""
    given = [
        n for n, v in (("ratio", ratio), ("target_tokens", target_tokens), ("threshold", threshold)) if v is not None
    ]
    if len(given) > 1:
        raise ValueError(f"give at most one of ratio, target_tokens and threshold (got {' and '.join(given)})")
    if ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio):
            raise ValueError(f"ratio must be a number in (0, 1], got {ratio!r}")
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    if target_tokens is not None:
        if isinstance(target_tokens, bool) or not isinstance(target_tokens, int):
            raise ValueError(f"target_tokens must be an integer, got {target_tokens!r}")
        if target_tokens < 0:
            raise ValueError(f"target_tokens must be >= 0, got {target_tokens}")
    if threshold is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
            raise ValueError(f"threshold must be a probability in [0, 1], got {threshold!r}")


class ContextOptimizer:
    """Reusable optimizer: holds the configuration and (lazily) the loaded proxy model and probe.

    Args:
        model: proxy model (None: the embedded default SmolLM2-135M; a Hugging Face id, local folder or .gguf).
        target: the target LLM whose tokens budgets are measured in (tiktoken model/encoding name, or
            ``hf:<tokenizer>``); default ``o200k_base``.
        ratio / target_tokens / threshold: default compression (at most one); None = no compression.
        ordering: ``input`` (keep), ``lost_in_the_middle`` (best at both ends), ``relevance`` (best first),
            ``calibrated`` (best into the slots the proxy attends to most, from its calibration profile) or
            ``attention_sort`` (the proxy's attention sorts the kept documents, 2 rounds: extra forward passes).
            Document relevance is position-calibrated when a profile exists (``result.calibrated``).
        probe: ``"auto"`` (the probe shipped for the model), a path to a probe JSON, or None (raw attention).
        keep_best_per_doc: keep at least the best sentence of every document (while the budget allows).
        keep_first: always keep each document's first sentence (while the budget allows).
        device / dtype: where and how the proxy runs (default cuda when available, float32 on CPU).
        max_window_tokens: proxy tokens per forward pass; longer contexts are processed in windows (and their
            document relevance is not calibrated).
        trust_remote_code: passed to transformers for hub models (off by default).
        language: language code for sentence segmentation.
        scorer: score units with this instead of the Sentinel probe (e.g. ``rag_opt.compressors.BM25Scorer()``).
        doc_probe: the document relevance probe: ``"auto"`` (shipped for the model), a path, or None (document
            relevance = its best sentence's score).
        calibrate: position-calibrate document relevance when a calibration profile exists for the number of
            documents (shipped for the embedded model at 10, 20 and 30; ``rag-opt calibrate`` adds others).
    """

    def __init__(
        self,
        *,
        model: str | None = None,
        target: str | None = None,
        ratio: float | None = None,
        target_tokens: int | None = None,
        threshold: float | None = None,
        ordering: str = "input",
        probe: str | None = "auto",
        keep_best_per_doc: bool = False,
        keep_first: bool = False,
        device: str | None = None,
        dtype: str | None = None,
        max_window_tokens: int = 8192,
        trust_remote_code: bool = False,
        language: str = "en",
        scorer: Scorer | None = None,
        doc_probe: str | None = "auto",
        calibrate: bool = True,
    ) -> None:
        check_budget_args(ratio, target_tokens, threshold)
        if ordering not in ORDERINGS:
            raise ValueError(f"unknown ordering {ordering!r}; use one of {', '.join(ORDERINGS)}")
        if max_window_tokens < 128:
            raise ValueError("max_window_tokens must be at least 128")
        self.model = model
        self.target = target
        self.ratio = ratio
        self.target_tokens = target_tokens
        self.threshold = threshold
        self.ordering = ordering
        self.probe = probe
        self.keep_best_per_doc = keep_best_per_doc
        self.keep_first = keep_first
        self.device = device
        self.dtype = dtype
        self.max_window_tokens = max_window_tokens
        self.trust_remote_code = trust_remote_code
        self.language = language
        self.doc_probe = doc_probe
        self.calibrate = calibrate
        self._scorer: Scorer | None = scorer
        self._lock = threading.Lock()

    # -- lazily loaded pieces -----------------------------------------------------------------------------
    @property
    def counter(self) -> TokenCounter:
        return get_token_counter(self.target)

    def scorer(self) -> Scorer:
        """The scorer: the one given, else the Sentinel attention probe (loads the proxy model on first use)."""
        with self._lock:
            if self._scorer is None:
                from rag_opt.compressors.sentinel import SentinelCompressor

                self._scorer = SentinelCompressor.from_model(
                    self.model,
                    probe=self.probe,
                    device=self.device,
                    dtype=self.dtype,
                    max_tokens=self.max_window_tokens,
                    trust_remote_code=self.trust_remote_code,
                    doc_probe=self.doc_probe,
                    profiles="auto" if self.calibrate else None,
                )
            return self._scorer

    # -- the pipeline -------------------------------------------------------------------------------------
    def optimize(
        self,
        query: str,
        documents: Sequence[DocumentLike],
        *,
        ratio: float | None = None,
        target_tokens: int | None = None,
        threshold: float | None = None,
        ordering: str | None = None,
    ) -> OptimizeResult:
        """Optimize ``documents`` for ``query``; per-call settings override the optimizer's defaults."""
        t0 = time.perf_counter()
        if not isinstance(query, str):
            raise TypeError(f"query must be a string, got {type(query).__name__}")
        if not query.strip():
            raise ValueError("query is empty")
        check_budget_args(ratio, target_tokens, threshold)
        if ratio is None and target_tokens is None and threshold is None:
            ratio, target_tokens, threshold = self.ratio, self.target_tokens, self.threshold
        ordering = ordering or self.ordering
        if ordering not in ORDERINGS:
            raise ValueError(f"unknown ordering {ordering!r}; use one of {', '.join(ORDERINGS)}")
        if ordering in PROXY_ORDERINGS and self._scorer is not None and not isinstance(self._scorer, _sentinel()):
            raise ValueError(
                f"ordering {ordering!r} needs the proxy model's attention; it is not available with the "
                f"{type(self._scorer).__name__} scorer"
            )
        docs = to_documents(documents)
        for i, doc in enumerate(docs):
            if not doc.text.strip():
                raise ValueError(f"documents[{i}] is empty: every document needs some text")
        counter = self.counter
        timings = Timings()
        warnings: list[str] = []

        # segment
        t = time.perf_counter()
        units = [self._segment(d, counter) for d in docs]
        tokens_before = sum(u.title_tokens + u.text_tokens for u in units)
        timings.segment_ms = (time.perf_counter() - t) * 1e3

        compress = ratio is not None or target_tokens is not None or threshold is not None
        budget: int | None = None
        if ratio is not None:
            budget = int(math.floor(ratio * tokens_before))
        elif target_tokens is not None:
            budget = target_tokens

        # score (when compressing below the input size, or when the ordering needs relevance)
        scores: list[list[float | None]] = [[None] * len(u.spans) for u in units]
        doc_scores: list[float | None] = [None] * len(units)
        raw_scores: list[float | None] = [None] * len(units)
        method, proxy_name, calibrated = "none", None, False
        shrink = compress and (budget is None or budget < tokens_before)
        if shrink or ordering != "input":
            scorer = self.scorer()  # loading the model is not part of the score stage's timing
            t = time.perf_counter()
            sc = scorer.score(
                query, ContextUnits(docs=[u.unit_texts for u in units], candidate=[u.candidates for u in units])
            )
            method, proxy_name, calibrated = sc.method, sc.model, sc.calibrated
            if sc.calibration_note and ordering != "input":
                warnings.append(sc.calibration_note)
            if method == "raw-attention":
                warnings.append(
                    f"no probe for proxy model {proxy_name}: sentences were scored by raw attention (weaker)"
                )
            pos = 0
            for i, u in enumerate(units):
                n = len(u.unit_texts)
                scores[i] = [float(v) for v in sc.unit[pos + n - len(u.spans) : pos + n]]
                doc_scores[i] = float(sc.doc[i])
                raw_scores[i] = float(sc.doc_raw[i]) if sc.doc_raw is not None else doc_scores[i]
                pos += n
            timings.score_ms = (time.perf_counter() - t) * 1e3

        # select
        t = time.perf_counter()
        kept = (
            self._select(units, scores, budget, threshold, counter)
            if shrink
            else [[True] * len(u.spans) for u in units]
        )
        timings.select_ms = (time.perf_counter() - t) * 1e3

        out_docs = [
            self._output(i, u, scores[i], kept[i], doc_scores[i], raw_scores[i], counter) for i, u in enumerate(units)
        ]
        keep_doc = [any(k) for k in kept]

        # order
        t = time.perf_counter()
        idx = [i for i in range(len(units)) if keep_doc[i]]
        order = self._order(query, idx, out_docs, ordering, warnings)
        timings.order_ms = (time.perf_counter() - t) * 1e3

        documents_out = [out_docs[i] for i in order]
        dropped = [out_docs[i] for i in range(len(units)) if not keep_doc[i]]
        for gone in dropped:
            gone.text = ""
            gone.tokens_after = 0
        tokens_after = sum(out.tokens_after for out in documents_out)
        if budget is not None and tokens_after > budget:  # pragma: no cover - guarded by _select
            raise AssertionError(f"selection exceeded the budget: {tokens_after} > {budget}")
        timings.total_ms = (time.perf_counter() - t0) * 1e3
        return OptimizeResult(
            query=query,
            documents=documents_out,
            dropped=dropped,
            tokens_before=tokens_before,
            tokens_after=tokens_after,
            token_budget=budget,
            target_tokenizer=counter.name,
            scorer=method,
            proxy_model=proxy_name,
            calibrated=calibrated,
            ordering=ordering,
            timings=timings,
            warnings=warnings,
        )

    def _segment(self, doc: Document, counter: TokenCounter) -> _DocUnits:
        segs = segment(doc.text, self.language)
        title = _title_of(doc)
        return _DocUnits(
            doc=doc,
            title=title,
            spans=[(s.start, s.end) for s in segs],
            kinds=[s.kind for s in segs],
            tokens=[counter.count(doc.text[s.start : s.end]) for s in segs],
            title_tokens=counter.count(f"{title}\n") if title else 0,
            text_tokens=counter.count(doc.text),
        )

    def _select(
        self,
        units: list[_DocUnits],
        scores: list[list[float | None]],
        budget: int | None,
        threshold: float | None,
        counter: TokenCounter,
    ) -> list[list[bool]]:
        cands: list[Candidate] = []
        where: list[tuple[int, int]] = []  # (doc, segment) per candidate; segment -1 = title
        first_units: list[int] = []
        for d, u in enumerate(units):
            title_idx = None
            if u.title:
                title_idx = len(cands)
                cands.append(Candidate(doc=d, tokens=u.title_tokens, score=-math.inf, header=True))
                where.append((d, -1))
            heading_idx: int | None = None
            first_seen = False
            for k, kind in enumerate(u.kinds):
                needs = tuple(h for h in (title_idx, heading_idx) if h is not None)
                if kind == "heading":
                    heading_idx = len(cands)
                    cands.append(Candidate(doc=d, tokens=u.tokens[k], score=-math.inf, header=True, needs=()))
                else:
                    s = scores[d][k]
                    if not first_seen:
                        first_units.append(len(cands))
                        first_seen = True
                    cands.append(
                        Candidate(doc=d, tokens=u.tokens[k], score=float(s if s is not None else 0.0), needs=needs)
                    )
                where.append((d, k))
        opts = SelectionOptions(
            budget=budget,
            threshold=threshold,
            keep_best_per_doc=self.keep_best_per_doc,
            keep_first=self.keep_first,
        )
        kept_c = select(cands, opts, first_units)
        # Verify against the rendered text (BPE merges across unit boundaries can change counts): trim the
        # lowest-scoring kept unit until the rendered documents fit.
        while budget is not None:
            kept = self._kept_per_doc(units, kept_c, where)
            total = sum(
                (u.title_tokens if any(k) and u.title else 0) + counter.count(_join(u, k))
                for u, k in zip(units, kept, strict=True)
            )
            if total <= budget:
                return kept
            worst = min(
                (i for i, c in enumerate(cands) if kept_c[i] and not c.header),
                key=lambda i: (cands[i].score, -i),
                default=None,
            )
            if worst is None:
                return [[False] * len(u.spans) for u in units]
            kept_c[worst] = False
            needed = {h for i, c in enumerate(cands) if kept_c[i] and not c.header for h in c.needs}
            for i, c in enumerate(cands):
                if c.header:
                    kept_c[i] = i in needed
        return self._kept_per_doc(units, kept_c, where)

    @staticmethod
    def _kept_per_doc(units: list[_DocUnits], kept_c: list[bool], where: list[tuple[int, int]]) -> list[list[bool]]:
        kept = [[False] * len(u.spans) for u in units]
        has_sentence = [False] * len(units)
        for flag, (d, k) in zip(kept_c, where, strict=True):
            if flag and k >= 0:
                kept[d][k] = True
                if units[d].kinds[k] != "heading":
                    has_sentence[d] = True
        return [k if has_sentence[d] else [False] * len(k) for d, k in enumerate(kept)]

    def _output(
        self,
        i: int,
        u: _DocUnits,
        scores: list[float | None],
        kept: list[bool],
        doc_score: float | None,
        raw_score: float | None,
        counter: TokenCounter,
    ) -> OutputDocument:
        text = _join(u, kept)
        all_kept = all(kept)
        return OutputDocument(
            id=u.doc.id if u.doc.id is not None else str(i),
            index=i,
            text=u.doc.text if all_kept else text,
            metadata=u.doc.metadata,
            title=u.title,
            score=doc_score,
            raw_score=raw_score,
            retriever_score=u.doc.score,
            kept_spans=_merge_spans([sp for sp, k in zip(u.spans, kept, strict=True) if k]),
            units=[
                Unit(start=s, end=e, kind=kind, tokens=tok, score=sc, kept=k)  # type: ignore[arg-type]
                for (s, e), kind, tok, sc, k in zip(u.spans, u.kinds, u.tokens, scores, kept, strict=True)
            ],
            tokens_before=u.title_tokens + u.text_tokens,
            tokens_after=((u.title_tokens if u.title else 0) + counter.count(text)) if any(kept) else 0,
        )

    def _order(
        self, query: str, idx: list[int], docs: list[OutputDocument], ordering: str, warnings: list[str]
    ) -> list[int]:
        if ordering == "input" or len(idx) < 2:
            return idx
        if ordering == "attention_sort":
            from rag_opt.orderers.attention_sort import AttentionSort

            sorter = AttentionSort.tuned(self._sentinel_scorer().proxy, max_tokens=self.max_window_tokens)
            texts = [f"{docs[i].title}\n{docs[i].text}" if docs[i].title else docs[i].text for i in idx]
            return [idx[j] for j in sorter.order(query, texts)]
        rel = [_relevance(docs[i], rank) for rank, i in enumerate(idx)]
        if ordering == "relevance":
            return [idx[j] for j in sorted(range(len(idx)), key=lambda j: (-rel[j], j))]
        if ordering == "calibrated":
            from rag_opt.orderers.calibrated import placement, slot_attention_for

            sentinel = self._sentinel_scorer()
            curve, note = slot_attention_for(sentinel.profiles, sentinel.proxy.name, len(idx))
            if note:
                warnings.append(note)
            if curve is not None:
                return [idx[j] for j in placement(rel, curve.tolist())]
        return [idx[j] for j in end_placement(rel)]

    def _sentinel_scorer(self) -> SentinelCompressor:
        scorer = self.scorer()
        if not isinstance(scorer, _sentinel()):
            raise ValueError(f"this ordering needs the proxy model; the scorer is {type(scorer).__name__}")
        return scorer


def _sentinel() -> type[SentinelCompressor]:
    from rag_opt.compressors.sentinel import SentinelCompressor

    return SentinelCompressor


def _relevance(doc: OutputDocument, rank: int) -> float:
    """Document relevance for ordering: our score, else the retriever's, else input order."""
    if doc.score is not None:
        return doc.score
    if doc.retriever_score is not None:
        return doc.retriever_score
    return -float(rank)


def _join(u: _DocUnits, kept: list[bool]) -> str:
    """Kept units verbatim, in order; where a gap was cut between two pieces that would otherwise touch
    without whitespace (e.g. "Inc." + "He ..."), a single space keeps the words apart."""
    return join_spans(u.doc.text, _merge_spans([sp for sp, k in zip(u.spans, kept, strict=True) if k]))


def join_spans(text: str, spans: list[tuple[int, int]]) -> str:
    """Join non-adjacent spans of ``text``, inserting one space only where a cut would glue two words."""
    parts: list[str] = []
    for s, e in spans:
        piece = text[s:e]
        if parts and not parts[-1][-1:].isspace() and not piece[:1].isspace():
            parts.append(" ")
        parts.append(piece)
    return "".join(parts)


def _merge_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in spans:
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


_DEFAULT: ContextOptimizer | None = None
_DEFAULT_LOCK = threading.Lock()


def optimize(
    query: str,
    documents: Sequence[DocumentLike],
    *,
    ratio: float | None = None,
    target_tokens: int | None = None,
    threshold: float | None = None,
    ordering: str = "input",
    target: str | None = None,
    model: str | None = None,
    **kwargs: Any,
) -> OptimizeResult:
    """Optimize retrieved ``documents`` for ``query`` in one call.

    Models are loaded once per process and reused across calls with the same settings. See
    :class:`ContextOptimizer` for every option.
    """
    global _DEFAULT
    with _DEFAULT_LOCK:
        opt = _DEFAULT
        if opt is None or opt.model != model or opt.target != target or kwargs:
            opt = ContextOptimizer(model=model, target=target, **kwargs)
            if not kwargs:
                _DEFAULT = opt
    return opt.optimize(
        query, documents, ratio=ratio, target_tokens=target_tokens, threshold=threshold, ordering=ordering
    )
