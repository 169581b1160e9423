"""Fitting a probe's weights: standardisation + L2-regularised logistic regression (deterministic L-BFGS)."""

from __future__ import annotations

import numpy as np

from rag_opt.errors import InvalidInputError

__all__ = ["cross_val_scores", "train_logistic"]


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
    rng = np.random.default_rng(seed)
    qs = rng.permutation(np.unique(groups))
    out = np.zeros(len(y))
    for f in range(folds):
        held = np.isin(groups, qs[f::folds])
        sw = sample_weight[~held] if sample_weight is not None else None
        mean, scale, w, b = train_logistic(X[~held], y[~held], l2=l2, seed=seed, sample_weight=sw)
        out[held] = ((X[held] - mean) / scale) @ w + b
    return out
