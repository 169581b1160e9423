"""The options an adapter takes: its own fields, plus every :class:`~rag_opt.ContextOptimizer` option.

An adapter (LangChain, LlamaIndex) is built from its own fields (``ratio``, ``ordering``, ...) and, instead of a
ready ``optimizer``, any option of :class:`~rag_opt.ContextOptimizer` (``keep_best_per_doc``, ``tier``,
``model``, ...): they build its optimizer. Unknown names are refused, naming the closest known one (a typo such
as ``rati=0.5`` would otherwise be dropped, and nothing compressed).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable
from functools import cache
from typing import Any

__all__ = ["optimizer_options", "split_options"]

# per-call settings every adapter has as fields of its own (they are also ContextOptimizer options); ``budget``
# (a rag_opt.Budget) is taken too and spread into those fields
_PER_CALL = ("ratio", "target_tokens", "threshold", "budget", "ordering")


@cache
def optimizer_options() -> tuple[str, ...]:
    """The :class:`~rag_opt.ContextOptimizer` options an adapter passes on (not the per-call ones)."""
    from rag_opt.pipeline import ContextOptimizer

    params = inspect.signature(ContextOptimizer.__init__).parameters
    return tuple(p for p in params if p != "self" and p not in _PER_CALL)


def split_options(data: Any, fields: Iterable[str], adapter: str) -> Any:
    """``data`` (an adapter's keyword arguments) with its :class:`~rag_opt.ContextOptimizer` options turned into
    ``optimizer``; raises ``ValueError`` for an unknown name (with the closest known one) or for options given
    together with ``optimizer``."""
    if not isinstance(data, dict):
        return data
    if data.get("budget") is not None and "budget" not in set(fields):  # a Budget, as optimize() takes it
        budget = data["budget"]
        limits = {k: getattr(budget, k, None) for k in ("ratio", "target_tokens", "threshold")}
        if any(data.get(k) is not None for k in limits):
            raise ValueError(f"{adapter}: give the budget either as budget= or as ratio/target_tokens/threshold")
        data = {
            **{k: v for k, v in data.items() if k != "budget"},
            **{k: v for k, v in limits.items() if v is not None},
        }
    known = set(fields)
    options = optimizer_options()
    unknown = [k for k in data if k not in known and k not in options]
    if unknown:
        choices = sorted(known | set(options))
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(str(name), choices, n=1)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(f"{adapter} got unknown option(s) {', '.join(hints)}; it takes {', '.join(choices)}")
    given = {k: data[k] for k in data if k in options and k not in known}
    if not given:
        return data
    if data.get("optimizer") is not None:
        raise ValueError(
            f"{adapter}: give either optimizer= or ContextOptimizer options ({', '.join(given)}), not both"
        )
    from rag_opt.pipeline import ContextOptimizer

    rest = {k: v for k, v in data.items() if k not in given}
    return {**rest, "optimizer": ContextOptimizer(**given)}
