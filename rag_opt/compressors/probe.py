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

from rag_opt.compressors.features import FeatureLayout
from rag_opt.errors import DataNotFoundError, ProbeMismatchError

__all__ = ["FORMAT", "Probe", "shipped_probe"]

logger = logging.getLogger(__name__)

FORMAT = "rag-opt-probe/1"


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
                raise ProbeMismatchError(f"probe {name} has shape {arr.shape}, layout needs ({d},)")
            if not np.all(np.isfinite(arr)):
                raise ProbeMismatchError(f"probe {name} contains non-finite values")
        if np.any(self.scale <= 0):
            raise ProbeMismatchError("probe scale must be positive")
        if not math.isfinite(self.bias):
            raise ProbeMismatchError("probe bias is not finite")

    def decision(self, features: np.ndarray) -> np.ndarray:
        if features.ndim != 2 or features.shape[1] != self.layout.size:
            raise ProbeMismatchError(f"features have shape {features.shape}, the probe expects (n, {self.layout.size})")
        return ((features - self.mean) / self.scale) @ self.weights + self.bias

    def predict_proba(self, features: np.ndarray) -> np.ndarray:
        z = np.clip(self.decision(features), -60, 60)
        return 1.0 / (1.0 + np.exp(-z))

    def check_compatible(self, model: str, num_layers: int, num_heads: int) -> None:
        """Refuse a probe of another prompt template, model or head count. A probe may use fewer layers than
        the model has: it reads the first ``layout.num_layers`` (early exit stops the forward pass there)."""
        from rag_opt.models.prompt import TEMPLATE_ID

        template = self.metadata.get("template")
        if template is not None and template != TEMPLATE_ID:
            raise ProbeMismatchError(
                f"probe was trained with prompt template {template!r}, rag-opt now renders {TEMPLATE_ID!r}: "
                "retrain it with `rag-opt train-probe`"
            )
        if self.layout.num_layers > num_layers or self.layout.num_heads != num_heads:
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
            raise ProbeMismatchError(f"invalid {source}: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> Probe:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise DataNotFoundError(f"probe file not found: {p}") from None
        except json.JSONDecodeError as exc:
            raise ProbeMismatchError(f"probe file {p} is not valid JSON: {exc}") from None
        except UnicodeDecodeError:  # e.g. a pickle: probes are JSON text
            raise ProbeMismatchError(f"probe file {p} is not JSON text (not UTF-8): probes are JSON files") from None
        if not isinstance(data, dict):
            raise ProbeMismatchError(f"probe file {p} must hold a JSON object")
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
