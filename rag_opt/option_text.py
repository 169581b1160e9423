"""The optimizer's options as text surfaces write them (the command line's flags, ``rag-opt serve``'s settings):
:func:`text_options`, each a :class:`TextOption` made from its field and its :class:`~rag_opt.options.TextForm`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from rag_opt.options import OptimizerOptions, TextForm, option_spec

__all__ = ["TextOption", "text_options"]


@dataclass(frozen=True)
class TextOption:
    """An option that is written as text, as a surface generates its flag or setting from it: its ``name``, its
    :class:`TextForm`, its one-line ``help``, its ``default`` (as the option has it) and ``text_default`` (as text
    has it: ``title,doc_title,...`` for a tuple of keys), and the setting's name on ``rag-opt serve``."""

    name: str
    form: TextForm
    help: str
    default: Any
    group: str | None

    @property
    def setting(self) -> str:
        return self.form.setting or self.name

    @property
    def flag(self) -> str:
        """Its flag: its own, ``--no-<name>`` for a boolean on by default, else ``--<name>``."""
        if self.form.flag:
            return self.form.flag
        dashed = self.name.replace("_", "-")
        return f"--no-{dashed}" if self.form.kind is bool and self.default is True else f"--{dashed}"

    @property
    def text_default(self) -> Any:
        if isinstance(self.default, (tuple, list)):
            return ",".join(self.default)
        return self.default

    def value(self, text_value: Any) -> Any:
        """The option's value of what a surface read (its ``parse`` applied)."""
        return self.form.parse(text_value) if self.form.parse is not None else text_value


def text_options(surface: Literal["cli", "server"]) -> list[TextOption]:
    """The options written as text on ``surface`` (the command line, or ``rag-opt serve``'s settings), in
    declaration order."""
    out = []
    for f in dataclasses.fields(OptimizerOptions):
        name = f.name
        form = _text_form(f)
        if form is not None and (form.cli if surface == "cli" else form.server):
            out.append(TextOption(name, form, option_spec(name).help, f.default, option_spec(name).group))
    return out


_TEXT_KINDS = {"bool": bool, "int": int, "float": float, "str": str}


def _text_form(f: dataclasses.Field[Any]) -> TextForm | None:
    """A field's :class:`TextForm`: its own, or inferred from a type of ``bool``, ``int``, ``float`` or ``str``
    (``| None`` allowed)."""
    text = option_spec(f.name).text
    if text != "infer":
        return text
    kinds = {part.strip() for part in str(f.type).split("|")} - {"None"}
    if len(kinds) == 1 and (kind := next(iter(kinds))) in _TEXT_KINDS:
        return TextForm(_TEXT_KINDS[kind])
    raise TypeError(
        f"OptimizerOptions.{f.name}: type {f.type} has no text form of its own; declare "
        "option(..., text=TextForm(...)) or text=None"
    )
