"""Fitting a probe's weights: standardisation + L2-regularised logistic regression (deterministic L-BFGS)."""

from __future__ import annotations

import logging

import numpy as np

from rag_opt.errors import InvalidInputError

__all__ = ["L2_GRID", "choose_l2", "cross_val_scores", "question_folds", "train_logistic"]

logger = logging.getLogger(__name__)

L2_GRID = (1e-3, 1e-2, 1e-1, 3e-1)


def train_logistic(
    X: np.ndarray,
    y: np.ndarray,
    *,
    l2: float = 1e-3,
    max_iter: int = 300,
    seed: int = 0,
    sample_weight: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Fit standardisation + L2-regularised logistic regression (full-batch L-BFGS, deterministic).

    Returns (mean, scale, weights, bias).
    """
    import torch

    if X.ndim != 2 or len(X) != len(y):
        raise InvalidInputError("X must be (n, d) and y (n,)")
    if len(np.unique(y)) < 2:
        raise InvalidInputError("training labels contain a single class")
    torch.manual_seed(seed)
    mean = X.mean(axis=0)
    scale = X.std(axis=0)
    scale[scale < 1e-6] = 1.0
    Xt = torch.tensor((X - mean) / scale, dtype=torch.float64)
    yt = torch.tensor(y, dtype=torch.float64)
    wt = torch.tensor(sample_weight if sample_weight is not None else np.ones(len(y)), dtype=torch.float64)
    w = torch.zeros(X.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe")
    loss_fn = torch.nn.BCEWithLogitsLoss(weight=wt / wt.mean())

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_fn(Xt @ w + b, yt) + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return mean, scale, w.detach().numpy().copy(), float(b.detach().item())


def cross_val_scores(
    X: np.ndarray,
    y: np.ndarray,
    groups: np.ndarray,
    *,
    l2: float,
    folds: int = 5,
    seed: int = 0,
    sample_weight: np.ndarray | None = None,
) -> np.ndarray:
    """Held-out probe logits for every row: ``folds`` folds split by question (group), fixed seed; each fold's
    probe fitted with the rows' ``sample_weight`` (None: all count alike)."""
    out = np.zeros(len(y))
    for held in question_folds(groups, folds=folds, seed=seed):
        sw = sample_weight[~held] if sample_weight is not None else None
        mean, scale, w, b = train_logistic(X[~held], y[~held], l2=l2, seed=seed, sample_weight=sw)
        out[held] = ((X[held] - mean) / scale) @ w + b
    return out


def question_folds(groups: np.ndarray, *, folds: int = 5, seed: int = 0) -> list[np.ndarray]:
    """Per fold, the rows held out: the questions (``groups``) shuffled with a fixed seed and dealt round-robin into
    ``folds`` folds, so a question's rows are never on both sides."""
    qs = np.random.default_rng(seed).permutation(np.unique(groups))
    return [np.isin(groups, qs[f::folds]) for f in range(folds)]


def choose_l2(
    X: np.ndarray,
    y: np.ndarray,
    groups: np.ndarray,
    *,
    grid: tuple[float, ...] = L2_GRID,
    seed: int = 0,
    sample_weight: np.ndarray | None = None,
) -> tuple[float, dict[float, float]]:
    """Pick the L2 strength with the lowest log-loss on 20 % of the questions held out (split by question); with
    ``sample_weight``, fitted and scored with the rows' weights."""
    rng = np.random.default_rng(seed)
    qs = np.unique(groups)
    held = set(rng.choice(qs, size=max(1, len(qs) // 5), replace=False).tolist())
    mask = np.array([g in held for g in groups])
    if y[~mask].min() == y[~mask].max() or y[mask].min() == y[mask].max():
        return grid[0], {}
    losses: dict[float, float] = {}
    weight = np.ones(len(y)) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
    for l2 in grid:
        mean, scale, w, b = train_logistic(X[~mask], y[~mask], l2=l2, seed=seed, sample_weight=weight[~mask])
        z = np.clip(((X[mask] - mean) / scale) @ w + b, -30, 30)
        p = 1 / (1 + np.exp(-z))
        loss = -(y[mask] * np.log(p + 1e-12) + (1 - y[mask]) * np.log(1 - p + 1e-12))
        losses[l2] = float(np.average(loss, weights=weight[mask]))
    best = min(losses, key=lambda k: losses[k])
    logger.info("held-out log-loss by l2: %s -> %s", losses, best)
    return best, losses
