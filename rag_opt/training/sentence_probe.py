"""Training the sentence-relevance probe on HotpotQA (``rag-opt train-probe``).

Examples: every HotpotQA question of the training file (shuffled with a fixed seed; ``limit`` takes a prefix).
Each paragraph is rendered as its title line followed by its sentences, exactly as the optimizer renders a
document with a title. Labels: a sentence is positive when it is a supporting fact or contains the answer
string (SQuAD-normalised; yes/no answers never mark sentences). Title units are not training examples (titles
are kept with their document). Questions whose answer is yes/no still contribute their supporting facts.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from rag_opt.compressors.features import FeatureLayout
from rag_opt.compressors.probe import Probe
from rag_opt.errors import InvalidInputError
from rag_opt.models.extract import AttentionFeatures
from rag_opt.models.prompt import TEMPLATE_ID
from rag_opt.training.datasets import HotpotExample, read_hotpotqa
from rag_opt.training.feature_cache import FeatureCache, fill_cache
from rag_opt.training.logistic import train_logistic
from rag_opt.training.units import hotpot_units

__all__ = [
    "build_training_set",
    "choose_l2",
    "extract_hotpot",
    "feature_cache_for",
    "fit_probe",
    "train_probe_cli",
    "unit_labels",
]

logger = logging.getLogger(__name__)


def feature_cache_for(root: str | Path, model_name: str, dataset: str) -> FeatureCache:
    """The cache of one (model, prompt template, dataset): features of another template never mix in."""
    safe = model_name.replace(":", "-").replace("/", "-")
    return FeatureCache(Path(root) / safe / TEMPLATE_ID / dataset)


def extract_hotpot(
    path: str | Path,
    cache_root: str | Path,
    *,
    model: str | None = None,
    limit: int | None = None,
    seed: int = 0,
    max_tokens: int = 2048,
    progress: bool = True,
) -> FeatureCache:
    """Compute (or reuse) attention features for HotpotQA examples and return their cache."""
    from rag_opt.models.extract import extract
    from rag_opt.models.loader import load_proxy_model

    proxy = load_proxy_model(model)
    examples = read_hotpotqa(path, limit=limit, seed=seed)
    cache = feature_cache_for(cache_root, proxy.name, Path(path).name.split(".")[0])
    fill_cache(
        cache,
        [(ex.id, hotpot_units(ex), ex.question) for ex in examples],
        lambda docs, q: extract(proxy, docs, q, max_tokens=max_tokens),
        progress=progress,
        desc=f"features {Path(path).name}",
    )
    return cache


def unit_labels(ex: HotpotExample) -> list[list[bool]]:
    """Per paragraph, per sentence: supporting fact or contains the (non yes/no) answer."""
    from rag_opt.training.datasets import contains_answer

    labels = []
    for p, sents in enumerate(ex.sentences):
        labels.append(
            [(p, k) in ex.supporting or (not ex.yes_no and contains_answer(s, ex.answer)) for k, s in enumerate(sents)]
        )
    return labels


def build_training_set(
    examples: list[HotpotExample],
    features: dict[str, AttentionFeatures],
    layout: FeatureLayout,
    *,
    progress: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(X, y, group) over the sentence units of every example with cached features."""
    from tqdm.auto import tqdm

    from rag_opt.compressors.features import build_features
    from rag_opt.text.units import UnitTable

    xs, ys, gs = [], [], []
    for g, ex in enumerate(tqdm(examples, desc="probe features", disable=not progress, mininterval=5.0)):
        attn = features.get(ex.id)
        if attn is None:
            continue
        docs = hotpot_units(ex)
        units = UnitTable.titled(docs)
        X = build_features(layout, attn, ex.question, units)
        cand = units.candidate
        labels = np.concatenate([[False, *lab] for lab in unit_labels(ex)])
        xs.append(X[cand])
        ys.append(labels[cand])
        gs.append(np.full(int(cand.sum()), g))
    if not xs:
        raise InvalidInputError("no cached features for any training example")
    return np.concatenate(xs), np.concatenate(ys).astype(np.float64), np.concatenate(gs)


L2_GRID = (1e-3, 1e-2, 1e-1, 3e-1)


def choose_l2(
    X: np.ndarray, y: np.ndarray, groups: np.ndarray, *, grid: tuple[float, ...] = L2_GRID, seed: int = 0
) -> tuple[float, dict[float, float]]:
    """Pick the L2 strength with the lowest log-loss on 20 % of the questions held out (split by question)."""
    rng = np.random.default_rng(seed)
    qs = np.unique(groups)
    held = set(rng.choice(qs, size=max(1, len(qs) // 5), replace=False).tolist())
    mask = np.array([g in held for g in groups])
    if y[~mask].min() == y[~mask].max() or y[mask].min() == y[mask].max():
        return grid[0], {}
    losses: dict[float, float] = {}
    for l2 in grid:
        mean, scale, w, b = train_logistic(X[~mask], y[~mask], l2=l2, seed=seed)
        z = np.clip(((X[mask] - mean) / scale) @ w + b, -30, 30)
        p = 1 / (1 + np.exp(-z))
        losses[l2] = float(-np.mean(y[mask] * np.log(p + 1e-12) + (1 - y[mask]) * np.log(1 - p + 1e-12)))
    best = min(losses, key=lambda k: losses[k])
    logger.info("held-out log-loss by l2: %s -> %s", losses, best)
    return best, losses


def fit_probe(
    X: np.ndarray,
    y: np.ndarray,
    layout: FeatureLayout,
    model_name: str,
    *,
    l2: float,
    seed: int,
    meta: dict[str, Any],
) -> Probe:
    mean, scale, w, b = train_logistic(X, y, l2=l2, seed=seed)
    return Probe(model=model_name, layout=layout, mean=mean, scale=scale, weights=w, bias=b, metadata=meta)


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
) -> Probe:
    """Extract (or reuse cached) features, train the probe and write it as JSON.

    ``layers``: train on the first this many layers only (the forward pass then stops there: early exit).
    """
    import time

    from rag_opt.compressors.features import DEFAULT_BLOCKS
    from rag_opt.models.loader import load_proxy_model

    proxy = load_proxy_model(model)
    cache = extract_hotpot(data, cache_root, model=model, limit=limit, seed=seed)
    examples = read_hotpotqa(data, limit=limit, seed=seed)
    layout = FeatureLayout(blocks or DEFAULT_BLOCKS, layers or proxy.num_layers, proxy.num_heads)
    feats = cache.load(ex.id for ex in examples)
    X, y, groups = build_training_set(examples, feats, layout)
    t = time.perf_counter()
    losses: dict[float, float] = {}
    if l2 is None:
        l2, losses = choose_l2(X, y, groups, seed=seed)
    probe = fit_probe(
        X,
        y,
        layout,
        proxy.name,
        l2=l2,
        seed=seed,
        meta={
            "trained_on": f"{Path(data).parent.name}/{Path(data).name}: {len(np.unique(groups))} questions, "
            f"{len(y)} sentences",
            "positives": int(y.sum()),
            "labels": "supporting facts + sentences containing the answer (yes/no answers mark no sentence)",
            "seed": seed,
            "l2": l2,
            "l2_heldout_logloss": {str(k): v for k, v in losses.items()},
            "template": TEMPLATE_ID,
        },
    )
    logger.info("probe trained in %.1f s on %d sentences (%d positive)", time.perf_counter() - t, len(y), y.sum())
    probe.save(out)
    return probe
