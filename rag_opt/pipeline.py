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
from typing import TYPE_CHECKING, Literal

from rag_opt import telemetry
from rag_opt.compressors.base import Scorer, Scores
from rag_opt.compressors.selection import SelectionOptions, select
from rag_opt.errors import ConfigurationError, InvalidInputError, InvalidInputTypeError, WorkLimitExceeded
from rag_opt.inputs import check_budget, check_documents, check_query, check_share, check_tier
from rag_opt.models.encoding_cache import EncodingCache, resolve_cache
from rag_opt.models.prompt import DEFAULT_ENCODING, template_for
from rag_opt.models.threads import ThreadPolicy
from rag_opt.orderers.base import Orderer, OrdererResources, make_orderer
from rag_opt.orderers.reader_profiles import ReaderProfileStore, reader_key
from rag_opt.orderers.stage import order_stage
from rag_opt.render import render_result
from rag_opt.result_notes import score_warnings, uncompressed_note
from rag_opt.text.language import check_language
from rag_opt.text.titles import DEFAULT_TITLE_KEYS, check_title_keys
from rag_opt.text.tokens import TokenCounter, get_token_counter, target_key
from rag_opt.text.units import UnitTable
from rag_opt.types import (
    DEFAULT_ORDERING,
    DEFAULT_RATIO,
    Budget,
    Document,
    DocumentLike,
    OptimizeResult,
    OrderingName,
    Tier,
    Timings,
    check_ordering,
)
from rag_opt.work import DEFAULT_LIMITS, WorkLimits, check_question, check_units, checkpoint, limits_given, scope

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.artifacts.position_profiles import ProfileStore
    from rag_opt.batching import MicroBatcher
    from rag_opt.models.loader import ProxyModel

__all__ = ["ContextOptimizer", "OverLimit"]

logger = logging.getLogger(__name__)

#: what an optimizer does with a context past its work limits: raise WorkLimitExceeded, or answer by the lexical tier
OverLimit = Literal["raise", "lexical"]
LIFT_HINT = (
    "Raise the limit with ContextOptimizer(limits=rag_opt.WorkLimits(...)), lift every limit with limits=None "
    "(the model tier's cost grows linearly with the context: docs/python-api.md), or read it with tier='lexical' "
    "(any length in seconds; over_limit='lexical' does so only past the limits)"
)


class ContextOptimizer:
    """Reusable optimizer: holds the configuration and (lazily) the loaded proxy model and probe.

    Args:
        model: proxy model (None: the embedded default SmolLM2-135M; a Hugging Face id, local folder or .gguf).
        target: the target LLM whose tokens budgets are measured in (tiktoken model/encoding name, or
            ``hf:<tokenizer>``); default ``o200k_base``. An unknown name is an error (never a silent fallback).
        ratio: the default budget as a fraction of the context's target tokens, in (0, 1]. At most one of
            ``ratio``, ``target_tokens``, ``threshold`` and ``budget``; none given: ``ratio=``
            :data:`~rag_opt.types.DEFAULT_RATIO` (0.5), the default of every surface; ``ratio=1`` keeps
            everything. When a result is not compressed (its budget holds the whole context), its ``warnings``
            say so.
        target_tokens: the default budget as a number of target tokens.
        threshold: the default budget as a relevance probability: keep the sentences scoring at least this.
        budget: the default budget as a :class:`~rag_opt.types.Budget`.
        ordering: ``promote_clear_best`` (the default, chosen by ``benchmarks/litm.py``, docs/reordering.md: the
            best document moves to the front only when the first document's relevance is at most 1/20 of the best's, the
            rest keep their input order), ``lost_in_the_middle`` (end placement: the best document first, the
            second best last, and so on toward the middle), ``relevance`` (best first, the rest by descending
            relevance), ``promote_best`` (the best document first, the rest in input order), ``input`` (keep),
            ``calibrated`` (best into the slots
            the proxy attends to most, from its calibration profile) or ``attention_sort`` (the proxy's attention
            sorts the kept documents, 2 rounds: extra forward passes).
            Document relevance is position-calibrated when a profile exists (``result.calibrated``).
        probe: ``"auto"`` (the probe shipped for the model), a path to a probe JSON, or None (raw attention).
        keep_best_per_doc: keep at least the best sentence of every document (while the budget allows).
        keep_first: always keep each document's first sentence (while the budget allows).
        keep_antecedents: keep an English sentence that opens with a back-reference (``It``, ``She``, ``These``,
            ...) only together with the sentence before it, so no kept sentence dangles (default on).
        drop_below_best: with a budget, drop the documents whose relevance is below this share of the best
            document's, in (0, 1] (a ``required`` one stays, and one a document above the bar names: a possible
            second hop; ``result.warnings`` names them). 0.05 suits single-answer questions; default None: it costs
            multi-hop questions facts (docs/reordering.md).
        device: where the proxy runs (default cuda when available).
        dtype: how the proxy runs (default bfloat16 on GPUs and on CPUs with native bf16 instructions, float32 on
            other CPUs; "int8" with torchao).
        max_window_tokens: proxy tokens per forward pass; longer contexts are processed in windows (and their
            document relevance is not calibrated).
        trust_remote_code: passed to transformers for hub models (off by default).
        language: ISO 639 code of the documents' language (``en``, ``de``, ``pt-BR``, ...): sentence segmentation
            and BM25 stopwords follow it (see :mod:`rag_opt.text.language`; the shipped probes were trained on
            English).
        scorer: score units with this instead of the Sentinel probe (e.g. ``rag_opt.compressors.BM25Scorer()``).
        doc_probe: the document relevance probe: ``"auto"`` (shipped for the model), a path, or None (document
            relevance = its best sentence's score).
        calibrate: position-calibrate document relevance when a calibration profile exists for the number of
            documents (shipped for the embedded model at 10, 20 and 30; ``rag-opt calibrate`` adds others).
        tier: ``"model"`` (the proxy's attention, or ``scorer``) or ``"lexical"`` (BM25 and lexical features
            through the shipped lexical probe: no model, milliseconds); per call too.
        threads: CPU threads per forward pass: ``"auto"`` (the cores free right now, see
            :class:`~rag_opt.models.threads.ThreadPolicy`), a number, or a policy. Applies to the loaded model,
            process-wide.
        encoding: how the proxy reads the context: ``"parallel"`` (each document on its own, its encoding cached
            by content, then a question pass over the cached documents: a request with cached documents costs
            only its question) or ``"joint"`` (one causal pass over everything; its position profiles drive
            calibration). Default: :data:`DEFAULT_ENCODING`.
        cache: the document-encoding cache of parallel encoding: ``"auto"`` (in memory, 512 MiB), a size in
            bytes, a folder (the default memory tier plus that disk tier, shared by processes), an
            :class:`~rag_opt.models.encoding_cache.EncodingCache` (to share one between optimizers or with the
            server), or None (off).
        title_keys: the metadata keys a document's title is read from when it has no ``title`` field, in order
            (default :data:`~rag_opt.text.titles.DEFAULT_TITLE_KEYS`: title, doc_title, heading, name, source,
            file_path, file_name; a file-name key gives its file's stem). See :mod:`rag_opt.text.titles`.
        title_from_text: without a title field or metadata title, read a leading heading line of the text (a
            Markdown heading, or a short first line without end punctuation) as the title; the line stays in
            the text. ``OutputDocument.title_source`` says which title was used.
        reader: the model that reads the optimized context, whose reader profile (``rag-opt calibrate --reader``)
            places the documents under ``ordering="calibrated"`` (default: the request's ``target``). Without a
            profile for it, the proxy's profile places them. ``OptimizeResult.placement_profile`` says which.
        limits: the most work one call may do (:class:`~rag_opt.work.WorkLimits`: units, proxy tokens, question
            tokens), checked before the model runs. Default :data:`~rag_opt.work.DEFAULT_LIMITS` (65,536 proxy
            tokens: about a minute of the embedded model on 2 cores, cold); None lifts them. A caller's own
            :func:`rag_opt.work.scope` with limits (the server's) takes precedence.
        over_limit: past the limits, ``"raise"`` a :class:`~rag_opt.errors.WorkLimitExceeded` naming the limit
            and how to lift it, or answer by the ``"lexical"`` tier (with a warning in the result saying so).
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
        ordering: OrderingName | str = DEFAULT_ORDERING,
        probe: str | None = "auto",
        keep_best_per_doc: bool = False,
        keep_first: bool = False,
        keep_antecedents: bool = True,
        drop_below_best: float | None = None,
        device: str | None = None,
        dtype: str | None = None,
        max_window_tokens: int = 8192,
        trust_remote_code: bool = False,
        language: str = "en",
        scorer: Scorer | None = None,
        doc_probe: str | None = "auto",
        calibrate: bool = True,
        tier: Tier | str = "model",
        threads: ThreadPolicy | int | str = "auto",
        encoding: str = DEFAULT_ENCODING,
        cache: EncodingCache | int | str | None = "auto",
        title_keys: Sequence[str] = DEFAULT_TITLE_KEYS,
        title_from_text: bool = True,
        reader: str | None = None,
        limits: WorkLimits | None = DEFAULT_LIMITS,
        over_limit: OverLimit | str = "raise",
    ) -> None:
        self.budget = check_budget(ratio, target_tokens, threshold, budget) or Budget(ratio=DEFAULT_RATIO)
        self.ordering: OrderingName = check_ordering(ordering)
        if max_window_tokens < 128:
            raise InvalidInputError("max_window_tokens must be at least 128")
        self.model = model
        if target is not None:
            target_key(target)  # refuses an unknown target now (loads nothing)
        self.target = target
        self.probe = probe
        self.selection_options = SelectionOptions(
            keep_best_per_doc=keep_best_per_doc,
            keep_first=keep_first,
            keep_antecedents=keep_antecedents,
            drop_below_best=check_share("drop_below_best", drop_below_best),
        )
        self.device = device
        self.dtype = dtype
        self.max_window_tokens = max_window_tokens
        self.trust_remote_code = trust_remote_code
        self.language = check_language(language)
        self.title_keys = check_title_keys(title_keys)
        if not isinstance(title_from_text, bool):
            raise InvalidInputTypeError(f"title_from_text must be true or false, got {type(title_from_text).__name__}")
        self.title_from_text = title_from_text
        if reader is not None and (not isinstance(reader, str) or not reader.strip()):
            raise InvalidInputError("reader must be a non-empty model name")
        self.reader = reader
        self.doc_probe = doc_probe
        self.calibrate = calibrate
        self.tier: Tier = check_tier(tier)
        if limits is not None and not isinstance(limits, WorkLimits):
            raise InvalidInputTypeError(f"limits must be a rag_opt.WorkLimits or None, got {type(limits).__name__}")
        self.limits = limits
        if over_limit not in ("raise", "lexical"):
            raise InvalidInputError(f"over_limit must be 'raise' or 'lexical', got {over_limit!r}")
        self.over_limit: OverLimit = over_limit
        self.threads = threads if isinstance(threads, ThreadPolicy) else ThreadPolicy(threads)
        template_for(encoding)  # refuses an unknown encoding
        self.encoding = encoding
        self.cache: EncodingCache | None = resolve_cache(cache) if encoding == "parallel" else None
        self._scorer: Scorer | None = scorer
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
        # loading the model is not part of the score stage's timing
        scorer = self.lexical_scorer() if jobs[0].tier == "lexical" else self.scorer()
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
