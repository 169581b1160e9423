"""rag-opt: optimize the context between your retriever and your LLM.

Sentence-level compression read from a small proxy model's attention (with a trained probe), document
reordering against "lost in the middle", and position-bias calibration. Heavy dependencies (torch,
transformers) are imported only when a model is first needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "ContextOptimizer",
    "Document",
    "ModelNotFoundError",
    "OptimizeResult",
    "OutputDocument",
    "optimize",
]

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.pipeline import ContextOptimizer, optimize
    from rag_opt.proxy import ModelNotFoundError
    from rag_opt.types import Document, OptimizeResult, OutputDocument

_LAZY = {
    "ContextOptimizer": "rag_opt.pipeline",
    "optimize": "rag_opt.pipeline",
    "ModelNotFoundError": "rag_opt.proxy",
    "Document": "rag_opt.types",
    "OptimizeResult": "rag_opt.types",
    "OutputDocument": "rag_opt.types",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rag_opt' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
