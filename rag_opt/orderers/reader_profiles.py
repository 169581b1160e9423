"""Reader profiles: how much the model that *reads* the context makes of each document slot (the runtime side).

A :class:`ReaderProfile` holds, for one reader (the target LLM) and one number of documents, a weight per slot:

* ``method="attention"``: the reader's own attention share per slot with non-relevant documents in every slot
  (a local model, measured like the proxy's position profile);
* ``method="accuracy"``: the reader's accuracy with the relevant document at that slot, on a small calibration
  set (a reader reachable only as an API).

``ordering="calibrated"`` places documents by the reader's profile when one exists for the request's reader
(AttnRank's idea: calibrate on the model that reads, not on the proxy), and by the proxy's profile otherwise.
Profiles are measured by ``rag-opt calibrate --reader`` (:mod:`rag_opt.training.reader_calibration`) and kept as
small JSON files next to the proxy's profiles.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from rag_opt.errors import ProfileMismatchError

__all__ = ["READER_FORMAT", "ReaderProfile", "ReaderProfileStore", "reader_key"]

READER_FORMAT = "rag-opt-reader-profile/1"
ReaderMethod = Literal["attention", "accuracy"]


def reader_key(reader: str) -> str:
    """The name a reader's profiles are kept under: stripped, without a ``hf:`` prefix (a target written
    ``hf:Qwen/Qwen2.5-7B-Instruct`` finds the profile of ``Qwen/Qwen2.5-7B-Instruct``)."""
    name = reader.strip()
    return name[3:].strip() if name.startswith("hf:") else name


@dataclass
class ReaderProfile:
    """One reader's weight per document slot (higher: the reader makes more of a document there)."""

    reader: str
    n_docs: int
    method: ReaderMethod
    slot_weight: np.ndarray  # (n_docs,)
    contexts: int  # calibration contexts (attention) or questions per measured slot (accuracy)
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.slot_weight = np.asarray(self.slot_weight, dtype=np.float64)
        if self.method not in ("attention", "accuracy"):
            raise ProfileMismatchError(f"reader profile method must be 'attention' or 'accuracy', got {self.method!r}")
        if self.n_docs < 1 or self.slot_weight.shape != (self.n_docs,):
            raise ProfileMismatchError(
                f"reader profile has {self.slot_weight.shape} slot weights for {self.n_docs} documents"
            )
        if not np.all(np.isfinite(self.slot_weight)):
            raise ProfileMismatchError("reader profile slot weights contain non-finite values")

    def describe(self) -> str:
        """How the profile was measured, in a few words (for results and logs)."""
        unit = "contexts" if self.method == "attention" else "questions per slot"
        return f"reader profile of {self.reader} ({self.method}, {self.n_docs} documents, {self.contexts} {unit})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": READER_FORMAT,
            "reader": self.reader,
            "n_docs": self.n_docs,
            "method": self.method,
            "slot_weight": [float(f"{x:.6g}") for x in self.slot_weight],
            "contexts": self.contexts,
            "metadata": self.metadata,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "reader profile") -> ReaderProfile:
        try:
            if data.get("format") != READER_FORMAT:
                raise ValueError(f"unsupported format {data.get('format')!r}, expected {READER_FORMAT!r}")
            return cls(
                reader=str(data["reader"]),
                n_docs=int(data["n_docs"]),
                method=data["method"],
                slot_weight=np.asarray(data["slot_weight"], dtype=np.float64),
                contexts=int(data["contexts"]),
                metadata=dict(data.get("metadata") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileMismatchError(f"invalid {source}: {exc}") from None


class ReaderProfileStore:
    """Reader profiles on disk: one JSON per (reader, number of documents) under ``root`` (default: the proxy
    profiles' folder, ``$RAG_OPT_CALIBRATION_DIR`` or ``<rag-opt cache>/calibration``). None are shipped: a
    reader profile is measured on the reader you use."""

    def __init__(self, root: str | Path | None = None) -> None:
        if root is None:
            from rag_opt.paths import cache_dir

            root = os.environ.get("RAG_OPT_CALIBRATION_DIR") or cache_dir() / "calibration"
        self.root = Path(root)
        self._parsed: dict[tuple[str, int], ReaderProfile] = {}  # (path, mtime_ns) -> profile

    def path(self, reader: str, n_docs: int) -> Path:
        safe = reader_key(reader).replace(":", "-").replace("/", "-")
        return self.root / f"reader__{safe}__n{n_docs}.json"

    def get(self, reader: str, n_docs: int) -> ReaderProfile | None:
        p = self.path(reader, n_docs)
        if not p.is_file():
            return None
        key = (str(p), p.stat().st_mtime_ns)
        profile = self._parsed.get(key)
        if profile is None:
            try:
                data = json.loads(p.read_text())
            except json.JSONDecodeError as exc:
                raise ProfileMismatchError(f"reader profile {p} is not valid JSON: {exc}") from None
            profile = ReaderProfile.from_dict(data, source=f"reader profile {p}")
            if reader_key(profile.reader) != reader_key(reader) or profile.n_docs != n_docs:
                raise ProfileMismatchError(
                    f"reader profile {p} is for {profile.reader!r} with {profile.n_docs} documents, not "
                    f"{reader!r} with {n_docs}"
                )
            self._parsed[key] = profile
        return profile

    def available(self, reader: str) -> list[int]:
        """Numbers of documents with a profile for ``reader``."""
        prefix = self.path(reader, 0).name[: -len("0.json")]
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.glob(f"{prefix}*.json"):
            tail = p.name[len(prefix) : -len(".json")]
            if tail.isdigit():
                out.append(int(tail))
        return sorted(out)

    def put(self, profile: ReaderProfile) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        p = self.path(profile.reader, profile.n_docs)
        tmp = p.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(profile.to_dict()))
        os.replace(tmp, p)
        return p
