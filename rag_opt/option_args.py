"""What callers give the optimizer: option names checked (an unknown one refused naming the closest), options
resolved from an :class:`~rag_opt.options.OptimizerOptions` and overrides by name, and the typed signature of what
takes them (:func:`options_signature`)."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec

from rag_opt.errors import InvalidInputError, InvalidInputTypeError
from rag_opt.options import OptimizerOptions, option_names, options_in_group

__all__ = ["check_option_names", "closest_hint", "options_signature", "resolve_options"]


def closest_hint(name: str, choices: Iterable[str]) -> str:
    """``'rati' (did you mean 'ratio'?)``: ``name`` quoted, with the closest of ``choices`` when one is close."""
    close = difflib.get_close_matches(str(name), sorted(choices), n=1)
    return f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def check_option_names(names: Iterable[str], where: str) -> None:
    """Raise :class:`~rag_opt.errors.InvalidInputError` for any of ``names`` that is no option, naming the closest
    one (a typo such as ``rati=0.5`` would otherwise be dropped, or a bare ``TypeError``)."""
    known = set(option_names())
    unknown = [n for n in names if n not in known]
    if unknown:
        hints = ", ".join(closest_hint(n, known) for n in unknown)
        raise InvalidInputError(f"{where} got unknown option(s) {hints}; see rag_opt.OptimizerOptions")


def resolve_options(
    options: OptimizerOptions | None, overrides: Mapping[str, Any], where: str = "ContextOptimizer"
) -> OptimizerOptions:
    """``options`` (default: every option's default) with ``overrides`` by name. A budget among the overrides
    replaces the budget of ``options`` (its four spellings go together). An unknown name raises
    :class:`~rag_opt.errors.InvalidInputError` naming the closest option."""
    if options is not None and not isinstance(options, OptimizerOptions):
        raise InvalidInputTypeError(f"options must be a rag_opt.OptimizerOptions, got {type(options).__name__}")
    check_option_names(overrides, where)
    if options is None:
        return OptimizerOptions(**overrides)
    if not overrides:
        return options
    changes = dict(overrides)
    budget = options_in_group("budget")
    if any(k in changes for k in budget):  # a budget given replaces the options' budget
        changes = {**{k: None for k in budget}, **changes}
    return dataclasses.replace(options, **changes)


# -- the typed signature of what takes the options -------------------------------------------------------------
_P = ParamSpec("_P")

if TYPE_CHECKING:  # pragma: no cover

    @dataclass(frozen=True)
    class _Arguments(OptimizerOptions):
        """The arguments :class:`~rag_opt.ContextOptimizer` takes: an options object, then every option by name."""

        options: OptimizerOptions | None = None

    def _signature_of(
        source: Callable[_P, object],
    ) -> Callable[[Callable[..., None]], Callable[Concatenate[Any, _P], None]]: ...

    options_signature = _signature_of(_Arguments)
else:

    def options_signature(init: Callable[..., None]) -> Callable[..., None]:
        """Types ``init(self, options=None, **overrides)`` as taking ``options`` and every option by name, with its
        type and default: for mypy (a :class:`typing.ParamSpec` copied from the fields) and at run time
        (``inspect.signature``, ``help()``)."""
        kind = inspect.Parameter.KEYWORD_ONLY
        params = [
            inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            inspect.Parameter(
                "options", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation="OptimizerOptions | None"
            ),
            *(
                inspect.Parameter(f.name, kind, default=f.default, annotation=f.type)
                for f in dataclasses.fields(OptimizerOptions)
            ),
        ]
        init.__signature__ = inspect.Signature(params, return_annotation="None")  # type: ignore[attr-defined]
        return init
