"""The optimizer's options as command-line flags, generated from their declaration (:mod:`rag_opt.options`).

:func:`add_option_arguments` adds a flag per option that is written as text (its :class:`~rag_opt.options.TextForm`:
``--name``, ``--no-name`` for a boolean on by default, or a flag of its own), with the option's one-line help and
default; :func:`option_values` reads them back as option values (``'none'`` as None, ``'a,b'`` as a tuple). The
budget's flags exclude each other. A new option gets its flag here without an edit.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

from rag_opt.option_text import TextOption, text_options

__all__ = ["add_option_arguments", "option_values"]


def _selected(
    groups: Collection[str] | None, exclude: Collection[str], names: Collection[str] | None
) -> list[TextOption]:
    """The command line's options: ``names``, else those of ``groups``, else all but the groups ``exclude``."""
    out = []
    for o in text_options("cli"):
        if names is not None:
            keep = o.name in names
        elif groups is not None:
            keep = o.group in groups
        else:
            keep = o.group not in exclude
        if keep:
            out.append(o)
    return out


def add_option_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    *,
    groups: Collection[str] | None = None,
    exclude: Collection[str] = ("budget",),
    names: Collection[str] | None = None,
) -> None:
    """Add a flag per option written as text to ``parser``: those of ``groups`` (or every group but
    ``exclude``), or only ``names``. The budget's flags (group ``budget``) exclude each other."""
    selected = _selected(groups, exclude, names)
    budget = parser.add_mutually_exclusive_group() if any(o.group == "budget" for o in selected) else None
    for opt in selected:
        target = budget if budget is not None and opt.group == "budget" else parser
        kind = opt.form.kind
        if kind is bool:
            target.add_argument(
                opt.flag, dest=opt.name, action="store_const", const=not opt.default, default=opt.default,
                help=_help(opt),
            )  # fmt: skip
            continue
        kwargs: dict[str, Any] = {"dest": opt.name, "default": opt.text_default, "help": _help(opt)}
        kwargs["type"] = _number(opt.name, kind, opt.form.bounds) if kind in (int, float) else str
        if opt.form.choices:
            kwargs["choices"] = list(opt.form.choices)
        else:
            kwargs["metavar"] = opt.form.metavar or opt.name.upper()
        target.add_argument(opt.flag, **kwargs)


def option_values(
    args: argparse.Namespace,
    *,
    groups: Collection[str] | None = None,
    exclude: Collection[str] = ("budget",),
    names: Collection[str] | None = None,
) -> dict[str, Any]:
    """The option values of the flags :func:`add_option_arguments` added (the same selection), by option name; a
    flag the parser does not have is left out (its option keeps its default)."""
    return {
        o.name: o.value(getattr(args, o.name))
        for o in _selected(groups, exclude, names)
        if hasattr(args, o.name) and getattr(args, o.name) is not None
    }


def _help(opt: TextOption) -> str:
    text = opt.help
    if opt.form.kind is bool:
        text = f"turn off (on by default): {text}" if opt.default is True else f"{text} (off by default)"
    elif opt.text_default is not None:
        text += f" (default: {opt.form.shown or opt.text_default})"
    return text.replace("%", "%%")


def _number(name: str, kind: type, bounds: Mapping[str, float]) -> Callable[[str], Any]:
    """argparse type: a finite ``kind`` within ``bounds`` (``gt``, ``ge``, ``lt``, ``le``), or an error naming
    ``name`` and the interval."""
    low = bounds.get("gt", bounds.get("ge"))
    high = bounds.get("lt", bounds.get("le"))
    interval = (
        f"{'(' if 'gt' in bounds else '['}{'-inf' if low is None else f'{low:g}'}, "
        f"{'inf' if high is None else f'{high:g}'}{')' if 'lt' in bounds else ']'}"
    )
    noun = "an integer" if kind is int else "a number"

    expected = f"{noun} in {interval}" if bounds else noun

    def parse(value: str) -> Any:
        try:
            x = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be {expected}, got {value!r}") from None
        inside = math.isfinite(x) and all(
            {"gt": x > b, "ge": x >= b, "lt": x < b, "le": x <= b}[k] for k, b in bounds.items()
        )
        if not inside:
            raise argparse.ArgumentTypeError(f"{name} must be in {interval}, got {value}")
        return x

    return parse
