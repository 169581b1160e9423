"""The options an adapter takes: its own fields, plus every option of :class:`~rag_opt.options.OptimizerOptions`.

An adapter (LangChain, LlamaIndex, Haystack) is built from its own fields (the budget, ``ordering``, ...) and,
instead of a ready ``optimizer``, any option of :class:`~rag_opt.options.OptimizerOptions` (``keep_best_per_doc``,
``tier``, ``model``, ...): they build its optimizer. The names come from the options' declaration, so a new option
is taken here without an edit. Unknown names are refused, naming the closest known one (a typo such as
``rati=0.5`` would otherwise be dropped, and nothing compressed).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rag_opt.option_args import closest_hint
from rag_opt.options import BUDGET_FIELDS, option_names, options_in_group

__all__ = ["optimizer_options", "per_call_options", "split_options"]


def per_call_options() -> tuple[str, ...]:
    """The options every adapter has as fields of its own, applied per call: the budget (``budget``, a
    :class:`~rag_opt.types.Budget`, is spread into its three fields) and the ordering."""
    return (*options_in_group("budget"), "ordering")


def optimizer_options() -> tuple[str, ...]:
    """The :class:`~rag_opt.options.OptimizerOptions` an adapter passes on to its optimizer (not the per-call
    ones)."""
    per_call = per_call_options()
    return tuple(p for p in option_names() if p not in per_call)


def split_options(data: Any, fields: Iterable[str], adapter: str) -> Any:
    """``data`` (an adapter's keyword arguments) with its optimizer options turned into ``optimizer``; raises
    ``ValueError`` for an unknown name (with the closest known one) or for options given together with
    ``optimizer``."""
    if not isinstance(data, dict):
        return data
    known = set(fields)
    if data.get("budget") is not None and "budget" not in known:  # a Budget, as optimize() takes it
        budget = data["budget"]
        limits = {k: getattr(budget, k, None) for k in BUDGET_FIELDS}
        if any(data.get(k) is not None for k in limits):
            raise ValueError(f"{adapter}: give the budget either as budget= or as {'/'.join(BUDGET_FIELDS)}")
        data = {
            **{k: v for k, v in data.items() if k != "budget"},
            **{k: v for k, v in limits.items() if v is not None},
        }
    options = optimizer_options()
    unknown = [k for k in data if k not in known and k not in options]
    if unknown:
        choices = sorted(known | set(options))
        hints = ", ".join(closest_hint(str(name), choices) for name in unknown)
        raise ValueError(f"{adapter} got unknown option(s) {hints}; it takes {', '.join(choices)}")
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
