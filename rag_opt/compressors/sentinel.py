"""Sentinel-style scoring: one proxy forward pass → unit relevance (probe) and document relevance.

With a probe for the proxy model (shipped for the embedded default, or passed explicitly), unit scores are
the probe's probabilities. Without one, rag-opt falls back to raw attention — the mean over layers and heads
of the question tokens' attention to the unit, relative to uniform — and says so (``method ==
"raw-attention"``).

Document relevance comes from the same forward pass: when a document probe is available for the proxy (one is
shipped for the embedded default) and a calibration profile exists for the number of documents (shipped for
the embedded default at 10, 20 and 30 documents; ``rag-opt calibrate`` builds others), it is the document
probe's probability over position-calibrated per-head attention (:mod:`rag_opt.compressors.doc_relevance`) and
``Scores.calibrated`` is true. Otherwise it is the best unit score of the document.

``encoding`` chooses how the proxy reads the context: ``"parallel"`` (each document on its own, its encoding
cached by content, then one question pass: :mod:`rag_opt.models.parallel`) or ``"joint"`` (one causal pass over
the whole prompt). Each has its own probes and feature caches; under parallel encoding a document reads the same
in every slot, so there is no position bias to calibrate and document relevance comes from a document probe
without calibration blocks (or the best unit score).

``passes=2`` (opt-in, twice the cost; joint encoding only) reads the context a second time with the documents in
reverse order and averages both readings (:mod:`rag_opt.compressors.document_orders`): documents the first slots'
attention sink hides get a second reading from the end of the context.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from rag_opt.artifacts.position_profiles import PositionProfile, ProfileStore
from rag_opt.compressors.base import Scores
from rag_opt.compressors.doc_relevance import document_relevance
from rag_opt.compressors.document_orders import mean_log_odds, reversed_documents, to_original
from rag_opt.compressors.features import SENTENCE_BLOCKS, build_features
from rag_opt.compressors.probe import Probe, shipped_probe, sigmoid
from rag_opt.compressors.structured import structured_rows, with_lexical_rows
from rag_opt.errors import InvalidInputError, ProbeMismatchError
from rag_opt.models.extract import AttentionFeatures, extract, extract_batch
from rag_opt.models.prompt import template_for

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.compressors.lexical_scorer import LexicalScorer
    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.models.loader import ProxyModel
    from rag_opt.text.units import UnitTable

__all__ = ["SentinelCompressor"]

logger = logging.getLogger(__name__)


class SentinelCompressor:
    """Scores the units of a context with the proxy model's attention and (when available) a probe.

    The default scorer of :class:`rag_opt.ContextOptimizer`; selection under the budget is shared by all
    scorers (:mod:`rag_opt.compressors.selection`). Build it from a loaded proxy
    (:func:`rag_opt.models.load_proxy_model`) or with :meth:`from_model`.

    Args:
        proxy: the loaded proxy model.
        probe: the sentence probe: ``"auto"`` (shipped for the model), a path, a :class:`Probe` or None (raw
            attention).
        max_tokens: proxy tokens per forward pass; longer contexts are scored in windows (and their document
            relevance is not calibrated).
        doc_probe: the document probe: ``"auto"`` (shipped for the model), a path, a :class:`Probe` or None
            (document relevance = best unit score).
        profiles: where calibration profiles come from: ``"auto"`` (:class:`ProfileStore` default location, then
            the profiles shipped with rag-opt), a store, or None (never calibrate).
        passes: 2 (joint encoding only) adds a second reading in reverse document order.
        encoding: ``"joint"`` or ``"parallel"`` (see the module doc).
        cache: the :class:`~rag_opt.models.encoding_cache.EncodingCache` of parallel document encodings (None:
            every call encodes its documents anew).
    """

    def __init__(
        self,
        proxy: ProxyModel,
        probe: Probe | None | str = "auto",
        *,
        max_tokens: int = 8192,
        doc_probe: Probe | None | str = "auto",
        profiles: ProfileStore | None | str = "auto",
        passes: int = 1,
        encoding: str = "joint",
        cache: EncodingCache | None = None,
    ) -> None:
        if passes not in (1, 2):
            raise InvalidInputError(
                f"passes must be 1 or 2 (2: a second reading in reverse document order), got {passes!r}"
            )
        self.template = template_for(encoding)
        if passes == 2 and encoding != "joint":
            raise InvalidInputError(
                "passes=2 needs encoding='joint': under parallel encoding every document reads the same in every "
                "slot, so a second reading in another order changes nothing"
            )
        self.proxy = proxy
        self.max_tokens = max_tokens
        self.passes = passes
        self.encoding = encoding
        self.cache = cache
        self.probe: Probe | None = _resolve_probe(probe, proxy, "unit", encoding)
        if self.probe is None and probe == "auto":
            logger.warning(
                "no probe is shipped for proxy model %s: scoring with raw attention (weaker); train one "
                "with `rag-opt train-probe`",
                proxy.name,
            )
        self.doc_probe: Probe | None = _resolve_probe(doc_probe, proxy, "document", encoding)
        if self.doc_probe is not None and self.probe is None and SENTENCE_BLOCKS & set(self.doc_probe.layout.blocks):
            if doc_probe != "auto":
                raise ProbeMismatchError(
                    f"this document probe reads the sentence probe's scores ({', '.join(sorted(SENTENCE_BLOCKS))}): "
                    "it needs a sentence probe too"
                )
            # the shipped document probe reads the shipped sentence probe's scores: without a sentence probe, document
            # relevance falls back to the best unit's score (uncalibrated, and the result's warnings say so)
            logger.info("no sentence probe: the shipped document probe, which reads its scores, is not used")
            self.doc_probe = None
        if profiles == "auto":
            profiles = ProfileStore()
        elif isinstance(profiles, str):
            profiles = ProfileStore(profiles)
        self.profiles: ProfileStore | None = profiles
        self._lexical_scorer: LexicalScorer | None = None

    @classmethod
    def from_model(
        cls,
        model: str | None = None,
        *,
        probe: Probe | None | str = "auto",
        device: str | None = None,
        dtype: str | None = None,
        max_tokens: int = 8192,
        trust_remote_code: bool = False,
        doc_probe: Probe | None | str = "auto",
        profiles: ProfileStore | None | str = "auto",
        passes: int = 1,
        encoding: str = "joint",
        cache: EncodingCache | None = None,
    ) -> SentinelCompressor:
        from rag_opt.models.loader import load_proxy_model

        template_for(encoding)  # an unknown encoding is refused before the model loads
        proxy = load_proxy_model(model, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
        return cls(
            proxy,
            probe,
            max_tokens=max_tokens,
            doc_probe=doc_probe,
            profiles=profiles,
            passes=passes,
            encoding=encoding,
            cache=cache,
        )

    @property
    def method(self) -> str:
        return "probe" if self.probe is not None else "raw-attention"

    @property
    def model_name(self) -> str:
        return self.proxy.name

    scores_documents = True  # score() can skip document relevance when nobody needs it (see ``documents``)

    def layers(self, documents: bool = True) -> int:
        """How many layers the forward pass runs: the deepest layer a probe in use reads (early exit) — the
        document probe's only when document relevance is wanted — or all of them for raw attention."""
        if self.probe is None:
            return self.proxy.num_layers
        probes = (self.probe, self.doc_probe) if documents else (self.probe,)
        return max(p.layout.num_layers for p in probes if p is not None)

    @property
    def cross(self) -> bool:
        """Whether the forward pass also reads cross-document attention (the sentence probe's layout needs it)."""
        return self.probe is not None and self.probe.layout.needs_cross

    def score(self, question: str, units: UnitTable, *, documents: bool = True) -> Scores:
        """Unit scores and document relevance. ``documents=False``: document relevance is only the best unit's
        score (no document probe, no calibration), and the forward pass stops at the sentence probe's depth."""
        if self.passes == 2:
            return self.score_batch([question], [units], documents=documents)[0]
        depth = self.layers(documents)
        attn = extract(
            self.proxy,
            units.by_document(),
            question,
            max_tokens=self.max_tokens,
            layers=depth,
            cross=self.cross,
            encoding=self.encoding,
            cache=self.cache,
        )
        return self._scores(attn, question, units, documents)

    def score_batch(
        self, questions: Sequence[str], tables: Sequence[UnitTable], *, documents: bool = True
    ) -> list[Scores]:
        """:meth:`score` for several contexts, several per forward pass (sorted by length, padded)."""
        if len(questions) != len(tables):
            raise InvalidInputError(f"{len(questions)} questions for {len(tables)} contexts")
        readings = [(q, t) for q, t in zip(questions, tables, strict=True)]
        second: list[tuple[str, UnitTable, np.ndarray]] = []
        if self.passes == 2:  # the same contexts with their documents reversed, in the same batches
            second = [(q, *reversed_documents(t)) for q, t in readings]
            readings += [(q, t) for q, t, _ in second]
        contexts = [(t.by_document(), q) for q, t in readings]
        feats = extract_batch(
            self.proxy,
            contexts,
            max_tokens=self.max_tokens,
            layers=self.layers(documents),
            cross=self.cross,
            encoding=self.encoding,
            cache=self.cache,
        )
        scores = [self._scores(a, q, t, documents) for a, (q, t) in zip(feats, readings, strict=True)]
        if not second:
            return scores
        n = len(tables)
        return [_merge(scores[i], scores[n + i], second[i][2]) for i in range(n)]

    def _scores(self, attn: AttentionFeatures, question: str, units: UnitTable, documents: bool) -> Scores:
        docs = units.by_document()
        if self.probe is not None:
            feats = build_features(self.probe.layout, attn, question, units)
            logits = self.probe.unit_logits(feats, units)
            unit_scores = sigmoid(logits)
            best_logit = units.doc_best(logits)
        else:
            best_logit = None
            unit_scores = attn.unit[:, 1].mean(axis=(1, 2)).astype(np.float64)
        unit = with_lexical_rows(
            np.asarray(unit_scores, dtype=np.float64), units, lambda: self._lexical(question, units)
        )
        doc_raw = units.doc_best(unit)
        doc, calibrated, note = doc_raw, False, None
        if documents and self.doc_probe is not None and self.encoding == "parallel":
            # every slot reads alike: nothing to calibrate, the document probe reads uncalibrated shares
            doc = document_relevance(
                self.doc_probe, attn, question, docs, None, units.language, best_sentence=best_logit
            )
        elif documents and self.doc_probe is not None and self.profiles is not None:
            n_docs = units.n_docs
            profile = self.profile(n_docs)
            if attn.windows > 1:
                note = (
                    f"document relevance is not position-calibrated: the context needs {attn.windows} forward "
                    f"passes of {self.max_tokens} proxy tokens (calibration needs one)"
                )
            elif profile is None:
                note = (
                    f"document relevance is not position-calibrated: no calibration profile for {n_docs} documents "
                    f"of proxy model {self.proxy.name} (build one with `rag-opt calibrate --n-docs {n_docs}`)"
                )
            else:
                doc = document_relevance(
                    self.doc_probe, attn, question, docs, profile, units.language, best_sentence=best_logit
                )
                calibrated = True
        return Scores(
            unit=unit,
            doc=doc,
            method=self.method,
            model=self.proxy.name,
            attention=attn,
            doc_raw=doc_raw,
            calibrated=calibrated,
            calibration_note=note,
            lexical_rows=rows if (rows := structured_rows(units)).any() else None,
        )

    def _lexical(self, question: str, units: UnitTable) -> np.ndarray:
        """Lexical-probe scores of every row (structured rows take these instead of the proxy's)."""
        if self._lexical_scorer is None:
            from rag_opt.compressors.lexical_scorer import LexicalScorer

            self._lexical_scorer = LexicalScorer()
        return self._lexical_scorer.score(question, units).unit

    def profile(self, n_docs: int) -> PositionProfile | None:
        """The calibration profile of this proxy for ``n_docs`` documents, if any (parsed once per file)."""
        if self.profiles is None or self.encoding != "joint":
            return None  # profiles are measured jointly; parallel encoding has no position bias to calibrate
        return self.profiles.get(self.proxy.name, n_docs)


def _merge(first: Scores, second: Scores, rows: np.ndarray) -> Scores:
    """One context's scores from its two readings (``second``: documents reversed, ``rows`` its row map): the mean
    log-odds of the probabilities a probe gives, the plain mean of raw attention."""

    def mean(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return mean_log_odds(a, b) if first.method == "probe" else (np.asarray(a) + np.asarray(b)) / 2.0

    raw = None
    if first.doc_raw is not None and second.doc_raw is not None:
        raw = mean(first.doc_raw, second.doc_raw[::-1])
    return Scores(
        unit=mean(first.unit, to_original(second.unit, rows)),
        doc=mean(first.doc, second.doc[::-1]),
        method=first.method,
        model=first.model,
        attention=first.attention,
        doc_raw=raw,
        calibrated=first.calibrated and second.calibrated,
        calibration_note=first.calibration_note or second.calibration_note,
        lexical_rows=first.lexical_rows,
    )


def _resolve_probe(spec: Probe | None | str, proxy: ProxyModel, level: str, encoding: str) -> Probe | None:
    """A probe from ``"auto"`` (shipped for the model and encoding), a path, a :class:`Probe` or None, checked
    against the proxy model, the encoding's template and the expected level (``unit``: sentences, ``document``:
    documents)."""
    if spec == "auto":
        probe = shipped_probe(proxy.name, level, encoding)
    elif isinstance(spec, str):
        probe = Probe.load(spec)
    else:
        probe = spec
    if probe is not None:
        probe.check_compatible(proxy.name, proxy.num_layers, proxy.num_heads, template_for(encoding))
        if probe.layout.level != level:
            other = {"unit": "sentence", "document": "document"}
            raise ProbeMismatchError(
                f"the {other[level]} probe must be {level}-level; this one is {probe.layout.level}-level"
            )
    return probe
