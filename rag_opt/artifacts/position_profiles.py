"""Position profiles for position-bias calibration ("found in the middle", Hsieh et al. 2024): the runtime side.

Read by the scorer (document relevance, :mod:`rag_opt.compressors.doc_relevance`) and by the orderers (calibrated
placement, :mod:`rag_opt.orderers.calibrated`), so it sits a floor below both (:mod:`rag_opt.artifacts`).

A :class:`PositionProfile` holds, for one (proxy model, prompt template, number of documents), the attention
share that each document *slot* receives when every slot holds a non-relevant document — per query view,
layer and head. Calibrated attention of a document at slot k is its attention share minus the profile's
share at slot k. Profiles are estimated once from real non-relevant passages (:mod:`rag_opt.training.calibration`)
and cached on disk as small JSON files, so no extra forward pass is needed per query.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rag_opt.errors import ProfileMismatchError
from rag_opt.models.prompt import TEMPLATE_ID, VIEWS

__all__ = ["FORMAT", "PositionProfile", "ProfileStore", "profile_key"]

logger = logging.getLogger(__name__)

FORMAT = "rag-opt-position-profile/1"


@dataclass
class PositionProfile:
    model: str
    template: str
    n_docs: int
    baseline: np.ndarray  # (n_docs, n_views, n_layers, n_heads): mean attention share per slot
    contexts: int  # how many calibration contexts were averaged
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.baseline.ndim != 4 or self.baseline.shape[0] != self.n_docs or self.baseline.shape[1] != len(VIEWS):
            raise ProfileMismatchError(
                f"profile baseline has shape {self.baseline.shape}, expected ({self.n_docs}, {len(VIEWS)}, L, H)"
            )
        if not np.all(np.isfinite(self.baseline)):
            raise ProfileMismatchError("profile baseline contains non-finite values")

    @property
    def key(self) -> str:
        return profile_key(self.model, self.template, self.n_docs)

    def check(self, model: str, n_docs: int, template: str = TEMPLATE_ID) -> None:
        if (self.model, self.template, self.n_docs) != (model, template, n_docs):
            raise ProfileMismatchError(
                f"calibration profile is for model {self.model!r}, template {self.template!r} and {self.n_docs} "
                f"documents; it cannot calibrate model {model!r}, template {template!r} with {n_docs} documents "
                "(run `rag-opt calibrate` for that setting)"
            )

    def calibrate(self, doc_mass: np.ndarray) -> np.ndarray:
        """Attention share minus the slot's baseline; ``doc_mass`` is (n_docs, n_views, L, H) in slot order."""
        if doc_mass.shape != self.baseline.shape:
            raise ProfileMismatchError(
                f"attention of shape {doc_mass.shape} does not match the profile's {self.baseline.shape}"
            )
        return doc_mass - self.baseline

    def slot_attention(self, view: str = "last", layers: Sequence[int] | None = None) -> np.ndarray:
        """Mean attention share per slot (over the chosen layers and all heads): the U-curve."""
        v = VIEWS.index(view)
        b = self.baseline[:, v]
        if layers is not None:
            b = b[:, list(layers)]
        return np.asarray(b.mean(axis=(1, 2)), dtype=np.float64)

    # -- persistence -------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "model": self.model,
            "template": self.template,
            "n_docs": self.n_docs,
            "views": list(VIEWS),
            "shape": list(self.baseline.shape),
            "baseline": [float(f"{x:.6g}") for x in self.baseline.ravel()],  # 6 significant digits: ample
            "contexts": self.contexts,
            "metadata": self.metadata,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "profile") -> PositionProfile:
        try:
            if data.get("format") != FORMAT:
                raise ValueError(f"unsupported format {data.get('format')!r}, expected {FORMAT!r}")
            if list(data["views"]) != list(VIEWS):
                raise ValueError(f"views {data['views']} do not match {list(VIEWS)}")
            shape = tuple(int(x) for x in data["shape"])
            base = np.asarray(data["baseline"], dtype=np.float64)
            if base.size != int(np.prod(shape)):
                raise ValueError(f"baseline has {base.size} values, shape {shape} needs {int(np.prod(shape))}")
            return cls(
                model=str(data["model"]),
                template=str(data["template"]),
                n_docs=int(data["n_docs"]),
                baseline=base.reshape(shape),
                contexts=int(data["contexts"]),
                metadata=dict(data.get("metadata") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileMismatchError(f"invalid {source}: {exc}") from None


def profile_key(model: str, template: str, n_docs: int) -> str:
    return f"{model.replace(':', '-').replace('/', '-')}__{template}__n{n_docs}"


class ProfileStore:
    """Calibration profiles on disk: one JSON per (model, template, n_docs) under ``root``.

    ``get`` looks in ``root`` first (profiles you built with ``rag-opt calibrate``), then — unless
    ``shipped=False`` — among the profiles shipped inside the package (the embedded default model at 10, 20
    and 30 documents).
    """

    def __init__(self, root: str | Path | None = None, *, shipped: bool = True) -> None:
        if root is None:
            from rag_opt.paths import cache_dir

            root = os.environ.get("RAG_OPT_CALIBRATION_DIR") or cache_dir() / "calibration"
        self.root = Path(root)
        self.shipped = shipped
        self._parsed: dict[tuple[str, int], PositionProfile] = {}  # (source, mtime_ns) -> profile

    def path(self, model: str, n_docs: int, template: str = TEMPLATE_ID) -> Path:
        return self.root / f"{profile_key(model, template, n_docs)}.json"

    def get(self, model: str, n_docs: int, template: str = TEMPLATE_ID) -> PositionProfile | None:
        p = self.path(model, n_docs, template)
        if p.is_file():
            key, source = (str(p), p.stat().st_mtime_ns), f"calibration profile {p}"
            read = p.read_text
        else:
            res = _shipped_dir() / p.name
            if not self.shipped or not res.is_file():
                return None
            key, source = (f"shipped:{p.name}", 0), f"shipped calibration profile {p.name}"
            read = res.read_text
        profile = self._parsed.get(key)
        if profile is None:
            try:
                data = json.loads(read())
            except json.JSONDecodeError as exc:
                raise ProfileMismatchError(f"{source} is not valid JSON: {exc}") from None
            profile = PositionProfile.from_dict(data, source=source)
            self._parsed[key] = profile
        profile.check(model, n_docs, template)
        return profile

    def available(self, model: str, template: str = TEMPLATE_ID) -> list[int]:
        """Numbers of documents with a profile for ``model`` (in ``root`` or shipped)."""
        prefix = f"{profile_key(model, template, 0)[:-1]}"
        names = {p.name for p in self.root.glob(f"{prefix}*.json")} if self.root.is_dir() else set()
        if self.shipped:
            names |= {r.name for r in _shipped_dir().iterdir() if r.name.startswith(prefix)}
        out = []
        for name in names:
            tail = name[len(prefix) : -len(".json")]
            if name.endswith(".json") and tail.isdigit():
                out.append(int(tail))
        return sorted(out)

    def put(self, profile: PositionProfile) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        p = self.path(profile.model, profile.n_docs, profile.template)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(profile.to_dict()))
        os.replace(tmp, p)
        return p


def _shipped_dir() -> Any:
    from importlib import resources

    return resources.files("rag_opt") / "profiles"
