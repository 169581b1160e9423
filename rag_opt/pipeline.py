"""``ContextOptimizer`` wires the stages: segment → score → select → order → render.

Each stage takes the previous stage's value and returns its own (:class:`~rag_opt.text.units.UnitTable` →
:class:`~rag_opt.compressors.base.Scores` → :class:`~rag_opt.compressors.selection.Selection` →
:class:`~rag_opt.orderers.base.Ordering` → :class:`~rag_opt.types.OptimizeResult`); nothing reaches back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rag_opt.compressors.base import Scorer, Scores
from rag_opt.compressors.selection import Selection, SelectionOptions, select
from rag_opt.errors import ConfigurationError, InvalidInputError, InvalidInputTypeError
from rag_opt.orderers.base import Orderer, OrdererResources, Ordering, OrderItem, make_orderer
from rag_opt.render import render_result
from rag_opt.text.tokens import TokenCounter, get_token_counter
from rag_opt.text.units import UnitTable
from rag_opt.types import (
    Budget,
    Document,
    DocumentLike,
    OptimizeResult,
    OrderingName,
    Timings,
    check_ordering,
    to_documents,
)
from rag_opt.work import check_units, checkpoint

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.models.loader import ProxyModel
    from rag_opt.orderers.profiles import ProfileStore

__all__ = ["ContextOptimizer", "optimize"]


class ContextOptimizer:
    """Reusable optimizer: holds the configuration and (lazily) the loaded proxy model and probe.

    Args:
        model: proxy model (None: the embedded default SmolLM2-135M; a Hugging Face id, local folder or .gguf).
        target: the target LLM whose tokens budgets are measured in (tiktoken model/encoding name, or
            ``hf:<tokenizer>``); default ``o200k_base``.
        ratio / target_tokens / threshold: default compression (at most one); None = no compression. Or
            ``budget``: the same as a :class:`~rag_opt.types.Budget`.
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
        budget: Budget | None = None,
        ordering: OrderingName | str = "input",
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
        self.budget = _budget(ratio, target_tokens, threshold, budget) or Budget()
        self.ordering: OrderingName = check_ordering(ordering)
        if max_window_tokens < 128:
            raise InvalidInputError("max_window_tokens must be at least 128")
        self.model = model
        self.target = target
        self.probe = probe
        self.selection_options = SelectionOptions(keep_best_per_doc=keep_best_per_doc, keep_first=keep_first)
        self.device = device
        self.dtype = dtype
        self.max_window_tokens = max_window_tokens
        self.trust_remote_code = trust_remote_code
        self.language = language
        self.doc_probe = doc_probe
        self.calibrate = calibrate
        self._scorer: Scorer | None = scorer
        self._orderers: dict[str, Orderer] = {}
        self._lock = threading.Lock()

    @property
    def ratio(self) -> float | None:
        return self.budget.ratio

    @property
    def target_tokens(self) -> int | None:
        return self.budget.target_tokens

    @property
    def threshold(self) -> float | None:
        return self.budget.threshold

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

    def orderer(self, name: OrderingName | str) -> Orderer:
        """The orderer registered as ``name``, built once with what it needs (the proxy model, the profiles)."""
        checked = check_ordering(name)
        orderer = self._orderers.get(checked)
        if orderer is None:
            resources = OrdererResources(
                proxy=lambda: self._proxy_for(checked), profiles=self._profiles, max_tokens=self.max_window_tokens
            )
            orderer = self._orderers[checked] = make_orderer(checked, resources)
        return orderer

    def _proxy_for(self, ordering: str) -> ProxyModel:
        """The scorer's proxy model (a scorer with a ``proxy``, e.g. the Sentinel scorer), for an orderer."""
        proxy: ProxyModel | None = getattr(self.scorer(), "proxy", None)
        if proxy is None:
            raise ConfigurationError(
                f"ordering {ordering!r} needs the proxy model's attention; it is not available with the "
                f"{type(self.scorer()).__name__} scorer"
            )
        return proxy

    def _profiles(self) -> ProfileStore | None:
        profiles: ProfileStore | None = getattr(self.scorer(), "profiles", None)
        return profiles

    # -- the pipeline -------------------------------------------------------------------------------------
    def optimize(
        self,
        query: str,
        documents: Sequence[DocumentLike],
        *,
        ratio: float | None = None,
        target_tokens: int | None = None,
        threshold: float | None = None,
        ordering: OrderingName | str | None = None,
        budget: Budget | None = None,
    ) -> OptimizeResult:
        """Optimize ``documents`` for ``query``; per-call settings override the optimizer's defaults."""
        t0, timings = time.perf_counter(), Timings()
        query = _check_query(query)
        budget = _budget(ratio, target_tokens, threshold, budget) or self.budget
        orderer = self.orderer(ordering or self.ordering)
        docs = _check_documents(documents)
        with _timed(timings, "segment_ms"):
            units = UnitTable.build(docs, self.counter.count, self.language)
        check_units(units.n_units)  # limits and cancellation (rag_opt.work): before the expensive stages
        limit = budget.tokens(units.tokens_before)
        shrink = budget.compresses and (limit is None or limit < units.tokens_before)
        scores = self._score(query, units, timings) if shrink or orderer.reorders else None
        checkpoint()
        with _timed(timings, "select_ms"):
            selection = select(
                units,
                scores.unit if scores is not None else None,
                self.counter.count,
                limit=limit if shrink else None,
                threshold=budget.threshold if shrink else None,
                options=self.selection_options,
            )
        checkpoint()
        with _timed(timings, "order_ms"):
            ordering_ = _order(query, orderer, units, scores, selection)
        timings.total_ms = (time.perf_counter() - t0) * 1e3
        warnings = (_score_warnings(scores, orderer) if scores is not None else []) + ordering_.warnings
        return render_result(
            query,
            units,
            scores,
            selection,
            ordering_.permutation,
            ordering=orderer.name,  # type: ignore[arg-type]
            token_budget=limit,
            target_tokenizer=self.counter.name,
            timings=timings,
            warnings=warnings,
        )

    def _score(self, query: str, units: UnitTable, timings: Timings) -> Scores:
        scorer = self.scorer()  # loading the model is not part of the score stage's timing
        with _timed(timings, "score_ms"):
            return scorer.score(query, units)


def _budget(
    ratio: float | None, target_tokens: int | None, threshold: float | None, budget: Budget | None
) -> Budget | None:
    """The budget given as keywords or as a :class:`Budget` (not both); None when neither is given."""
    loose = Budget(ratio=ratio, target_tokens=target_tokens, threshold=threshold)
    if budget is not None:
        if not isinstance(budget, Budget):
            raise InvalidInputTypeError(f"budget must be a rag_opt.Budget, got {type(budget).__name__}")
        if loose.compresses:
            raise InvalidInputError("give the budget either as ratio/target_tokens/threshold or as budget=, not both")
        return budget
    return loose if loose.compresses else None


def _check_query(query: object) -> str:
    if not isinstance(query, str):
        raise InvalidInputTypeError(f"query must be a string, got {type(query).__name__}")
    if not query.strip():
        raise InvalidInputError("query is empty")
    return query


def _check_documents(documents: Sequence[DocumentLike]) -> list[Document]:
    docs = to_documents(documents)
    for i, doc in enumerate(docs):
        if not doc.text.strip():
            raise InvalidInputError(f"documents[{i}] is empty: every document needs some text")
    return docs


def _order(query: str, orderer: Orderer, units: UnitTable, scores: Scores | None, selection: Selection) -> Ordering:
    """The order stage over the kept documents: their text as the LLM reads it and their relevance."""
    kept = selection.kept_docs
    if len(kept) < 2 or not orderer.reorders:
        return Ordering(list(range(len(kept))))
    items = []
    for rank, d in enumerate(kept):
        text = units.documents[d].text if selection.keep[list(units.rows(d))].all() else selection.texts[d]
        title = units.titles[d]
        items.append(OrderItem(f"{title}\n{text}" if title else text, _relevance(units, scores, d, rank)))
    return orderer.order(query, items)


def _relevance(units: UnitTable, scores: Scores | None, d: int, rank: int) -> float:
    """Document relevance for ordering: rag-opt's score, else the retriever's, else input order."""
    if scores is not None:
        return float(scores.doc[d])
    retriever = units.documents[d].score
    return retriever if retriever is not None else -float(rank)


def _score_warnings(scores: Scores, orderer: Orderer) -> list[str]:
    out = [scores.calibration_note] if scores.calibration_note and orderer.reorders else []
    if scores.method == "raw-attention":
        out.append(f"no probe for proxy model {scores.model}: sentences were scored by raw attention (weaker)")
    return out


@contextmanager
def _timed(timings: Timings, field: str) -> Iterator[None]:
    t = time.perf_counter()
    try:
        yield
    finally:
        setattr(timings, field, (time.perf_counter() - t) * 1e3)


_DEFAULT: ContextOptimizer | None = None
_DEFAULT_LOCK = threading.Lock()


def optimize(
    query: str,
    documents: Sequence[DocumentLike],
    *,
    ratio: float | None = None,
    target_tokens: int | None = None,
    threshold: float | None = None,
    ordering: OrderingName | str = "input",
    target: str | None = None,
    model: str | None = None,
    budget: Budget | None = None,
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
        query,
        documents,
        ratio=ratio,
        target_tokens=target_tokens,
        threshold=threshold,
        ordering=ordering,
        budget=budget,
    )
