"""The sentence-relevance probe: standardisation + logistic regression (or one hidden layer) over per-unit features.

Stored as plain JSON arrays with metadata (model, feature layout, training data) — never pickle. A probe is
validated on load and refused when its layout does not match the loaded proxy model.

A sentence probe may have a second stage (:class:`ContextStage`): a small logistic regression over each unit's
first-stage logit read together with its neighbours' and the other documents'
(:mod:`rag_opt.compressors.context_features`), for multi-hop evidence. Such probes are written as format
``rag-opt-probe/2`` so that an older rag-opt refuses them instead of ignoring the second stage.

A first stage may have one hidden layer (:class:`HiddenLayer`, GELU in its tanh form: a small network instead of a
linear model, :mod:`rag_opt.training.mlp`); such probes are written as format ``rag-opt-probe/3`` (with or without a
second stage), for the same reason. A hidden layer may also pass some features straight to the logit, around the
network (:attr:`HiddenLayer.linear`: the lexical block's, by default, so that BM25 and term overlap count the same in
any context, as in a logistic probe); such probes are written as ``rag-opt-probe/4``.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rag_opt.artifacts.shipped_probes import shipped_probe_data, shipped_probe_name
from rag_opt.compressors.features import FeatureLayout
from rag_opt.errors import DataNotFoundError, ProbeMismatchError

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.text.units import UnitTable

__all__ = [
    "FORMAT",
    "FORMAT_CONTEXT",
    "FORMAT_HIDDEN",
    "FORMAT_HIDDEN_LINEAR",
    "ContextStage",
    "HiddenLayer",
    "Probe",
    "gelu_tanh",
    "shipped_probe",
    "sigmoid",
]

logger = logging.getLogger(__name__)

FORMAT = "rag-opt-probe/1"
FORMAT_CONTEXT = "rag-opt-probe/2"  # a probe with a second (context) stage
FORMAT_HIDDEN = "rag-opt-probe/3"  # a probe whose first stage has a hidden layer (a second stage optional)
FORMAT_HIDDEN_LINEAR = "rag-opt-probe/4"  # a hidden layer with features passed around it linearly
ACTIVATIONS = ("gelu_tanh",)


def _checked(name: str, values: Any, size: int) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.shape != (size,):
        raise ProbeMismatchError(f"probe {name} has shape {arr.shape}, expected ({size},)")
    if not np.all(np.isfinite(arr)):
        raise ProbeMismatchError(f"probe {name} contains non-finite values")
    return arr


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU in its tanh form (``torch.nn.GELU(approximate="tanh")``): a hidden layer's activation."""
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x**3)))


def _compact(x: float) -> float:
    """``x`` to 7 significant digits (float32's precision): a hidden layer's many weights, written compactly."""
    return float(f"{x:.7g}")


@dataclass
class HiddenLayer:
    """A first stage's hidden layer: ``gelu_tanh(standardised features @ weights.T + bias)``, then the probe's
    output weights (one per hidden unit); with ``linear``, ``standardised features @ linear`` is added to the logit
    (the features that go around the network: their columns of ``weights`` are zero)."""

    weights: np.ndarray  # (units, features)
    bias: np.ndarray  # (units,)
    activation: str = "gelu_tanh"
    linear: np.ndarray | None = None  # (features,)

    def __post_init__(self) -> None:
        self.weights = np.asarray(self.weights, dtype=np.float64)
        if self.weights.ndim != 2 or not self.weights.size:
            raise ProbeMismatchError(
                f"probe hidden weights have shape {self.weights.shape}, expected (units, features)"
            )
        self.bias = _checked("hidden bias", self.bias, self.weights.shape[0])
        if not np.all(np.isfinite(self.weights)):
            raise ProbeMismatchError("probe hidden weights contain non-finite values")
        if self.activation not in ACTIVATIONS:
            raise ProbeMismatchError(f"probe hidden activation {self.activation!r} is not one of {list(ACTIVATIONS)}")
        if self.linear is not None:
            self.linear = _checked("hidden linear weights", self.linear, self.weights.shape[1])

    @property
    def units(self) -> int:
        return int(self.weights.shape[0])

    def __call__(self, standardised: np.ndarray) -> np.ndarray:
        if standardised.shape[-1] != self.weights.shape[1]:
            raise ProbeMismatchError(
                f"{standardised.shape[-1]} features for a hidden layer of {self.weights.shape[1]} inputs"
            )
        return gelu_tanh(standardised @ self.weights.T + self.bias)

    def linear_logit(self, standardised: np.ndarray) -> np.ndarray | float:
        """What the features passed around the network add to the logit (0.0 without any)."""
        return standardised @ self.linear if self.linear is not None else 0.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "activation": self.activation,
            "weights": [[_compact(x) for x in row] for row in self.weights.tolist()],
            "bias": [_compact(x) for x in self.bias.tolist()],
        }
        if self.linear is not None:
            out["linear"] = [_compact(x) for x in self.linear.tolist()]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HiddenLayer:
        return cls(
            weights=np.asarray(data["weights"], dtype=np.float64),
            bias=np.asarray(data["bias"], dtype=np.float64),
            activation=str(data["activation"]),
            linear=np.asarray(data["linear"], dtype=np.float64) if "linear" in data else None,
        )


@dataclass
class ContextStage:
    """The second stage: logistic regression over :func:`~rag_opt.compressors.context_features.context_features`
    of the first stage's logits."""

    names: tuple[str, ...]
    mean: np.ndarray
    scale: np.ndarray
    weights: np.ndarray
    bias: float

    def __post_init__(self) -> None:
        from rag_opt.compressors.context_features import CONTEXT_FEATURES

        unknown = [n for n in self.names if n not in CONTEXT_FEATURES]
        if not self.names or unknown:
            raise ProbeMismatchError(f"probe context stage has unknown or no features {unknown or []}")
        for name in ("mean", "scale", "weights"):
            setattr(self, name, _checked(f"context {name}", getattr(self, name), len(self.names)))
        if np.any(self.scale <= 0) or not math.isfinite(self.bias):
            raise ProbeMismatchError("probe context stage has a non-positive scale or a non-finite bias")

    def decision(self, logits: np.ndarray, units: UnitTable) -> np.ndarray:
        from rag_opt.compressors.context_features import context_features

        return ((context_features(logits, units, self.names) - self.mean) / self.scale) @ self.weights + self.bias

    def to_dict(self) -> dict[str, Any]:
        return {
            "features": list(self.names),
            "bias": float(self.bias),
            "weights": [float(x) for x in self.weights],
            "mean": [float(x) for x in self.mean],
            "scale": [float(x) for x in self.scale],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ContextStage:
        return cls(
            names=tuple(str(x) for x in data["features"]),
            mean=np.asarray(data["mean"], dtype=np.float64),
            scale=np.asarray(data["scale"], dtype=np.float64),
            weights=np.asarray(data["weights"], dtype=np.float64),
            bias=float(data["bias"]),
        )


@dataclass
class Probe:
    model: str
    layout: FeatureLayout
    mean: np.ndarray
    scale: np.ndarray
    weights: np.ndarray
    bias: float
    metadata: dict[str, Any] = field(default_factory=dict)
    context: ContextStage | None = None
    hidden: HiddenLayer | None = None  # with one: ``weights`` are the output weights, one per hidden unit

    def __post_init__(self) -> None:
        d = self.layout.size
        if self.hidden is not None and self.hidden.weights.shape[1] != d:
            raise ProbeMismatchError(
                f"probe hidden layer reads {self.hidden.weights.shape[1]} features, layout has {d}"
            )
        sizes = {"mean": d, "scale": d, "weights": self.hidden.units if self.hidden is not None else d}
        for name, size in sizes.items():
            arr = getattr(self, name)
            if arr.shape != (size,):
                what = "the hidden layer needs" if self.hidden is not None and name == "weights" else "layout needs"
                raise ProbeMismatchError(f"probe {name} has shape {arr.shape}, {what} ({size},)")
            if not np.all(np.isfinite(arr)):
                raise ProbeMismatchError(f"probe {name} contains non-finite values")
        if np.any(self.scale <= 0):
            raise ProbeMismatchError("probe scale must be positive")
        if not math.isfinite(self.bias):
            raise ProbeMismatchError("probe bias is not finite")

    def decision(self, features: np.ndarray) -> np.ndarray:
        if features.ndim != 2 or features.shape[1] != self.layout.size:
            raise ProbeMismatchError(f"features have shape {features.shape}, the probe expects (n, {self.layout.size})")
        z = (features - self.mean) / self.scale
        if self.hidden is not None:
            return self.hidden(z) @ self.weights + self.hidden.linear_logit(z) + self.bias
        return z @ self.weights + self.bias

    def predict_proba(self, features: np.ndarray) -> np.ndarray:
        """The first stage's probabilities (a probe without a context stage: its scores)."""
        return sigmoid(self.decision(features))

    def unit_logits(self, features: np.ndarray, units: UnitTable) -> np.ndarray:
        """Relevance logit per unit of ``units`` from its feature matrix: the first stage, then the context stage
        if the probe has one."""
        z = self.decision(features)
        return self.context.decision(z, units) if self.context is not None else z

    def unit_scores(self, features: np.ndarray, units: UnitTable) -> np.ndarray:
        """:meth:`unit_logits` as probabilities."""
        return sigmoid(self.unit_logits(features, units))

    def check_compatible(self, model: str, num_layers: int, num_heads: int, template: str | None = None) -> None:
        """Refuse a probe of another prompt template (``template``: the one the scorer reads with; default the
        joint encoding's), model or head count. A probe may use fewer layers than the model has: it reads the
        first ``layout.num_layers`` (early exit stops the forward pass there)."""
        from rag_opt.models.prompt import PARALLEL_TEMPLATE_ID, TEMPLATE_ID

        expected = template or TEMPLATE_ID
        made_with = self.metadata.get("template")
        if made_with is not None and made_with != expected:
            encodings = {TEMPLATE_ID: "joint", PARALLEL_TEMPLATE_ID: "parallel"}
            hint = (
                f" (the {encodings[made_with]} encoding's: use encoding={encodings[made_with]!r})"
                if made_with in encodings
                else ""
            )
            raise ProbeMismatchError(
                f"probe was trained with prompt template {made_with!r}{hint}, this scorer reads with {expected!r}: "
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
        out = {
            "format": self._format(),
            "model": self.model,
            "layout": self.layout.to_dict(),
            "bias": float(self.bias),
            "weights": [float(x) for x in self.weights],
            "mean": [float(x) for x in self.mean],
            "scale": [float(x) for x in self.scale],
            "metadata": self.metadata,
        }
        if self.context is not None:
            out["context"] = self.context.to_dict()
        if self.hidden is not None:
            out["hidden"] = self.hidden.to_dict()
        return out

    def _format(self) -> str:
        if self.hidden is not None:
            return FORMAT_HIDDEN_LINEAR if self.hidden.linear is not None else FORMAT_HIDDEN
        return FORMAT if self.context is None else FORMAT_CONTEXT

    def save(self, path: str | Path) -> None:
        # a hidden layer's tens of thousands of weights, one per line, would more than double the file
        Path(path).write_text(json.dumps(self.to_dict(), indent=1 if self.hidden is None else None))

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "probe") -> Probe:
        try:
            fmt = data.get("format")
            formats = (FORMAT, FORMAT_CONTEXT, FORMAT_HIDDEN, FORMAT_HIDDEN_LINEAR)
            if fmt not in formats:
                raise ValueError(f"unsupported format {fmt!r}, expected one of {list(formats)}")
            hidden_formats = (FORMAT_HIDDEN, FORMAT_HIDDEN_LINEAR)
            if fmt not in hidden_formats and (fmt == FORMAT_CONTEXT) != ("context" in data):
                raise ValueError(
                    f"format {fmt!r} {'needs' if fmt == FORMAT_CONTEXT else 'cannot carry'} a context stage"
                )
            if (fmt in hidden_formats) != ("hidden" in data):
                need = "needs" if fmt in hidden_formats else "cannot carry"
                raise ValueError(f"format {fmt!r} {need} a hidden layer")
            linear = isinstance(data.get("hidden"), dict) and "linear" in data["hidden"]
            if "hidden" in data and (fmt == FORMAT_HIDDEN_LINEAR) != linear:
                raise ValueError(
                    f"format {fmt!r} {'needs' if fmt == FORMAT_HIDDEN_LINEAR else 'cannot carry'} linear weights "
                    "around its hidden layer"
                )
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
                context=ContextStage.from_dict(data["context"]) if "context" in data else None,
                hidden=HiddenLayer.from_dict(data["hidden"]) if "hidden" in data else None,
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


def sigmoid(z: np.ndarray) -> np.ndarray:
    """Logits to probabilities (clipped: no overflow)."""
    return 1.0 / (1.0 + np.exp(-np.clip(z, -60, 60)))


def shipped_probe(model: str, level: str = "unit", encoding: str = "joint") -> Probe | None:
    """The probe shipped inside the package for ``model`` (e.g. ``embedded:smollm2-135m``) and ``encoding``, if any.

    ``level="unit"``: the sentence-relevance probe; ``level="document"``: the document relevance probe. Probes of
    the parallel encoding are named ``<model>.parallel.json`` / ``<model>.parallel.doc.json``.
    """
    data = shipped_probe_data(model, level, encoding)
    if data is None:
        return None
    return Probe.from_dict(data, source=f"shipped probe {shipped_probe_name(model, level, encoding)}")
