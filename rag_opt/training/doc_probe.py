"""Training the document relevance probe on NQ multi-document questions (``rag-opt train-doc-probe``).

Examples come from the NQ records of the ``train`` split only (:func:`rag_opt.training.datasets.nq_split`; the
``test`` split is what ``benchmarks/position.py`` measures, the ``calibration`` split builds the position
profiles). Each question is rendered with N documents — its gold passage at a random slot among the 29 BM25
distractors — exactly as the optimizer renders titled documents. Labels: the gold passage is relevant, the
distractors (which do not contain the answer) are not.

Features are cached on disk (:mod:`rag_opt.training.feature_cache`), so extraction is resumable and re-training costs
no forward pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rag_opt.artifacts.position_profiles import PositionProfile
from rag_opt.compressors.doc_relevance import DEFAULT_DOC_BLOCKS, PARALLEL_DOC_BLOCKS
from rag_opt.compressors.features import SENTENCE_BLOCKS, FeatureLayout, build_doc_features
from rag_opt.compressors.probe import Probe
from rag_opt.errors import InvalidInputError
from rag_opt.models.extract import AttentionFeatures
from rag_opt.models.prompt import template_for
from rag_opt.training.feature_cache import FeatureCache, FeatureStore
from rag_opt.training.logistic import choose_l2, cross_val_scores
from rag_opt.training.nq_contexts import NQInstance, extract_nq, nq_records, random_positions
from rag_opt.training.sentence_probe import feature_cache_for, feature_store, fit_probe

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.models.loader import ProxyModel
    from rag_opt.training.datasets import NQExample

__all__ = [
    "build_doc_training_set",
    "cross_val_scores",
    "DOC_L2_GRID",
    "cross_validate",
    "grouped_recall",
    "nq_cache",
    "question_groups",
    "select_retrieval_heads",
    "slot_prior_weights",
    "train_doc_probe",
    "train_doc_probe_cli",
]

logger = logging.getLogger(__name__)


def nq_cache(cache_root: str | Path, model_name: str, split: str, n_docs: int) -> FeatureCache:
    return feature_cache_for(cache_root, model_name, f"nq-{split}-n{n_docs}")


def build_doc_training_set(
    instances: Sequence[NQInstance],
    features: dict[str, AttentionFeatures],
    layout: FeatureLayout,
    profiles: dict[int, PositionProfile],
    sentence_probe: Probe | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(X, y, group): one row per document of every instance with cached features. ``sentence_probe``: the
    sentence probe whose best logit per document the ``doc_best_sentence`` block reads (train with one that has
    not seen these contexts' answer sentences, so the document probe does not learn to over-trust it)."""
    from rag_opt.compressors.features import build_features
    from rag_opt.text.units import UnitTable

    if SENTENCE_BLOCKS & set(layout.blocks) and sentence_probe is None:
        raise InvalidInputError("the document blocks that read sentence scores need a sentence probe")
    xs, ys, gs = [], [], []
    for g, inst in enumerate(instances):
        attn = features.get(inst.id)
        if attn is None:
            continue
        prof = profiles.get(inst.n_docs)
        units = inst.units()
        best = None
        if sentence_probe is not None and SENTENCE_BLOCKS & set(layout.blocks):
            table = UnitTable.titled(units)
            feats = build_features(sentence_probe.layout, attn, inst.example.question, table)
            best = table.doc_best(sentence_probe.unit_logits(feats, table))
        X = build_doc_features(
            layout,
            attn,
            inst.example.question,
            ["".join(u) for u in units],
            prof.baseline if prof else None,
            best_sentence=best,
        )
        y = np.zeros(inst.n_docs)
        y[inst.gold_at] = 1.0
        xs.append(X)
        ys.append(y)
        gs.append(np.full(inst.n_docs, g))
    if not xs:
        raise InvalidInputError("no cached features for any training instance")
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(gs)


def grouped_recall(scores: np.ndarray, y: np.ndarray, groups: np.ndarray, k: int) -> float:
    """Share of groups (questions) whose gold document ranks in the top ``k`` (ties count against it)."""
    hits = []
    for g in np.unique(groups):
        m = groups == g
        s, lab = scores[m], y[m]
        gold = s[lab > 0].max()
        hits.append(int((s >= gold).sum()) <= k)
    return float(np.mean(hits))


def cross_validate(
    X: np.ndarray,
    y: np.ndarray,
    groups: np.ndarray,
    *,
    l2: float,
    folds: int = 5,
    seed: int = 0,
    split: np.ndarray | None = None,
) -> dict[str, float]:
    """Recall@1 / Recall@3 per context (``groups``) of the probe on held-out questions: folds split by ``split``
    (the question of each row, so one question read at several N is never on both sides; default ``groups``)."""
    out = cross_val_scores(X, y, groups if split is None else split, l2=l2, folds=folds, seed=seed)
    return _recalls(out, y, groups)


def _recalls(scores: np.ndarray, y: np.ndarray, groups: np.ndarray) -> dict[str, float]:
    return {"recall@1": grouped_recall(scores, y, groups, 1), "recall@3": grouped_recall(scores, y, groups, 3)}


def question_groups(instances: Sequence[NQInstance], groups: np.ndarray) -> np.ndarray:
    """Per training row (``groups`` index ``instances``): the NQ question it reads (one question is read at every N)."""
    return np.array([instances[int(g)].example.index for g in groups])


# the document probe's L2 strengths (chosen on held-out train questions); the held-out loss kept falling down to
# the smallest of the sentence probe's grid (0.01), so this one reaches lower
DOC_L2_GRID = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)


def select_retrieval_heads(
    instances: Sequence[NQInstance], features: dict[str, AttentionFeatures], *, k: int = 4
) -> dict[str, Any]:
    """The ``k`` (layer, head) pairs whose *raw* attention share ranks the gold passage in the top 3 most often,
    in the better of the two views — what :meth:`rag_opt.orderers.AttentionSort.tuned` averages."""
    from rag_opt.models.prompt import VIEWS

    hits: dict[str, list[np.ndarray]] = {v: [] for v in VIEWS}
    for inst in instances:
        attn = features.get(inst.id)
        if attn is None:
            continue
        for v, view in enumerate(VIEWS):
            m = attn.doc_mass[:, v].astype(np.float64)  # (n_docs, L, H)
            hits[view].append((m >= m[inst.gold_at]).sum(axis=0) <= 3)
    if not hits[VIEWS[0]]:
        raise InvalidInputError("no cached features for any training instance")
    best: dict[str, Any] = {}
    for view, h in hits.items():
        rate = np.mean(h, axis=0)  # (L, H)
        flat = np.argsort(-rate, axis=None, kind="stable")[:k]
        pairs = [tuple(int(x) for x in np.unravel_index(i, rate.shape)) for i in flat]
        score = float(np.mean([rate[p] for p in pairs]))
        if not best or score > best["train_recall@3_per_head"]:
            best = {"view": view, "head_pairs": [list(p) for p in pairs], "train_recall@3_per_head": score}
    return best


def slot_prior_weights(instances: Sequence[NQInstance], groups: np.ndarray) -> np.ndarray:
    """Per training row (``groups`` index ``instances``): a weight that makes the gold passage's slot uniform per N.

    Contexts with the gold passage in the first slot are down-weighted to the average count of the other slots;
    every other context keeps weight 1."""
    used = sorted({int(g) for g in np.unique(groups)})
    per_instance = np.ones(len(instances))
    for n in {instances[g].n_docs for g in used}:
        first = [g for g in used if instances[g].n_docs == n and instances[g].gold_at == 0]
        others = sum(1 for g in used if instances[g].n_docs == n and instances[g].gold_at != 0)
        if first and others and n > 1:
            per_instance[first] = min(1.0, others / (n - 1) / len(first))
    return per_instance[groups.astype(np.int64)]


def train_doc_probe(
    instances: Sequence[NQInstance],
    features: dict[str, AttentionFeatures],
    profiles: dict[int, PositionProfile],
    *,
    model_name: str,
    num_layers: int,
    num_heads: int,
    blocks: tuple[str, ...] = DEFAULT_DOC_BLOCKS,
    l2: float | None = None,
    seed: int = 0,
    meta: dict[str, Any] | None = None,
    sentence_probe: Probe | None = None,
    encoding: str = "joint",
) -> tuple[Probe, dict[str, Any]]:
    """Fit the document probe; returns it with a report (l2 choice, cross-validated recall). ``encoding``: how
    the features were read (the probe records its template and is refused under another one).

    Contexts are weighted so that, for each N, the gold passage sits in the first slot no more often than in any
    other (extra first-slot contexts teach the probe what the first slot looks like without teaching it that the
    first document is likely the answer)."""
    layout = FeatureLayout(blocks, num_layers, num_heads, level="document")
    X, y, groups = build_doc_training_set(instances, features, layout, profiles, sentence_probe)
    weights = slot_prior_weights(instances, groups)
    questions = question_groups(instances, groups)  # held-out splits never share a question across N
    losses: dict[float, float] = {}
    if l2 is None:
        l2, losses = choose_l2(X, y, questions, grid=DOC_L2_GRID, seed=seed)
    t = time.perf_counter()
    held = cross_val_scores(X, y, questions, l2=l2, folds=5, seed=seed)  # folds split by question
    n_of_row = np.array([instances[int(g)].n_docs for g in groups])
    cv = _recalls(held, y, groups)
    per_n = {
        str(n): _recalls(held[n_of_row == n], y[n_of_row == n], groups[n_of_row == n]) for n in np.unique(n_of_row)
    }
    report = {
        "questions": int(len(np.unique(questions))),
        "contexts": int(len(np.unique(groups))),
        "documents": int(len(y)),
        "l2": l2,
        "l2_heldout_logloss": {str(k): v for k, v in losses.items()},
        "cv_5fold": cv,
        "cv_5fold_per_n": per_n,
    }
    meta = {
        "kind": "document relevance",
        "template": template_for(encoding),
        "encoding": encoding,
        "labels": "NQ gold passage = 1, BM25 distractors without the answer = 0",
        "seed": seed,
        "profiles": {str(n): p.contexts for n, p in sorted(profiles.items())},
        **report,
        **(meta or {}),
    }
    probe = fit_probe(X, y, layout, model_name, l2=l2, seed=seed, meta=meta, sample_weight=weights)
    report["fit_seconds"] = probe.metadata["fit_seconds"] = round(time.perf_counter() - t, 1)
    return probe, report


def train_doc_probe_cli(
    *,
    data: str,
    out: str,
    model: str | None,
    n_docs: Sequence[int],
    limit: int | None,
    seed: int,
    cache_root: str,
    store: str | None,
    l2: float | None,
    blocks: tuple[str, ...] | None,
    layers: int | None = None,
    dtype: str | None = None,
    cached_only: bool = False,
    sentence_probe: str | None = None,
    first_slot: int = 0,
    encoding: str = "joint",
) -> tuple[Probe, dict[str, Any]]:
    """Extract (or reuse cached) NQ-train features for each N, train the document probe, write it as JSON.

    ``layers``: train on the first this many layers only (early exit). ``dtype``: the proxy precision of the
    features. ``cached_only``: use only contexts already cached (no forward pass). ``sentence_probe``: a path to
    the sentence probe the ``doc_best_sentence`` block reads (default: the shipped one of the encoding).
    ``first_slot``: also train on the first this many questions with the gold passage in the *first* slot, for each
    N (at random positions the first slot gets only 1/N of the examples, and it is where attention says least).

    ``encoding="parallel"``: features read with parallel encoding (their own caches), no calibration profile
    (every slot reads alike) and :data:`~rag_opt.compressors.doc_relevance.PARALLEL_DOC_BLOCKS` by default. The
    questions are extracted a few at a time for every N together, over one bounded cache of document encodings, so
    a passage is read once for all the Ns it appears in."""
    from rag_opt.artifacts.position_profiles import ProfileStore
    from rag_opt.compressors.probe import shipped_probe
    from rag_opt.models.loader import load_proxy_model

    template_for(encoding)  # refuses an unknown encoding before the model loads
    parallel = encoding == "parallel"
    proxy = load_proxy_model(model, dtype=dtype)
    blocks = blocks or (PARALLEL_DOC_BLOCKS if parallel else DEFAULT_DOC_BLOCKS)
    calibrated = [b for b in blocks if b.startswith(("doc_cal_", "doc_ratio_"))]
    if parallel and calibrated:
        raise InvalidInputError(
            f"feature block {calibrated[0]!r} reads a calibration profile, which parallel encoding has none of "
            "(every slot reads alike): use the doc_raw_* blocks"
        )
    sprobe = None
    if SENTENCE_BLOCKS & set(blocks):
        sprobe = Probe.load(sentence_probe) if sentence_probe else shipped_probe(proxy.name, "unit", encoding)
        if sprobe is None:
            raise InvalidInputError(
                f"the document blocks that read sentence scores need a sentence probe for {proxy.name} ({encoding})"
            )
        sprobe.check_compatible(proxy.name, proxy.num_layers, proxy.num_heads, template_for(encoding))
    profile_store = ProfileStore(store)
    records = nq_records(data, "train")[:limit]
    profiles: dict[int, PositionProfile] = {}
    per_n: dict[int, tuple[list[NQInstance], FeatureStore]] = {}
    # a sentence probe that reads cross-document attention needs features extracted with it (their own cache)
    cross = sprobe is not None and sprobe.layout.needs_cross
    for n in n_docs:
        if calibrated:
            prof = profile_store.get(proxy.name, n)
            if prof is None:
                raise InvalidInputError(
                    f"no calibration profile for {n} documents of {proxy.name}: run `rag-opt calibrate --n-docs {n}` "
                    "first"
                )
            profiles[n] = prof
        insts = random_positions(records, n, seed=seed)
        seen = {i.id for i in insts}
        insts += [i for i in (NQInstance(ex, n, 0) for ex in records[:first_slot]) if i.id not in seen]
        name = f"nq-train-n{n}" + ("-cross" if cross else "")
        # deep enough for the sentence probe too (the document probe reads the first ``layers`` of them)
        depth = max(layers or proxy.num_layers, sprobe.layout.num_layers if sprobe is not None else 1)
        per_n[n] = (insts, feature_store(cache_root, proxy, name, depth, encoding))
    if not cached_only:
        if parallel:
            _extract_parallel_nq(proxy, records, per_n, cross=cross)
        else:
            for n, (insts, fstore) in per_n.items():
                extract_nq(
                    insts, fstore, proxy, layers=fstore.layers, desc=f"NQ train features, {n} documents", cross=cross
                )
    instances: list[NQInstance] = []
    features: dict[str, AttentionFeatures] = {}
    for insts, fstore in per_n.values():
        cached = fstore.load(i.id for i in insts)
        features.update(cached)
        instances.extend(i for i in insts if i.id in cached)
    probe, report = train_doc_probe(
        instances,
        features,
        profiles,
        model_name=proxy.name,
        num_layers=layers or proxy.num_layers,
        num_heads=proxy.num_heads,
        blocks=blocks,
        l2=l2,
        seed=seed,
        sentence_probe=sprobe,
        encoding=encoding,
        meta={
            "trained_on": "nq_multidoc train split: "
            + ", ".join(f"{sum(i.n_docs == n for i in instances)} contexts of {n} documents" for n in n_docs),
            "layers": layers or proxy.num_layers,
            "precision": str(proxy.dtype).removeprefix("torch."),
        },
    )
    probe.metadata["attention_sort"] = select_retrieval_heads(instances, features)
    logger.info("document probe: %s; retrieval heads %s", report, probe.metadata["attention_sort"])
    probe.save(out)
    return probe, report


PARALLEL_CHUNK = 10  # questions extracted together (every N) over one bounded cache of document encodings
PARALLEL_CACHE_BYTES = 2 * 1024**3


def _extract_parallel_nq(
    proxy: ProxyModel,
    records: Sequence[NQExample],
    per_n: dict[int, tuple[list[NQInstance], FeatureStore]],
    *,
    cross: bool = False,
) -> None:
    """Parallel-encoding features for every N, a few questions at a time: each chunk's passages are encoded once
    (at its largest N) and reused from a bounded :class:`~rag_opt.models.encoding_cache.EncodingCache` for the
    smaller Ns, whose contexts hold the same passages. Resumable like :func:`extract_nq` (per N). ``cross``: with
    the cross-document reading (the sentence probe reads it; stores of their own)."""
    from tqdm.auto import tqdm

    from rag_opt.models.encoding_cache import EncodingCache

    encodings = EncodingCache(max_bytes=PARALLEL_CACHE_BYTES)
    by_record: dict[int, list[tuple[NQInstance, FeatureStore]]] = {}
    for insts, fstore in per_n.values():
        done = fstore.ids()
        for inst in insts:
            if inst.id not in done:
                by_record.setdefault(inst.example.index, []).append((inst, fstore))
    order = [ex.index for ex in records if ex.index in by_record]
    with tqdm(total=len(order), desc="NQ train features (parallel, every N)", mininterval=5.0) as bar:
        for a in range(0, len(order), PARALLEL_CHUNK):
            chunk = order[a : a + PARALLEL_CHUNK]
            for n in sorted(per_n, reverse=True):  # the largest N first: it encodes every passage of the chunk
                insts = [inst for r in chunk for inst, _ in by_record[r] if inst.n_docs == n]
                if insts:
                    fstore = per_n[n][1]
                    extract_nq(
                        insts,
                        fstore,
                        proxy,
                        layers=fstore.layers,
                        progress=False,
                        cross=cross,
                        encoding="parallel",
                        encodings=encodings,
                    )
            bar.update(len(chunk))
