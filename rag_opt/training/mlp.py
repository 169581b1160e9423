"""Fitting a probe's first stage with one hidden layer: standardisation + a small ensemble of two-layer networks.

A logistic first stage reads each attention head's evidence on its own and adds it up. Relevance in a head is
conditional ("this head points at the sentence *and* the question's words are in it"), which a linear model cannot
express; one hidden layer of a few dozen units can. On 20 % of the shipped probe's training questions held out
(HotpotQA train + NQ, parallel encoding), 3 networks of 64 units lower the log-loss from 0.1738 (logistic at the
chosen L2) to 0.1698 and raise the positives ranked within each question's first 4 sentences from 0.657 to 0.673;
gradient-boosted trees gave 0.1735 / 0.656 (``benchmarks/ablations/probe_capacity.py``). On HotpotQA dev such a
probe keeps more facts, but off its training distribution (SQuAD at a fifth of the tokens, a JSON list of records) it
is worse than the logistic stage when every feature goes through the network. The loss comes from the lexical
features: passed around the network, straight to the logit (:attr:`MLPConfig.linear_blocks`, the lexical block by
default), BM25 and term overlap count the same in any context and SQuAD keeps its answers; the shipped parallel
probe is such a network (docs/research-log.md, "A hidden layer in the first stage" and "The lexical features around
the network").

Each member is trained with AdamW and a one-cycle learning rate (deterministic for a seed on one thread); the
ensemble's average logit is itself one network whose hidden layer concatenates the members' units and whose output
weights are the members' divided by their number (:class:`MLPWeights`), so a probe stores and runs one network.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from rag_opt.compressors.probe import gelu_tanh
from rag_opt.errors import InvalidInputError
from rag_opt.training.logistic import question_folds

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["MLPConfig", "MLPWeights", "cross_val_mlp_scores", "train_mlp"]


@dataclass(frozen=True)
class MLPConfig:
    """How the hidden layer is trained (the defaults are the recipe chosen on held-out training questions,
    ``benchmarks/ablations/probe_capacity.py``, and measured on dev)."""

    hidden: int = 64  # units per member
    members: int = 3  # networks averaged (seeds seed, seed + 1, ...)
    dropout: float = 0.2
    weight_decay: float = 1e-2
    epochs: int = 10
    learning_rate: float = 2e-3  # the one-cycle schedule's peak
    batch_size: int = 512
    # feature blocks passed around the network, straight to the logit (their weights are linear)
    linear_blocks: tuple[str, ...] = ("lexical",)

    def __post_init__(self) -> None:
        if self.hidden < 1 or self.members < 1 or self.epochs < 1 or self.batch_size < 1:
            raise InvalidInputError("hidden units, members, epochs and batch size must be positive")
        if not 0.0 <= self.dropout < 1.0:
            raise InvalidInputError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.weight_decay < 0 or self.learning_rate <= 0:
            raise InvalidInputError("weight decay must be non-negative and the learning rate positive")

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


@dataclass(frozen=True)
class MLPWeights:
    """A fitted first stage: with ``z = (x - mean) / scale``, ``logit = gelu_tanh(z @ hidden_weights.T + hidden_bias)
    @ weights + z @ linear + bias`` (``linear``: None when no feature goes around the network)."""

    mean: np.ndarray  # (d,)
    scale: np.ndarray  # (d,)
    hidden_weights: np.ndarray  # (h, d)
    hidden_bias: np.ndarray  # (h,)
    weights: np.ndarray  # (h,)
    bias: float
    linear: np.ndarray | None = None  # (d,)

    def decision(self, X: np.ndarray) -> np.ndarray:
        z = (X - self.mean) / self.scale
        logit = gelu_tanh(z @ self.hidden_weights.T + self.hidden_bias) @ self.weights + self.bias
        if self.linear is not None:
            logit = logit + z @ self.linear
        return np.asarray(logit, dtype=np.float64)


def train_mlp(
    X: np.ndarray,
    y: np.ndarray,
    config: MLPConfig = MLPConfig(),  # noqa: B008 - frozen, shared safely
    *,
    seed: int = 0,
    sample_weight: np.ndarray | None = None,
    linear_columns: Sequence[int] | np.ndarray = (),
    progress: Callable[[], object] | None = None,
) -> MLPWeights:
    """Fit ``config.members`` networks on (X, y) (standardised with X's mean and spread) and merge them into one.
    ``linear_columns``: the features passed around the network, straight to the logit (the hidden layer does not
    read them). ``progress`` is called after each network."""
    import torch

    if X.ndim != 2 or len(X) != len(y):
        raise InvalidInputError("X must be (n, d) and y (n,)")
    if len(np.unique(y)) < 2:
        raise InvalidInputError("training labels contain a single class")
    if sample_weight is not None and sample_weight.shape != y.shape:
        raise InvalidInputError(f"{sample_weight.shape} sample weights for {y.shape} labels")
    linear = np.unique(np.asarray(linear_columns, dtype=np.int64))
    if linear.size and (linear[0] < 0 or linear[-1] >= X.shape[1]):
        raise InvalidInputError(f"linear feature columns must lie in [0, {X.shape[1]})")
    mean = X.mean(axis=0)
    scale = X.std(axis=0)
    scale[scale < 1e-6] = 1.0
    Z = torch.tensor((X - mean) / scale, dtype=torch.float32)
    target = torch.tensor(y, dtype=torch.float32)
    weight = torch.tensor(
        sample_weight / sample_weight.mean() if sample_weight is not None else np.ones(len(y)), dtype=torch.float32
    )
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, float, np.ndarray]] = []
    for member in range(config.members):
        parts.append(_fit_member(Z, target, weight, config, seed + member, linear))
        if progress is not None:
            progress()
    n = len(parts)
    return MLPWeights(
        mean=mean,
        scale=scale,
        hidden_weights=np.concatenate([p[0] for p in parts]),
        hidden_bias=np.concatenate([p[1] for p in parts]),
        weights=np.concatenate([p[2] for p in parts]) / n,
        bias=float(np.mean([p[3] for p in parts])),
        linear=np.mean([p[4] for p in parts], axis=0) if linear.size else None,
    )


def _fit_member(
    Z: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, config: MLPConfig, seed: int, linear: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, np.ndarray]:
    """One network; the columns ``linear`` skip its hidden layer and reach the logit through weights of their own."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the layers' initial weights and dropout masks
    d = Z.shape[1]
    cols = torch.as_tensor(linear)
    reads = torch.ones(d)
    reads[cols] = 0.0  # what the hidden layer reads
    first = torch.nn.Linear(d, config.hidden)
    last = torch.nn.Linear(config.hidden, 1)
    net = torch.nn.Sequential(first, torch.nn.GELU(approximate="tanh"), torch.nn.Dropout(config.dropout), last)
    around = torch.nn.Linear(len(linear), 1, bias=False) if len(linear) else None
    params = [*net.parameters(), *(around.parameters() if around is not None else ())]
    opt = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    per_epoch = -(-len(Z) // config.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=config.learning_rate, total_steps=config.epochs * per_epoch)
    net.train()
    for _ in range(config.epochs):
        perm = torch.randperm(len(Z), generator=gen)
        for i in range(0, len(Z), config.batch_size):
            idx = perm[i : i + config.batch_size]
            z = Z[idx]
            out = net(z * reads)
            if around is not None:
                out = out + around(z[:, cols])
            logits = out.squeeze(1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target[idx], weight=weight[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    net.eval()
    linear_weights = np.zeros(d)
    if around is not None:
        linear_weights[linear] = around.weight.detach().double().numpy()[0]
    return (
        (first.weight.detach() * reads).double().numpy().copy(),
        first.bias.detach().double().numpy().copy(),
        last.weight.detach().double().numpy()[0].copy(),
        float(last.bias.detach().item()),
        linear_weights,
    )


def cross_val_mlp_scores(
    X: np.ndarray,
    y: np.ndarray,
    groups: np.ndarray,
    config: MLPConfig = MLPConfig(),  # noqa: B008 - frozen, shared safely
    *,
    folds: int = 5,
    seed: int = 0,
    sample_weight: np.ndarray | None = None,
    linear_columns: Sequence[int] | np.ndarray = (),
    progress: Callable[[], object] | None = None,
) -> np.ndarray:
    """Held-out first-stage logits for every row: ``folds`` folds split by question (group), fixed seed (the same
    folds as :func:`rag_opt.training.logistic.cross_val_scores`). ``progress`` is called after each network."""
    out = np.zeros(len(y))
    for held in question_folds(groups, folds=folds, seed=seed):
        sw = sample_weight[~held] if sample_weight is not None else None
        net = train_mlp(
            X[~held], y[~held], config, seed=seed, sample_weight=sw, linear_columns=linear_columns, progress=progress
        )
        out[held] = net.decision(X[held])
    return out
