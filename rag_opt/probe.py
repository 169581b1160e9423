"""The sentence-relevance probe: standardisation + logistic regression over per-unit features.

Stored as plain JSON arrays with metadata (model, feature layout, training data) — never pickle. A probe is
validated on load and refused when its layout does not match the loaded proxy model.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from rag_opt.features import FeatureLayout

logger = logging.getLogger(__name__)

FORMAT = "rag-opt-probe/1"


class ProbeMismatchError(ValueError):
    """A probe was trained for another model or feature layout than the one in use."""


@dataclass
class Probe:
    model: str
    layout: FeatureLayout
    mean: np.ndarray
    scale: np.ndarray
    weights: np.ndarray
    bias: float
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        d = self.layout.size
        for name in ("mean", "scale", "weights"):
            arr = getattr(self, name)
            if arr.shape != (d,):
                raise ValueError(f"probe {name} has shape {arr.shape}, layout needs ({d},)")
            if not np.all(np.isfinite(arr)):
                raise ValueError(f"probe {name} contains non-finite values")
        if np.any(self.scale <= 0):
            raise ValueError("probe scale must be positive")
        if not math.isfinite(self.bias):
            raise ValueError("probe bias is not finite")

    def decision(self, features: np.ndarray) -> np.ndarray:
        if features.ndim != 2 or features.shape[1] != self.layout.size:
            raise ProbeMismatchError(f"features have shape {features.shape}, the probe expects (n, {self.layout.size})")
        return ((features - self.mean) / self.scale) @ self.weights + self.bias

    def predict_proba(self, features: np.ndarray) -> np.ndarray:
        z = np.clip(self.decision(features), -60, 60)
        return 1.0 / (1.0 + np.exp(-z))

    def check_compatible(self, model: str, num_layers: int, num_heads: int) -> None:
        from rag_opt.attention import TEMPLATE_ID

        template = self.metadata.get("template")
        if template is not None and template != TEMPLATE_ID:
            raise ProbeMismatchError(
                f"probe was trained with prompt template {template!r}, rag-opt now renders {TEMPLATE_ID!r}: "
                "retrain it with `rag-opt train-probe`"
            )
        if (self.layout.num_layers, self.layout.num_heads) != (num_layers, num_heads):
            raise ProbeMismatchError(
                f"probe for {self.model!r} expects {self.layout.num_layers} layers × {self.layout.num_heads} "
                f"heads, but proxy model {model!r} has {num_layers} × {num_heads}: train a probe for this "
                "model with `rag-opt train-probe --model ...`"
            )
        if self.model != model:
            raise ProbeMismatchError(
                f"probe was trained for proxy model {self.model!r}, not {model!r}: attention heads of "
                "different models do not correspond; train a probe for this model with `rag-opt train-probe`"
            )

    # -- persistence -------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "model": self.model,
            "layout": self.layout.to_dict(),
            "bias": float(self.bias),
            "weights": [float(x) for x in self.weights],
            "mean": [float(x) for x in self.mean],
            "scale": [float(x) for x in self.scale],
            "metadata": self.metadata,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "probe") -> Probe:
        try:
            if data.get("format") != FORMAT:
                raise ValueError(f"unsupported format {data.get('format')!r}, expected {FORMAT!r}")
            lay = data["layout"]
            layout = FeatureLayout(
                tuple(lay["blocks"]), int(lay["num_layers"]), int(lay["num_heads"]), str(lay.get("level", "unit"))
            )
            return cls(
                model=str(data["model"]),
                layout=layout,
                mean=np.asarray(data["mean"], dtype=np.float64),
                scale=np.asarray(data["scale"], dtype=np.float64),
                weights=np.asarray(data["weights"], dtype=np.float64),
                bias=float(data["bias"]),
                metadata=dict(data.get("metadata") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"invalid {source}: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> Probe:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"probe file not found: {p}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"probe file {p} is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"probe file {p} must hold a JSON object")
        return cls.from_dict(data, source=f"probe file {p}")


def shipped_probe(model: str, level: str = "unit") -> Probe | None:
    """The probe shipped inside the package for ``model`` (e.g. ``embedded:smollm2-135m``), if any.

    ``level="unit"``: the sentence-relevance probe; ``level="document"``: the document relevance probe.
    """
    suffix = {"unit": ".json", "document": ".doc.json"}[level]
    name = model.replace(":", "-").replace("/", "-") + suffix
    res = resources.files("rag_opt") / "probes" / name
    if not res.is_file():
        return None
    return Probe.from_dict(json.loads(res.read_text()), source=f"shipped probe {name}")


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
        raise ValueError("X must be (n, d) and y (n,)")
    if len(np.unique(y)) < 2:
        raise ValueError("training labels contain a single class")
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
