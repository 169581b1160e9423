"""Turn attention features (and cheap lexical signals) into the probe's per-unit feature matrix.

A feature *layout* is a list of named blocks; the probe stores the layout it was trained with and refuses a
model or layout that does not match. Blocks:

* ``attn_last`` / ``attn_question``: log attention (relative to uniform) per layer and head, from the final
  token's row and from the mean of the question tokens' rows (``layers × heads`` values each);
* ``attn_last_ctx`` / ``attn_question_ctx``: the same, centred on the context's mean over its units (how much
  more than its neighbours a unit is attended, per head);
* ``doc_attn_question``: log share of attention on the unit's whole document, per layer and head, relative
  to an even share — lets the probe see which document a sentence belongs to;
* ``lexical``: BM25 of the unit and of its document against the question (raw and relative to the context's
  best), question-term overlap, first-unit-of-document flag, log length in proxy tokens, relative position;
* ``cross_doc``: log cross-document attention per layer and head — the mean attention (relative to uniform) the
  unit receives from the last token of every sentence of another, later document in the same pass (a bridge
  sentence draws attention from the paragraph of the entity it names) — plus a flag for units no other document
  follows (their attention values are 0). Needs features extracted with ``cross=True``. Under parallel encoding,
  where no document reads another, the sources are the last tokens of every sentence of every *other* document,
  their cached query states read against the other blocks' keys from the question pass's position
  (:mod:`rag_opt.models.parallel_cross`); probes record their template, so one reading never meets the other.

Document-level layouts (``level="document"``, the document relevance probe of :mod:`rag_opt.compressors.doc_relevance`)
use one row per document and these blocks:

* ``doc_cal_last`` / ``doc_cal_question``: position-calibrated attention share per layer and head — the
  document's share minus the share a non-relevant document gets in the same slot (the calibration profile),
  times the number of documents (so 0 means "as much as a non-relevant document there");
* ``doc_ratio_last`` / ``doc_ratio_question``: the same subtraction in log space — log of the document's share
  over the non-relevant share in the same slot ("twice what this slot usually gets" reads the same in every
  slot; the default: more accurate and more even across positions than the plain difference);
* ``doc_raw_last`` / ``doc_raw_question``: uncalibrated log share relative to an even share (ablation);
* ``doc_lexical``: BM25 of the document against the question (relative to the context's best, and log) and
  question-term overlap;
* ``doc_lexical_rank``: the document's BM25 rank in the context (0 = best, over the number of documents) and
  whether it is the BM25 best;
* ``doc_position``: where the document sits — first slot, last slot, relative position — so a probe trained at
  mixed N can correct what calibration leaves at the edges;
* ``doc_edge_lexical``: ``doc_lexical`` and ``doc_lexical_rank`` again, but only at the first and at the last
  slot (zero elsewhere): position × lexical interactions for the slots where attention is least reliable;
* ``doc_best_sentence``: the sentence probe's best logit among the document's sentences, raw and relative to
  the context's best (the sentence probe reads each sentence's own attention, which the first slots' attention
  sink distorts less than the document's total share);
* ``doc_early_interactions``: the best-sentence logit and gap, BM25 (relative) and BM25 rank, each times "first
  slot" and times "earliness" (1 − relative position): lets a linear probe trust these signals more in the early
  slots, where the document's attention share is least informative.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rag_opt.compressors.lexical import RECORD_TERMS, bm25_scores, term_overlap
from rag_opt.compressors.structured import structured_rows
from rag_opt.errors import ProbeMismatchError

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.models.extract import AttentionFeatures
    from rag_opt.text.units import UnitTable

__all__ = [
    "ALL_BLOCKS",
    "BASE_BLOCKS",
    "CROSS_BLOCKS",
    "DEFAULT_BLOCKS",
    "DOC_BLOCKS",
    "SENTENCE_BLOCKS",
    "FeatureLayout",
    "build_doc_features",
    "build_features",
    "lexical_features",
]

EPS = 1e-3
LEXICAL_NAMES = (
    "bm25_rel",
    "bm25_log",
    "overlap",
    "doc_bm25_rel",
    "doc_overlap",
    "first_in_doc",
    "log_tokens",
    "position_in_doc",
)
ALL_BLOCKS = (
    "attn_last",
    "attn_question",
    "attn_last_ctx",
    "attn_question_ctx",
    "doc_attn_question",
    "lexical",
    "cross_doc",
)
# blocks that need cross-document attention in the features (``extract(cross=True)``)
CROSS_BLOCKS = frozenset({"cross_doc"})
# what every feature cache serves (no cross-document rows needed); the ablations of earlier rounds used these
BASE_BLOCKS = ("attn_last", "attn_question", "doc_attn_question", "lexical")
# the shipped sentence probe's (issue 14: cross-document attention moved held-out recall on both dev slices)
DEFAULT_BLOCKS = (*BASE_BLOCKS, "cross_doc")
DOC_LEXICAL_NAMES = ("bm25_rel", "bm25_log", "overlap")
DOC_LEXICAL_RANK_NAMES = ("bm25_rank", "bm25_best")
DOC_POSITION_NAMES = ("first", "last", "relative")
DOC_SENTENCE_NAMES = ("best_sentence", "best_sentence_gap")
# document blocks that read the sentence probe's best logit per document
SENTENCE_BLOCKS = frozenset({"doc_best_sentence", "doc_early_interactions"})
DOC_BLOCKS = (
    "doc_cal_last",
    "doc_cal_question",
    "doc_ratio_last",
    "doc_ratio_question",
    "doc_raw_last",
    "doc_raw_question",
    "doc_lexical",
    "doc_lexical_rank",
    "doc_position",
    "doc_edge_lexical",
    "doc_best_sentence",
    "doc_early_interactions",
)
LEVELS = {"unit": ALL_BLOCKS, "document": DOC_BLOCKS}


@dataclass(frozen=True)
class FeatureLayout:
    blocks: tuple[str, ...]
    num_layers: int
    num_heads: int
    level: str = "unit"  # "unit": one row per sentence/unit; "document": one row per document

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"unknown feature level {self.level!r}; use one of {list(LEVELS)}")
        if not self.blocks:
            raise ValueError("a feature layout needs at least one block")
        known = LEVELS[self.level]
        unknown = [b for b in self.blocks if b not in known]
        if unknown:
            raise ValueError(f"unknown {self.level}-level feature block(s) {unknown}; known: {list(known)}")

    def block_size(self, block: str) -> int:
        if block == "lexical":
            return len(LEXICAL_NAMES)
        if block == "doc_lexical":
            return len(DOC_LEXICAL_NAMES)
        if block == "doc_lexical_rank":
            return len(DOC_LEXICAL_RANK_NAMES)
        if block == "doc_position":
            return len(DOC_POSITION_NAMES)
        if block == "doc_edge_lexical":
            return 2 * (len(DOC_LEXICAL_NAMES) + len(DOC_LEXICAL_RANK_NAMES))
        if block == "doc_best_sentence":
            return len(DOC_SENTENCE_NAMES)
        if block == "doc_early_interactions":
            return 8
        if block == "cross_doc":
            return self.num_layers * self.num_heads + 1
        return self.num_layers * self.num_heads

    def columns(self, blocks: Sequence[str]) -> np.ndarray:
        """The feature columns of ``blocks`` (each one of this layout's), in column order."""
        missing = [b for b in blocks if b not in self.blocks]
        if missing:
            raise ValueError(f"feature block(s) {missing} not in this layout's {list(self.blocks)}")
        out: list[int] = []
        start = 0
        for block in self.blocks:
            size = self.block_size(block)
            if block in blocks:
                out.extend(range(start, start + size))
            start += size
        return np.asarray(out, dtype=np.int64)

    @property
    def needs_cross(self) -> bool:
        """Whether the layout reads cross-document attention (features must be extracted with ``cross=True``)."""
        return bool(CROSS_BLOCKS & set(self.blocks))

    @property
    def size(self) -> int:
        return sum(self.block_size(b) for b in self.blocks)

    def to_dict(self) -> dict[str, object]:
        return {
            "blocks": list(self.blocks),
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "level": self.level,
        }


def lexical_features(question: str, units: UnitTable, unit_tokens: np.ndarray) -> np.ndarray:
    flat = list(units.texts)
    n = len(flat)
    doc_of = units.doc
    language = units.language
    bm = bm25_scores(question, flat, language)
    ov = term_overlap(question, flat, language)
    rows = structured_rows(units)
    if rows.any():  # records are often named by a single character (item 3): their rows read those terms too
        bm[rows] = bm25_scores(question, flat, language, pattern=RECORD_TERMS)[rows]
        ov[rows] = term_overlap(question, flat, language, pattern=RECORD_TERMS)[rows]
    doc_texts = units.document_texts()
    dbm = bm25_scores(question, doc_texts, language)
    dov = term_overlap(question, doc_texts, language)
    first = np.zeros(n, dtype=np.float32)
    pos = np.zeros(n, dtype=np.float32)
    for d in range(units.n_docs):
        cands = [r for r in units.rows(d) if units.candidate[r]]
        for rank, r in enumerate(cands):
            first[r] = 1.0 if rank == 0 else 0.0
            pos[r] = rank / max(len(cands) - 1, 1)
    if rows.any():  # a record's place in its list says nothing of its relevance (prose's lead sentence does)
        first[rows] = 0.0
        pos[rows] = 0.5
    out = np.stack(
        [
            bm / (bm.max() if n and bm.max() > 0 else 1.0),
            np.log1p(bm),
            ov,
            (dbm / (dbm.max() if dbm.size and dbm.max() > 0 else 1.0))[doc_of],
            dov[doc_of],
            first,
            np.log1p(unit_tokens.astype(np.float32)),
            pos,
        ],
        axis=1,
    )
    return out.astype(np.float32)


def _fit(layout: FeatureLayout, attn: AttentionFeatures) -> AttentionFeatures:
    """The features of the layers ``layout`` reads (its first ``num_layers``); refuse a model that has fewer."""
    if layout.needs_cross and attn.cross is None:
        raise ProbeMismatchError(
            "feature block 'cross_doc' needs cross-document attention: extract the features with cross=True"
        )
    if attn.num_layers < layout.num_layers or attn.num_heads != layout.num_heads:
        raise ProbeMismatchError(
            f"feature layout expects {layout.num_layers}×{layout.num_heads} layers×heads, the proxy model "
            f"gives {attn.num_layers}×{attn.num_heads}"
        )
    return attn.first_layers(layout.num_layers)


def build_features(layout: FeatureLayout, attn: AttentionFeatures, question: str, units: UnitTable) -> np.ndarray:
    """Feature matrix (n_units, layout.size) for every unit of the context (candidates and others)."""
    if layout.level != "unit":
        raise ValueError(f"build_features needs a unit-level layout, got level {layout.level!r}")
    attn = _fit(layout, attn)
    n = attn.unit.shape[0]
    doc_of = units.doc
    n_docs = max(units.n_docs, 1)
    blocks: list[np.ndarray] = []
    for block in layout.blocks:
        if block == "attn_last":
            blocks.append(np.log(attn.unit[:, 0].reshape(n, -1) + EPS))
        elif block == "attn_question":
            blocks.append(np.log(attn.unit[:, 1].reshape(n, -1) + EPS))
        elif block in ("attn_last_ctx", "attn_question_ctx"):
            v = np.log(attn.unit[:, 0 if block == "attn_last_ctx" else 1].reshape(n, -1) + EPS)
            blocks.append(v - v.mean(axis=0, keepdims=True))
        elif block == "doc_attn_question":
            blocks.append(np.log(attn.doc_mass[doc_of, 1].reshape(n, -1) * n_docs + EPS))
        elif block == "lexical":
            blocks.append(lexical_features(question, units, attn.unit_tokens))
        elif block == "cross_doc":
            blocks.append(_cross_doc(attn))
    return np.concatenate(blocks, axis=1).astype(np.float32)


def _cross_doc(attn: AttentionFeatures) -> np.ndarray:
    """The ``cross_doc`` block: log cross-document attention per layer and head, and the no-source flag."""
    assert attn.cross is not None and attn.cross_sources is not None
    n = attn.cross.shape[0]
    none = attn.cross_sources == 0
    values = np.log(attn.cross.reshape(n, -1).astype(np.float64) + EPS)
    values[none] = 0.0
    return np.concatenate([values, none[:, None].astype(np.float64)], axis=1)


def build_doc_features(
    layout: FeatureLayout,
    attn: AttentionFeatures,
    question: str,
    doc_texts: Sequence[str],
    baseline: np.ndarray | None,
    language: str = "en",
    best_sentence: np.ndarray | None = None,
) -> np.ndarray:
    """Feature matrix (n_docs, layout.size), one row per document in prompt order.

    ``baseline`` is the calibration profile's per-slot share (n_docs, n_views, L, H); the ``doc_cal_*``
    blocks need it. ``language`` chooses the stopwords of the ``doc_lexical`` block. ``best_sentence``: the
    sentence probe's best logit per document (n_docs,), which the ``doc_best_sentence`` block needs.
    """
    if layout.level != "document":
        raise ValueError(f"build_doc_features needs a document-level layout, got level {layout.level!r}")
    attn = _fit(layout, attn)
    n = attn.doc_mass.shape[0]
    if len(doc_texts) != n:
        raise ValueError(f"{len(doc_texts)} document texts for attention over {n} documents")
    if attn.windows != 1:
        raise ValueError("document features need the whole context in one forward pass (windows == 1)")
    mass = attn.doc_mass.astype(np.float64)
    if baseline is not None:
        baseline = baseline[:, :, : layout.num_layers]  # a profile covers every layer; the probe reads the first
    calibrated = [b for b in layout.blocks if b.startswith(("doc_cal_", "doc_ratio_"))]
    if calibrated and baseline is None:
        raise ValueError(f"feature block {calibrated[0]!r} needs a calibration profile")
    needs_best = SENTENCE_BLOCKS & set(layout.blocks)
    if needs_best and (best_sentence is None or np.shape(best_sentence) != (n,)):
        raise ValueError(
            f"feature block {sorted(needs_best)[0]!r} needs the best sentence logit of each of the {n} documents"
        )
    if calibrated and baseline is not None and baseline.shape != mass.shape:
        raise ValueError(f"calibration baseline {baseline.shape} does not match attention {mass.shape}")
    lexical_blocks = {"doc_lexical", "doc_lexical_rank", "doc_edge_lexical", "doc_early_interactions"}
    lexical = _doc_lexical(question, doc_texts, language) if lexical_blocks & set(layout.blocks) else np.zeros((n, 5))
    blocks: list[np.ndarray] = []
    for block in layout.blocks:
        view = 0 if block.endswith("_last") else 1
        if block.startswith("doc_cal_"):
            assert baseline is not None
            blocks.append(((mass[:, view] - baseline[:, view]) * n).reshape(n, -1))
        elif block.startswith("doc_ratio_"):
            assert baseline is not None
            ratio = (mass[:, view] * n + EPS) / (baseline[:, view] * n + EPS)
            blocks.append(np.log(ratio).reshape(n, -1))
        elif block.startswith("doc_raw_"):
            blocks.append(np.log(mass[:, view] * n + EPS).reshape(n, -1))
        elif block == "doc_lexical":
            blocks.append(lexical[:, : len(DOC_LEXICAL_NAMES)])
        elif block == "doc_lexical_rank":
            blocks.append(lexical[:, len(DOC_LEXICAL_NAMES) :])
        elif block == "doc_position":
            blocks.append(_doc_position(n))
        elif block == "doc_edge_lexical":
            pos = _doc_position(n)
            blocks.append(np.concatenate([lexical * pos[:, :1], lexical * pos[:, 1:2]], axis=1))
        elif block == "doc_best_sentence":
            best = np.asarray(best_sentence, dtype=np.float64)
            blocks.append(np.stack([best, best - best.max()], axis=1))
        elif block == "doc_early_interactions":
            best = np.asarray(best_sentence, dtype=np.float64)
            signals = np.stack([best, best - best.max(), lexical[:, 0], lexical[:, 3]], axis=1)
            pos = _doc_position(n)
            blocks.append(np.concatenate([signals * pos[:, :1], signals * (1.0 - pos[:, 2:3])], axis=1))
    return np.concatenate(blocks, axis=1).astype(np.float32)


def _doc_lexical(question: str, doc_texts: Sequence[str], language: str) -> np.ndarray:
    """Per document: ``DOC_LEXICAL_NAMES`` then ``DOC_LEXICAL_RANK_NAMES``."""
    bm = bm25_scores(question, list(doc_texts), language)
    ov = term_overlap(question, list(doc_texts), language)
    n = len(doc_texts)
    top = bm.max() if bm.size and bm.max() > 0 else 1.0
    rank = np.empty(n)
    rank[np.argsort(-bm, kind="stable")] = np.arange(n)
    best = (rank == 0).astype(np.float64) if n and bm.max() > 0 else np.zeros(n)
    return np.stack([bm / top, np.log1p(bm), ov, rank / max(n - 1, 1), best], axis=1)


def _doc_position(n: int) -> np.ndarray:
    """Per slot: first, last, relative position (0 … 1)."""
    out = np.zeros((n, len(DOC_POSITION_NAMES)))
    if n:
        out[0, 0] = 1.0
        out[-1, 1] = 1.0
        out[:, 2] = np.arange(n) / max(n - 1, 1)
    return out
