"""Training the sentence-relevance probe on HotpotQA (``rag-opt train-probe``).

Examples: every HotpotQA question of the training file (shuffled with a fixed seed; ``limit`` takes a prefix).
Each paragraph is rendered as its title line followed by its sentences, exactly as the optimizer renders a
document with a title. Labels: a sentence is positive when it is a supporting fact or contains the answer
string (SQuAD-normalised; yes/no answers never mark sentences). Title units are not training examples (titles
are kept with their document). Questions whose answer is yes/no still contribute their supporting facts.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rag_opt.compressors.context_features import DEFAULT_CONTEXT
from rag_opt.compressors.features import FeatureLayout
from rag_opt.compressors.probe import ContextStage, HiddenLayer, Probe
from rag_opt.errors import DataNotFoundError, InvalidInputError
from rag_opt.models.extract import AttentionFeatures
from rag_opt.models.prompt import TEMPLATE_ID, template_for
from rag_opt.training.datasets import HotpotExample, read_hotpotqa
from rag_opt.training.feature_cache import FeatureCache, FeatureStore, fill_cache
from rag_opt.training.logistic import choose_l2, cross_val_scores, train_logistic
from rag_opt.training.mlp import MLPConfig, cross_val_mlp_scores, train_mlp
from rag_opt.training.units import assign_title_regimes, hotpot_table, regime_units

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.models.loader import ProxyModel
    from rag_opt.text.units import UnitTable

__all__ = [
    "build_training_set",
    "extract_hotpot",
    "feature_cache_for",
    "feature_folder",
    "feature_store",
    "hotpot_store_name",
    "fit_context_stage",
    "fit_probe",
    "train_probe_cli",
    "regime_labels",
    "unit_labels",
]

logger = logging.getLogger(__name__)


def feature_folder(root: str | Path, model_name: str, template: str = TEMPLATE_ID) -> Path:
    """The folder of one (model, prompt template)'s caches: features of another template (or encoding) never mix
    in."""
    safe = model_name.replace(":", "-").replace("/", "-")
    return Path(root) / safe / template


def feature_cache_for(root: str | Path, model_name: str, dataset: str, template: str = TEMPLATE_ID) -> FeatureCache:
    """The cache of one (model, prompt template, dataset)."""
    return FeatureCache(feature_folder(root, model_name, template) / dataset)


def feature_store(
    root: str | Path, proxy: ProxyModel, dataset: str, layers: int | None = None, encoding: str = "joint"
) -> FeatureStore:
    """The caches of ``dataset``'s features from ``proxy`` at its precision, for probes of ``layers`` layers,
    read with ``encoding`` (``joint`` or ``parallel``: caches of their own)."""
    return FeatureStore(
        feature_folder(root, proxy.name, template_for(encoding)),
        dataset,
        str(proxy.dtype),
        layers or proxy.num_layers,
        proxy.num_layers,
    )


def extract_hotpot(
    path: str | Path,
    cache_root: str | Path,
    *,
    model: str | None = None,
    dtype: str | None = None,
    layers: int | None = None,
    limit: int | None = None,
    seed: int = 0,
    max_tokens: int = 2048,
    progress: bool = True,
    cross: bool = False,
    encoding: str = "joint",
    titles: str = "field",
    examples: Sequence[HotpotExample] | None = None,
) -> FeatureStore:
    """Compute (or reuse) attention features of the first ``layers`` layers (default all; the forward pass
    stops there) for HotpotQA examples at the proxy's precision ``dtype``, and return their store.
    ``cross``: with cross-document attention (a store of its own, named ``<split>-cross``). ``encoding``: how
    the proxy reads the context (``parallel`` features live under their own template). ``titles``: the title
    regime the paragraphs are read in (:mod:`rag_opt.training.units`; ``none`` has a store of its own,
    ``<split>-untitled``, and ``text`` reads the same tokens as ``field``). ``examples``: these examples of
    ``path`` instead of its first ``limit``."""
    from rag_opt.models.extract import extract_batch
    from rag_opt.models.loader import load_proxy_model

    proxy = load_proxy_model(model, dtype=dtype)
    todo = list(examples) if examples is not None else read_hotpotqa(path, limit=limit, seed=seed)
    store = feature_store(cache_root, proxy, hotpot_store_name(path, cross=cross, titles=titles), layers, encoding)
    fill_cache(
        store,
        [(ex.id, regime_units(ex, titles), ex.question) for ex in todo],
        lambda contexts: extract_batch(
            proxy, contexts, max_tokens=max_tokens, layers=store.layers, cross=cross, encoding=encoding
        ),
        progress=progress,
        desc=f"features {Path(path).name}" + ("" if titles in ("field", "text") else f" ({titles} titles)"),
    )
    return store


def hotpot_store_name(path: str | Path, *, cross: bool = False, titles: str = "field") -> str:
    """The feature store of a HotpotQA file's examples: ``<split>``, ``-untitled`` for the ``none`` title regime,
    ``-cross`` with cross-document attention."""
    untitled = "-untitled" if titles == "none" else ""
    return Path(path).name.split(".")[0] + untitled + ("-cross" if cross else "")


def unit_labels(ex: HotpotExample) -> list[list[bool]]:
    """Per paragraph, per sentence: supporting fact or contains the (non yes/no) answer."""
    from rag_opt.training.datasets import contains_answer

    labels = []
    for p, sents in enumerate(ex.sentences):
        labels.append(
            [(p, k) in ex.supporting or (not ex.yes_no and contains_answer(s, ex.answer)) for k, s in enumerate(sents)]
        )
    return labels


def regime_labels(ex: HotpotExample, regime: str = "field") -> np.ndarray:
    """The labels of every unit of :func:`rag_opt.training.units.hotpot_table` (``ex`` given in title ``regime``),
    in row order: False for a title row or heading line, :func:`unit_labels` for the sentences."""
    head = [] if regime == "none" else [False]
    return np.concatenate([np.asarray([*head, *lab], dtype=bool) for lab in unit_labels(ex)])


def build_training_set(
    examples: list[HotpotExample],
    features: Mapping[str, AttentionFeatures],
    layout: FeatureLayout,
    *,
    progress: bool = True,
    tables: list[UnitTable] | None = None,
    regimes: Sequence[str] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(X, y, group) over the sentence units of every example with cached features. ``tables``: a list to
    append each used example's unit table to (in row order: what :func:`fit_context_stage` needs). ``regimes``:
    each example's title regime (default ``field``); its features must be those of that regime."""
    from tqdm.auto import tqdm

    from rag_opt.compressors.features import build_features

    if regimes is not None and len(regimes) != len(examples):
        raise InvalidInputError(f"{len(regimes)} title regimes for {len(examples)} examples")
    xs, ys, gs = [], [], []
    for g, ex in enumerate(tqdm(examples, desc="probe features", disable=not progress, mininterval=5.0)):
        attn = features.get(ex.id)
        if attn is None:
            continue
        regime = regimes[g] if regimes is not None else "field"
        units = hotpot_table(ex, regime)
        if tables is not None:
            tables.append(units)
        X = build_features(layout, attn, ex.question, units)
        cand = units.candidate
        labels = regime_labels(ex, regime)
        xs.append(X[cand])
        ys.append(labels[cand])
        gs.append(np.full(int(cand.sum()), g))
    if not xs:
        raise InvalidInputError("no cached features for any training example")
    return np.concatenate(xs), np.concatenate(ys).astype(np.float64), np.concatenate(gs)


CONTEXT_FOLDS = 5  # the second stage is fit on first-stage logits held out this many ways (folds by question)


def fit_context_stage(
    tables: Sequence[UnitTable],
    logits: np.ndarray,
    y: np.ndarray,
    names: Sequence[str] = DEFAULT_CONTEXT,
    *,
    l2: float = 1e-2,
    seed: int = 0,
) -> ContextStage:
    """Fit the second stage on first-stage ``logits`` of the candidate rows of ``tables`` (concatenated in
    order, as :func:`build_training_set` lays them out). Pass *held-out* logits (:func:`cross_val_scores`):
    logits of a probe on its own training rows are over-confident, and the second stage would learn to trust
    them too much."""
    from rag_opt.compressors.context_features import context_features

    rows, pos = [], 0
    for units in tables:
        cand = units.candidate
        z = np.zeros(units.n_units)
        z[cand] = logits[pos : pos + int(cand.sum())]
        pos += int(cand.sum())
        rows.append(context_features(z, units, names)[cand])
    if pos != len(logits) or pos != len(y):
        raise InvalidInputError(f"{len(logits)} logits and {len(y)} labels for {pos} candidate units")
    mean, scale, w, b = train_logistic(np.concatenate(rows), y, l2=l2, seed=seed)
    return ContextStage(names=tuple(names), mean=mean, scale=scale, weights=w, bias=b)


def fit_probe(
    X: np.ndarray,
    y: np.ndarray,
    layout: FeatureLayout,
    model_name: str,
    *,
    l2: float,
    seed: int,
    meta: dict[str, Any],
    groups: np.ndarray | None = None,
    context: Sequence[str] | None = None,
    tables: Sequence[UnitTable] | None = None,
    sample_weight: np.ndarray | None = None,
    mlp: MLPConfig | None = None,
) -> Probe:
    """Fit the first stage on (X, y) (``mlp``: with one hidden layer, :mod:`rag_opt.training.mlp`, and ``l2``
    unused; else logistic); with ``context`` feature names (and the ``tables`` of the rows), also the second stage,
    on 5-fold held-out first-stage logits (folds by question, ``groups`` of the rows)."""
    from tqdm.auto import tqdm

    hidden = None
    held_out = None
    folds_of: np.ndarray | None = None
    if context:
        if tables is None or groups is None:
            raise InvalidInputError("a context stage needs the unit tables and the question groups of the rows")
        folds_of = groups
    if mlp is not None:
        missing = [b for b in mlp.linear_blocks if b not in layout.blocks]
        if missing:
            raise InvalidInputError(
                f"feature block(s) {missing} to pass around the network are not in the layout {list(layout.blocks)}"
            )
        linear = layout.columns(mlp.linear_blocks)
        networks = mlp.members * (1 + (CONTEXT_FOLDS if folds_of is not None else 0))
        with tqdm(total=networks, desc="first-stage networks", mininterval=5.0) as bar:
            if folds_of is not None:
                held_out = cross_val_mlp_scores(
                    X,
                    y,
                    folds_of,
                    mlp,
                    folds=CONTEXT_FOLDS,
                    seed=seed,
                    sample_weight=sample_weight,
                    linear_columns=linear,
                    progress=bar.update,
                )
            net = train_mlp(
                X, y, mlp, seed=seed, sample_weight=sample_weight, linear_columns=linear, progress=bar.update
            )
        mean, scale, w, b = net.mean, net.scale, net.weights, net.bias
        hidden = HiddenLayer(net.hidden_weights, net.hidden_bias, linear=net.linear)
    else:
        mean, scale, w, b = train_logistic(X, y, l2=l2, seed=seed, sample_weight=sample_weight)
        if folds_of is not None:
            held_out = cross_val_scores(
                X, y, folds_of, l2=l2, folds=CONTEXT_FOLDS, seed=seed, sample_weight=sample_weight
            )
    stage = None
    if context and tables is not None and held_out is not None:
        stage = fit_context_stage(tables, held_out, y, context, seed=seed)
    return Probe(
        model=model_name,
        layout=layout,
        mean=mean,
        scale=scale,
        weights=w,
        bias=b,
        metadata=meta,
        context=stage,
        hidden=hidden,
    )


def train_probe_cli(
    *,
    data: str,
    out: str,
    model: str | None,
    limit: int | None,
    seed: int,
    cache_root: str,
    l2: float | None,
    blocks: tuple[str, ...] | None,
    layers: int | None = None,
    dtype: str | None = None,
    context: tuple[str, ...] | None = DEFAULT_CONTEXT,
    nq_data: str | None = None,
    nq_limit: int = 0,
    encoding: str = "joint",
    cached_only: bool = False,
    title_mix: Mapping[str, float] | None = None,
    mlp: MLPConfig | None = None,
    nq_weight: float = 1.0,
) -> Probe:
    """Extract (or reuse cached) features, train the probe and write it as JSON.

    ``layers``: train on the first this many layers only (the forward pass then stops there: early exit).
    ``dtype``: the proxy precision to extract features at (train at the precision the probe runs at).
    ``context``: the second stage's features (None: no second stage). ``nq_limit`` NQ train contexts of 10
    documents from ``nq_data`` add their answer sentences as positives (single-hop Wikipedia passages).
    ``cached_only``: extract nothing, and train on the HotpotQA questions whose features are cached already (a
    long extraction may still be running; it writes whole shards atomically). ``title_mix``: the share of
    HotpotQA contexts in each title regime (:func:`rag_opt.training.units.parse_title_mix`; default all
    ``field``); untitled contexts have a feature store of their own. ``mlp``: a first stage with one hidden layer
    (:mod:`rag_opt.training.mlp`; no L2 to choose) instead of a logistic one. ``nq_weight``: how much each NQ
    row counts in the first stage's loss (and in choosing its L2) against a HotpotQA row's 1; the second stage is
    fitted unweighted.
    """
    import math
    import time

    from rag_opt.compressors.features import DEFAULT_BLOCKS
    from rag_opt.models.loader import load_proxy_model

    if not (math.isfinite(nq_weight) and nq_weight > 0):
        raise InvalidInputError(f"the NQ rows' weight must be a positive number, got {nq_weight}")
    if nq_weight != 1.0 and not nq_limit:
        raise InvalidInputError("an NQ rows' weight needs NQ training contexts (nq_limit)")
    proxy = load_proxy_model(model, dtype=dtype)
    depth = layers or proxy.num_layers
    # the shipped probes' blocks, for either encoding (the parallel one reads its own cross-document attention)
    layout = FeatureLayout(blocks or DEFAULT_BLOCKS, depth, proxy.num_heads)
    cross = layout.needs_cross
    examples = read_hotpotqa(data, limit=limit, seed=seed)
    mix = dict(title_mix or {"field": 1.0})
    regime_of = dict(zip((ex.id for ex in examples), assign_title_regimes(len(examples), mix, seed), strict=True))
    # the ``text`` regime reads the same tokens as ``field``: one store holds both
    reads = {i: "none" if r == "none" else "field" for i, r in regime_of.items()}
    stores = {
        titles: feature_store(cache_root, proxy, hotpot_store_name(data, cross=cross, titles=titles), depth, encoding)
        for titles in sorted(set(reads.values()))
    }
    if cached_only:
        cached = {titles: store.ids() for titles, store in stores.items()}
        examples = [ex for ex in examples if ex.id in cached[reads[ex.id]]]
        if not examples:
            raise DataNotFoundError(f"no cached features for {data} under {cache_root} (drop --cached-only)")
        logger.info("training on the %d cached questions", len(examples))
    features: dict[str, AttentionFeatures] = {}
    for titles, store in stores.items():
        mine = [ex for ex in examples if reads[ex.id] == titles]
        if not cached_only:
            extract_hotpot(
                data,
                cache_root,
                model=model,
                dtype=dtype,
                layers=depth,
                cross=cross,
                encoding=encoding,
                titles=titles,
                examples=mine,
            )
        features.update(store.load(ex.id for ex in mine))
    tables: list[UnitTable] = []
    sample_weight: np.ndarray | None = None
    regimes = [regime_of[ex.id] for ex in examples]
    X, y, groups = build_training_set(examples, features, layout, tables=tables, regimes=regimes)
    hotpot_questions = len(np.unique(groups))
    nq_questions = 0
    if nq_limit:
        if nq_data is None:
            raise InvalidInputError("NQ training contexts need the NQ multi-document data (nq_data)")
        from rag_opt.training.nq_contexts import extract_nq, nq_records, random_positions
        from rag_opt.training.nq_sentences import build_nq_training_set

        instances = random_positions(nq_records(nq_data, "train")[:nq_limit], 10, seed=seed)
        nq_store = feature_store(cache_root, proxy, "nq-train-n10" + ("-cross" if cross else ""), depth, encoding)
        extract_nq(
            instances,
            nq_store,
            proxy,
            layers=depth,
            desc="NQ train features, 10 documents",
            cross=cross,
            encoding=encoding,
        )
        Xn, yn, gn = build_nq_training_set(
            instances, nq_store.load(i.id for i in instances), layout, group_offset=int(groups.max()) + 1, tables=tables
        )
        nq_questions = len(np.unique(gn))
        X, y, groups = np.concatenate([X, Xn]), np.concatenate([y, yn]), np.concatenate([groups, gn])
        if nq_weight != 1.0:
            sample_weight = np.concatenate([np.ones(len(y) - len(yn)), np.full(len(yn), nq_weight)])
    t = time.perf_counter()
    losses: dict[float, float] = {}
    if l2 is None and mlp is None:
        l2, losses = choose_l2(X, y, groups, seed=seed, sample_weight=sample_weight)
    trained_on = f"{Path(data).parent.name}/{Path(data).name}: {hotpot_questions} questions"
    if nq_questions:
        trained_on += f" + nq_multidoc train split: {nq_questions} contexts of 10 documents"
    probe = fit_probe(
        X,
        y,
        layout,
        proxy.name,
        l2=l2 or 0.0,
        seed=seed,
        groups=groups,
        context=context,
        tables=tables,
        mlp=mlp,
        sample_weight=sample_weight,
        meta={
            "trained_on": f"{trained_on}; {len(y)} sentences",
            "positives": int(y.sum()),
            "labels": "HotpotQA: supporting facts + sentences containing the answer (yes/no answers mark no "
            "sentence); NQ: sentences of the gold passage containing an answer",
            "seed": seed,
            **(
                {"first_stage": {"kind": "mlp", **mlp.to_dict()}}
                if mlp is not None
                else {"l2": l2, "l2_heldout_logloss": {str(k): v for k, v in losses.items()}}
            ),
            "template": template_for(encoding),
            "encoding": encoding,
            "layers": depth,
            "precision": str(proxy.dtype).removeprefix("torch."),
            "context_stage": list(context or []),
            "title_mix": mix,
            **({"nq_weight": nq_weight} if nq_weight != 1.0 else {}),
        },
    )
    logger.info("probe trained in %.1f s on %d sentences (%d positive)", time.perf_counter() - t, len(y), y.sum())
    probe.save(out)
    return probe
