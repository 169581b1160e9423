"""``ContextOptimizer`` wires the stages: segment → score → select → order → render.

Each stage takes the previous stage's value and returns its own (:class:`~rag_opt.text.units.UnitTable` →
:class:`~rag_opt.compressors.base.Scores` → :class:`~rag_opt.compressors.selection.Selection` →
:class:`~rag_opt.orderers.base.Ordering` → :class:`~rag_opt.types.OptimizeResult`); nothing reaches back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rag_opt import telemetry
from rag_opt.compressors.base import Scorer, Scores
from rag_opt.compressors.selection import SelectionOptions, select
from rag_opt.errors import ConfigurationError, InvalidInputError, WorkLimitExceeded
from rag_opt.inputs import check_budget, check_documents, check_query, check_tier
from rag_opt.models.encoding_cache import EncodingCache, resolve_cache
from rag_opt.models.threads import ThreadPolicy
from rag_opt.option_args import options_signature, resolve_options
from rag_opt.options import OptimizerOptions, OverLimit
from rag_opt.orderers.base import Orderer, OrdererResources, make_orderer
from rag_opt.orderers.reader_profiles import ReaderProfileStore, reader_key
from rag_opt.orderers.stage import order_stage
from rag_opt.render import render_result
from rag_opt.result_notes import language_note, score_warnings, uncompressed_note
from rag_opt.text.language import check_language
from rag_opt.text.tokens import TokenCounter, get_token_counter
from rag_opt.text.units import UnitTable
from rag_opt.types import (
    Budget,
    Document,
    DocumentLike,
    OptimizeResult,
    OrderingName,
    Tier,
    Timings,
    check_ordering,
)
from rag_opt.work import WorkLimits, check_question, check_units, checkpoint, limits_given, scope

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.artifacts.position_profiles import ProfileStore
    from rag_opt.batching import MicroBatcher
    from rag_opt.models.loader import ProxyModel

__all__ = ["ContextOptimizer", "OverLimit"]

logger = logging.getLogger(__name__)

LIFT_HINT = (
    "Raise the limit with ContextOptimizer(limits=rag_opt.WorkLimits(...)), lift every limit with limits=None "
    "(the model tier's cost grows linearly with the context: docs/python-api.md), or read it with tier='lexical' "
    "(any length in seconds; over_limit='lexical' does so only past the limits)"
)


class ContextOptimizer:
    """Reusable optimizer: holds the configuration and (lazily) the loaded proxy model and probe.

    Its options are those of :class:`~rag_opt.options.OptimizerOptions` (documented there, one by one), given as an
    options object, by name, or both: ``ContextOptimizer(ratio=0.3, keep_best_per_doc=True)``,
    ``ContextOptimizer(options)``, ``ContextOptimizer(options, tier="lexical")``.

    Args:
        options: the options (default: every option's default).
        **overrides: any option by name, over ``options`` (a budget given here replaces the budget of
            ``options``). Typed as the options' fields (mypy, IDEs and ``inspect.signature`` see each one with its
            type and default); an unknown name raises :class:`~rag_opt.errors.InvalidInputError` naming the
            closest option, an invalid value the error of that option's check.
    """

    @options_signature
    def __init__(self, options: OptimizerOptions | None = None, **overrides: Any) -> None:
        o = self.options = resolve_options(options, overrides, "ContextOptimizer")
        self.budget = o.default_budget
        self.ordering: OrderingName = check_ordering(o.ordering)
        self.model = o.model
        self.target = o.target
        self.probe = o.probe
        self.selection_options = SelectionOptions(
            keep_best_per_doc=o.keep_best_per_doc,
            keep_first=o.keep_first,
            keep_antecedents=o.keep_antecedents,
            drop_below_best=o.drop_below_best,
        )
        self.device = o.device
        self.dtype = o.dtype
        self.max_window_tokens = o.max_window_tokens
        self.trust_remote_code = o.trust_remote_code
        self.language = o.language
        self.title_keys: tuple[str, ...] = tuple(o.title_keys)
        self.title_from_text = o.title_from_text
        self.reader = o.reader
        self.doc_probe = o.doc_probe
        self.calibrate = o.calibrate
        self.tier: Tier = check_tier(o.tier)
        self.limits = o.limits
        self.over_limit: OverLimit = "lexical" if o.over_limit == "lexical" else "raise"
        self.threads = o.threads if isinstance(o.threads, ThreadPolicy) else ThreadPolicy(o.threads)
        self.encoding = o.encoding
        self.cache: EncodingCache | None = resolve_cache(o.cache) if o.encoding == "parallel" else None
        self._scorer: Scorer | None = o.scorer
        self._scorer_given = o.scorer is not None
        self._lexical: Scorer | None = None
        self._batcher: MicroBatcher | None = None
        self._orderers: dict[tuple[str, str | None], Orderer] = {}
        self._readers: ReaderProfileStore | None = None
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
                    encoding=self.encoding,
                    cache=self.cache,
                )
                self._scorer.proxy.threads = self.threads  # process-wide for this model (see ThreadPolicy)
            return self._scorer

    def batcher(self) -> MicroBatcher:
        """This optimizer's shared :class:`~rag_opt.batching.MicroBatcher`: optimizations submitted close
        together (from threads or coroutines) share forward passes. Created on first use."""
        with self._lock:
            if self._batcher is None:
                from rag_opt.batching import MicroBatcher

                self._batcher = MicroBatcher(self)
            return self._batcher

    def lexical_scorer(self) -> Scorer:
        """The lexical tier's scorer (no model: BM25 and lexical features through the shipped lexical probe)."""
        with self._lock:
            if self._lexical is None:
                from rag_opt.compressors.lexical_scorer import LexicalScorer

                self._lexical = LexicalScorer()
            return self._lexical

    def orderer(self, name: OrderingName | str, reader: str | None = None) -> Orderer:
        """The orderer registered as ``name``, built once (per ``reader``, the model that reads the context) with
        what it needs (the proxy model, the profiles)."""
        checked = check_ordering(name)
        key = (checked, reader_key(reader) if reader and checked == "calibrated" else None)
        orderer = self._orderers.get(key)
        if orderer is None:
            resources = OrdererResources(
                proxy=lambda: self._proxy_for(checked),
                profiles=self._profiles,
                max_tokens=self.max_window_tokens,
                reader=key[1],
                reader_profiles=self._reader_profiles,
            )
            orderer = self._orderers[key] = make_orderer(checked, resources)
        return orderer

    def _reader_profiles(self) -> ReaderProfileStore:
        with self._lock:
            if self._readers is None:
                self._readers = ReaderProfileStore()
            return self._readers

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
        tier: Tier | str | None = None,
        language: str | None = None,
        target: str | None = None,
    ) -> OptimizeResult:
        """Optimize ``documents`` for ``query``; per-call settings override the optimizer's defaults
        (``language``: segmentation and BM25 stopwords; ``target``: the tokenizer budgets are counted in)."""
        budget = check_budget(ratio, target_tokens, threshold, budget)
        return self.optimize_batch(
            [query], [documents], ordering=ordering, budget=budget, tier=tier, language=language, target=target
        )[0]

    def optimize_batch(
        self,
        queries: Sequence[str],
        documents: Sequence[Sequence[DocumentLike]],
        *,
        ratio: float | None = None,
        target_tokens: int | None = None,
        threshold: float | None = None,
        ordering: OrderingName | str | None = None,
        budget: Budget | None = None,
        tier: Tier | str | None = None,
        language: str | None = None,
        target: str | None = None,
        share_passes: bool = False,
    ) -> list[OptimizeResult]:
        """:meth:`optimize` for several questions, each with its documents. The results equal those of one call
        each, in order, bit for bit (kept text and scores; the model's work is done context by context, as one call
        each would do it).

        ``share_passes``: contexts share forward passes of the proxy instead (their new documents packed together,
        their question passes batched): about a fifth less time over cached documents and a twentieth less cold on
        a 2-core CPU (docs/python-api.md), but in bfloat16 a question's scores then depend on what else is in its
        passes (the CPU's matrix kernels round differently for other row counts), and now and then its kept text
        too; ``timings.score_ms`` is then the shared scoring time."""
        if isinstance(queries, str) or len(queries) != len(documents):
            raise InvalidInputError("optimize_batch needs a list of queries and a list of document lists, as long")
        budget = check_budget(ratio, target_tokens, threshold, budget) or self.budget
        tier_ = check_tier(tier or self.tier)
        run = (ordering, language, target, share_passes)
        if limits_given():  # a caller's scope (a server's) decides: its limits, its errors
            return self._run(queries, documents, budget, tier_, *run)
        try:
            with scope(limits=self.limits or WorkLimits()):
                return self._run(queries, documents, budget, tier_, *run)
        except WorkLimitExceeded as exc:
            if self.over_limit != "lexical" or tier_ == "lexical":
                raise WorkLimitExceeded(f"{exc}. {LIFT_HINT}") from None
            note = f"{exc}: answered by the lexical tier (over_limit='lexical'; {LIFT_HINT})"
            logger.warning("%s", note)
        with scope(limits=WorkLimits(max_question_tokens=(self.limits or WorkLimits()).max_question_tokens)):
            results = self._run(queries, documents, budget, "lexical", *run)
        for r in results:
            r.warnings.append(note)
        return results

    def _run(
        self,
        queries: Sequence[str],
        documents: Sequence[Sequence[DocumentLike]],
        budget: Budget,
        tier_: Tier,
        ordering: OrderingName | str | None,
        language: str | None,
        target: str | None,
        share_passes: bool,
    ) -> list[OptimizeResult]:
        t0 = time.perf_counter()
        orderer = self.orderer(ordering or self.ordering, self.reader or target or self.target)
        language_ = self.language if language is None else check_language(language)
        counter = self.counter if target is None else get_token_counter(target)
        jobs = [
            _Job(check_query(q), check_documents(d), tier_, counter) for q, d in zip(queries, documents, strict=True)
        ]
        for job in jobs:  # segment
            check_question(job.query, counter.count)  # limits (rag_opt.work): a long question is work of its own
            with _timed(job.timings, "segment_ms"):
                job.units = UnitTable.build(
                    job.docs, counter.count, language_, title_keys=self.title_keys, title_from_text=self.title_from_text
                )
            check_units(job.units.n_units)  # limits and cancellation (rag_opt.work): before the expensive stages
            job.limit = budget.tokens(job.units.tokens_before)
            job.shrink = budget.compresses and (job.limit is None or job.limit < job.units.tokens_before)
        # the score stage: document relevance is needed by a reordering, and by the gate when a job compresses
        gate = self.selection_options.drop_below_best is not None and any(job.shrink for job in jobs)
        self._score(
            [job for job in jobs if job.shrink or orderer.reorders],
            documents=orderer.reorders or gate,
            share=share_passes,
        )
        checkpoint()
        return [self._finish(job, budget, orderer, t0) for job in jobs]

    def _score(self, jobs: list[_Job], documents: bool, share: bool = False) -> None:
        """The score stage. ``documents``: document relevance is needed (the ordering uses it); scorers that can
        skip it (``scores_documents``) then stop their forward pass earlier. ``share``: the jobs share forward
        passes (``score_batch``); else each is scored alone, exactly as one call would score it."""
        if not jobs:
            return
        scorer = self._loaded_scorer(jobs)  # loading it is the jobs' load_ms, not part of the score stage's timing
        kw = {"documents": documents} if getattr(scorer, "scores_documents", False) else {}
        t = time.perf_counter()
        batch = getattr(scorer, "score_batch", None)
        if share and batch is not None and len(jobs) > 1:
            scores = batch([j.query for j in jobs], [j.units for j in jobs], **kw)
            for job, sc in zip(jobs, scores, strict=True):
                job.scores = sc
                job.timings.score_ms = (time.perf_counter() - t) * 1e3
            return
        for job in jobs:
            checkpoint()
            t = time.perf_counter()
            job.scores = scorer.score(job.query, job.units, **kw)
            job.timings.score_ms = (time.perf_counter() - t) * 1e3

    def _shipped_probe(self, tier: Tier, scores: Scores) -> bool:
        """Whether ``scores`` came from a probe shipped with rag-opt (trained on English): the lexical tier's, or the
        model tier's with ``probe="auto"`` and no scorer of the caller's."""
        if tier == "lexical":
            return scores.method == "lexical-probe"
        return scores.method == "probe" and self.probe == "auto" and not self._scorer_given

    def _loaded_scorer(self, jobs: list[_Job]) -> Scorer:
        """The scorer of the jobs' tier, loaded on first use (the proxy model, or the lexical probe); the time this
        call spent loading it (or waiting for another thread to) is each job's ``timings.load_ms`` (0 when it was
        loaded already)."""
        lexical = jobs[0].tier == "lexical"
        if (self._lexical if lexical else self._scorer) is not None:
            return self.lexical_scorer() if lexical else self.scorer()
        t = time.perf_counter()
        scorer = self.lexical_scorer() if lexical else self.scorer()
        load_ms = (time.perf_counter() - t) * 1e3
        for job in jobs:
            job.timings.load_ms = load_ms
        return scorer

    def _finish(self, job: _Job, budget: Budget, orderer: Orderer, t0: float) -> OptimizeResult:
        """select → order → render for one scored job."""
        units, scores = job.units, job.scores
        with _timed(job.timings, "select_ms"):
            selection = select(
                units,
                scores.unit if scores is not None else None,
                job.counter.count,
                limit=job.limit if job.shrink else None,
                threshold=budget.threshold if job.shrink else None,
                options=self.selection_options,
                doc_scores=scores.doc if scores is not None else None,
            )
        checkpoint()
        with _timed(job.timings, "order_ms"):
            ordering = order_stage(job.query, orderer, units, scores, selection)
        job.timings.total_ms = (time.perf_counter() - t0) * 1e3
        warnings = (score_warnings(scores, orderer) if scores is not None else []) + ordering.warnings
        if scores is not None and self._shipped_probe(job.tier, scores) and (note := language_note(units.language)):
            warnings.append(note)
        if not job.shrink:
            warnings.append(uncompressed_note(budget, job.limit, units.tokens_before))
        result = render_result(
            job.query,
            units,
            scores,
            selection,
            ordering.permutation,
            ordering=orderer.name,  # type: ignore[arg-type]
            tier=job.tier,
            token_budget=job.limit,
            target_tokenizer=job.counter.name,
            timings=job.timings,
            warnings=warnings,
            placement_profile=ordering.profile,
        )
        telemetry.record_result(result)  # a span, when rag_opt.telemetry.enable() turned them on
        return result


@dataclass
class _Job:
    """One question's way through the stages inside :meth:`ContextOptimizer.optimize_batch`."""

    query: str
    docs: list[Document]
    tier: Tier
    counter: TokenCounter
    timings: Timings = field(default_factory=Timings)
    units: UnitTable = field(init=False)
    limit: int | None = None
    shrink: bool = False
    scores: Scores | None = None


@contextmanager
def _timed(timings: Timings, field: str) -> Iterator[None]:
    t = time.perf_counter()
    try:
        yield
    finally:
        setattr(timings, field, (time.perf_counter() - t) * 1e3)
