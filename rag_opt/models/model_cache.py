"""The converted-model cache (``<rag-opt cache>/models``): what it holds, and removing what newer installs replaced.

Each GGUF proxy model is converted once into a safetensors folder keyed by the contents of its files
(:mod:`rag_opt.models.gguf`), with a copy per precision. A folder of an embedded model whose key is not its
installed files' key was made from another version of those files: *superseded*, and safe to remove. Folders of
other GGUF files (a model given by path) are listed as *other* and never removed here.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rag_opt.models.gguf import content_key
from rag_opt.models.sources import EMBEDDED_MODELS
from rag_opt.paths import cache_dir

__all__ = ["ModelCacheEntry", "model_cache_entries", "remove_superseded"]

State = Literal["current", "superseded", "other"]


@dataclass(frozen=True)
class ModelCacheEntry:
    folder: Path
    bytes: int
    state: State
    model: str | None  # the embedded model it belongs to (None: another GGUF file)


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def _current_keys() -> dict[str, str]:
    """Per installed embedded model, its folder stem and the key of its installed files."""
    out = {}
    for name, model in EMBEDDED_MODELS.items():
        paths = model.locate()
        if paths is not None:
            out[f"embedded-{name}"] = content_key(tuple(paths))
    return out


def model_cache_entries(root: Path | None = None) -> list[ModelCacheEntry]:
    """Every converted folder in the model cache, with its size and state."""
    folder = root if root is not None else cache_dir() / "models"
    if not folder.is_dir():
        return []
    current = _current_keys()
    known_stems = [f"embedded-{name}" for name in EMBEDDED_MODELS]
    out = []
    for entry in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("tmp")):
        stem = next((s for s in known_stems if entry.name.startswith(s + "-")), None)
        state: State = "other"
        if stem is not None:
            key = entry.name[len(stem) + 1 :].split("-", 1)[0]
            state = "current" if current.get(stem) == key else "superseded"
        out.append(ModelCacheEntry(entry, _size(entry), state, stem))
    return out


def remove_superseded(root: Path | None = None) -> list[ModelCacheEntry]:
    """Remove the superseded folders (and their lock files); returns what was removed."""
    removed = []
    for entry in model_cache_entries(root):
        if entry.state == "superseded":
            shutil.rmtree(entry.folder, ignore_errors=True)
            entry.folder.with_suffix(".lock").unlink(missing_ok=True)
            Path(f"{entry.folder}.lock").unlink(missing_ok=True)
            removed.append(entry)
    return removed
