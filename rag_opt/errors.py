"""The errors rag-opt raises on purpose. Every one derives from :class:`RagOptError`.

They also derive from the built-in exception a caller would expect (``ValueError`` for bad input,
``FileNotFoundError`` for a missing file, ``RuntimeError`` for a model that cannot load), so ``except
ValueError`` keeps working. Anything else escaping rag-opt is a bug and keeps its traceback.
"""

from __future__ import annotations

__all__ = [
    "Cancelled",
    "ConfigurationError",
    "DataNotFoundError",
    "InvalidInputError",
    "InvalidInputTypeError",
    "ModelNotFoundError",
    "ProbeMismatchError",
    "ProfileMismatchError",
    "RagOptError",
    "WorkLimitExceeded",
]


class RagOptError(Exception):
    """Base of every error rag-opt raises on purpose; the message says what is wrong and how to fix it."""


class InvalidInputError(RagOptError, ValueError):
    """A query, document, budget or option has an invalid value."""


class InvalidInputTypeError(InvalidInputError, TypeError):
    """A query, document or option has the wrong type."""


class ConfigurationError(RagOptError, ValueError):
    """Settings that cannot work together (e.g. an ordering that needs a model the scorer does not have)."""


class ModelNotFoundError(RagOptError, RuntimeError):
    """The requested proxy model could not be found or loaded."""


class ProbeMismatchError(RagOptError, ValueError):
    """A probe is invalid, or was trained for another model, prompt template or feature layout."""


class ProfileMismatchError(RagOptError, ValueError):
    """A calibration profile is invalid, or belongs to another model, template or number of documents."""


class DataNotFoundError(RagOptError, FileNotFoundError):
    """A data, probe or profile file that was asked for does not exist."""


class WorkLimitExceeded(RagOptError, ValueError):
    """A context is larger than the work limits in force (units, proxy tokens: :mod:`rag_opt.work`); raised
    before the expensive stages run."""


class Cancelled(RagOptError):
    """The optimization was cancelled (:mod:`rag_opt.work`): whoever waited for it gave up. Raised at the next
    checkpoint (between stages and between forward passes)."""
