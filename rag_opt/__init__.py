"""rag-opt: optimize the context between your retriever and your LLM.

Sentence-level compression read from a small proxy model's attention (with a trained probe), document
reordering against "lost in the middle", and position-bias calibration. Heavy dependencies (torch,
transformers) are imported only when a model is first needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rag_opt._lazy import lazy_module
from rag_opt.errors import __all__ as _errors_all

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_ORDERING",
    "DEFAULT_RATIO",
    "ORDERING_NAMES",
    "Budget",
    "ConfigurationError",
    "ContextOptimizer",
    "DataNotFoundError",
    "Document",
    "InvalidInputError",
    "InvalidInputTypeError",
    "ModelNotFoundError",
    "OptimizeResult",
    "OptimizerOptions",
    "Orderer",
    "OrderingName",
    "OutputDocument",
    "ProbeMismatchError",
    "ProfileMismatchError",
    "RagOptError",
    "Scorer",
    "Tier",
    "Timings",
    "Unit",
    "WorkLimits",
    "optimize",
]

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.compressors.base import Scorer
    from rag_opt.errors import (
        ConfigurationError,
        DataNotFoundError,
        InvalidInputError,
        InvalidInputTypeError,
        ModelNotFoundError,
        ProbeMismatchError,
        ProfileMismatchError,
        RagOptError,
    )
    from rag_opt.one_call import optimize
    from rag_opt.options import OptimizerOptions
    from rag_opt.orderers.base import Orderer
    from rag_opt.pipeline import ContextOptimizer
    from rag_opt.types import (
        DEFAULT_ORDERING,
        DEFAULT_RATIO,
        ORDERING_NAMES,
        Budget,
        Document,
        OptimizeResult,
        OrderingName,
        OutputDocument,
        Tier,
        Timings,
        Unit,
    )
    from rag_opt.work import WorkLimits

_ERRORS = tuple(_errors_all)  # the errors module is tiny: importing it costs nothing
_TYPES = (
    "DEFAULT_ORDERING",
    "DEFAULT_RATIO",
    "ORDERING_NAMES",
    "Budget",
    "Document",
    "OptimizeResult",
    "OrderingName",
    "OutputDocument",
    "Tier",
    "Timings",
    "Unit",
)

__getattr__, __dir__ = lazy_module(
    __name__,
    {
        "ContextOptimizer": "rag_opt.pipeline",
        "optimize": "rag_opt.one_call",
        "OptimizerOptions": "rag_opt.options",
        "Scorer": "rag_opt.compressors.base",
        "Orderer": "rag_opt.orderers.base",
        "WorkLimits": "rag_opt.work",
        **{name: "rag_opt.errors" for name in _ERRORS},
        **{name: "rag_opt.types" for name in _TYPES},
    },
)
