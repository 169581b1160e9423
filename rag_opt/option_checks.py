"""The checks and text readers the optimizer's options are declared with (:mod:`rag_opt.options`): each check
returns the value, normalized, or raises what :class:`~rag_opt.ContextOptimizer` has always raised; each reader
turns what a command line or setting wrote into the option's value."""

from __future__ import annotations

from typing import Any, Literal, get_args

from rag_opt.errors import InvalidInputError, InvalidInputTypeError
from rag_opt.inputs import check_share
from rag_opt.models.prompt import ENCODINGS
from rag_opt.work import WorkLimits

__all__ = [
    "OVER_LIMIT",
    "OverLimit",
    "check_drop_below_best",
    "check_encoding",
    "check_limits",
    "check_over_limit",
    "check_reader",
    "check_target",
    "check_threads",
    "check_title_from_text",
    "check_window",
    "key_list",
    "none_or",
    "thread_count",
]

#: what an optimizer does with a context past its work limits: raise WorkLimitExceeded, or answer by the lexical tier
OverLimit = Literal["raise", "lexical"]
OVER_LIMIT: tuple[str, ...] = get_args(OverLimit)


def check_window(value: int) -> int:
    if value < 128:
        raise InvalidInputError("max_window_tokens must be at least 128")
    return value


def check_target(value: str | None) -> str | None:
    if value is not None:
        from rag_opt.text.tokens import target_key

        target_key(value)  # refuses an unknown target now (loads nothing)
    return value


def check_drop_below_best(value: float | None) -> float | None:
    return check_share("drop_below_best", value)


def check_title_from_text(value: bool) -> bool:
    if not isinstance(value, bool):
        raise InvalidInputTypeError(f"title_from_text must be true or false, got {type(value).__name__}")
    return value


def check_reader(value: str | None) -> str | None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise InvalidInputError("reader must be a non-empty model name")
    return value


def check_limits(value: WorkLimits | None) -> WorkLimits | None:
    if value is not None and not isinstance(value, WorkLimits):
        raise InvalidInputTypeError(f"limits must be a rag_opt.WorkLimits or None, got {type(value).__name__}")
    return value


def check_over_limit(value: str) -> str:
    if value not in OVER_LIMIT:
        raise InvalidInputError(f"over_limit must be 'raise' or 'lexical', got {value!r}")
    return value


def check_threads(value: Any) -> Any:
    from rag_opt.models.threads import ThreadPolicy

    if not isinstance(value, ThreadPolicy):
        ThreadPolicy(value)  # refuses what no policy takes
    return value


def check_encoding(value: str) -> str:
    if value not in ENCODINGS:
        raise InvalidInputError(f"encoding must be one of {', '.join(ENCODINGS)}, got {value!r}")
    return value


# -- reading text ----------------------------------------------------------------------------------------------
def none_or(value: Any) -> Any:
    """``'none'`` as None (a probe: raw attention)."""
    return None if value == "none" else value


def key_list(value: Any) -> Any:
    """``'title,name'`` as ``('title', 'name')`` (``''``: none)."""
    return tuple(k.strip() for k in value.split(",") if k.strip()) if isinstance(value, str) else value


def thread_count(value: Any) -> Any:
    """``'4'`` as 4 (``auto`` and ``adaptive`` stay words)."""
    return int(value) if isinstance(value, str) and value.strip().isdigit() else value
