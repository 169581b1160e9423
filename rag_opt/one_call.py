"""``rag_opt.optimize``: one call, with the optimizer (and its loaded models) kept per set of options."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from rag_opt.option_args import check_option_names
from rag_opt.pipeline import ContextOptimizer
from rag_opt.types import DEFAULT_ORDERING, Budget, DocumentLike, OptimizeResult, OrderingName

__all__ = ["OPTIMIZERS_KEPT", "optimize"]

OPTIMIZERS_KEPT = 4  # optimizers optimize() keeps, one per set of options (each holds its loaded models)
_OPTIMIZERS: OrderedDict[tuple[Any, ...], ContextOptimizer] = OrderedDict()
_OPTIMIZERS_LOCK = threading.Lock()


def _options_key(options: dict[str, Any]) -> tuple[Any, ...]:
    """A key for a set of :class:`ContextOptimizer` options (an unhashable value counts by identity)."""
    out = []
    for name in sorted(options):
        value = options[name]
        try:
            hash(value)
        except TypeError:
            value = ("id", id(value))
        out.append((name, value))
    return tuple(out)


def _check_options(kwargs: dict[str, Any]) -> None:
    """Refuse a name that is no option of :class:`~rag_opt.options.OptimizerOptions`, naming the closest one (a
    typo such as ``rati=0.5`` would otherwise be a bare ``TypeError`` from the constructor)."""
    check_option_names(kwargs, "rag_opt.optimize")


def optimize(
    query: str,
    documents: Sequence[DocumentLike],
    *,
    ratio: float | None = None,
    target_tokens: int | None = None,
    threshold: float | None = None,
    ordering: OrderingName | str = DEFAULT_ORDERING,
    target: str | None = None,
    model: str | None = None,
    budget: Budget | None = None,
    **kwargs: Any,
) -> OptimizeResult:
    """Optimize retrieved ``documents`` for ``query`` in one call.

    The optimizer (and its loaded models) is kept per set of options and reused by later calls with the same
    ones (the :data:`OPTIMIZERS_KEPT` most recent). No budget given: :data:`~rag_opt.types.DEFAULT_RATIO`.
    ``**kwargs``: any other option of :class:`~rag_opt.options.OptimizerOptions` (an unknown name raises
    :class:`~rag_opt.errors.InvalidInputError` naming the closest).
    """
    _check_options(kwargs)
    options = {"model": model, "target": target, **kwargs}
    key = _options_key(options)
    with _OPTIMIZERS_LOCK:
        opt = _OPTIMIZERS.get(key)
        if opt is None:
            opt = ContextOptimizer(**options)
            _OPTIMIZERS[key] = opt
            while len(_OPTIMIZERS) > OPTIMIZERS_KEPT:
                _OPTIMIZERS.popitem(last=False)
        _OPTIMIZERS.move_to_end(key)
    return opt.optimize(
        query,
        documents,
        ratio=ratio,
        target_tokens=target_tokens,
        threshold=threshold,
        ordering=ordering,
        budget=budget,
    )
