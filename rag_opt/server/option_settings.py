"""The optimizer's options as ``rag-opt serve`` settings: pydantic fields generated from their declaration
(:mod:`rag_opt.options`), the base of :class:`~rag_opt.server.settings.ProxySettings`.

Each option written as text on the server (its :class:`~rag_opt.options.TextForm`) becomes a field named as the
option (or its ``setting``), with its text default, bounds and one-line help, checked by the option's own check
(a ``ConfigurationError`` naming the setting and where it came from). The field keeps the text as given (``'none'``
for a probe, ``'title,name'`` for title keys); :func:`settings_options` reads the settings back as an
:class:`~rag_opt.options.OptimizerOptions`. A new option becomes a setting, a flag (``--<name>``) and a variable
(``RAG_OPT_<NAME>``) here without an edit.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, create_model, field_validator

from rag_opt.errors import ConfigurationError, RagOptError
from rag_opt.option_text import TextOption, text_options
from rag_opt.options import OptimizerOptions, option_spec

__all__ = ["OPTION_SETTINGS", "options_settings_model", "settings_options"]


def _validator(opt: TextOption) -> Any:
    """The field validator of ``opt``'s setting: the option's check on its value (the text kept as given when the
    option parses it, else the checked value)."""
    check = option_spec(opt.name).check

    def validate(cls: Any, v: Any) -> Any:
        value = opt.value(v)
        try:
            checked = check(value) if check is not None else value
        except RagOptError as exc:  # (an InvalidInputTypeError is a TypeError too, which pydantic would not catch)
            # the error names the setting already ("invalid encoding (from --encoding): must be one of ...")
            raise ConfigurationError(str(exc).removeprefix(f"{opt.name} ")) from None
        return v if opt.form.parse is not None else checked

    validate.__name__ = f"_check_{opt.setting}"
    return field_validator(opt.setting)(classmethod(validate))


def _field(opt: TextOption) -> tuple[Any, Any]:
    default = opt.text_default
    dashed = opt.setting.replace("_", "-")
    own = f"--no-{dashed}" if opt.form.kind is bool and default is True else f"--{dashed}"
    extra: dict[str, Any] = {"option": opt.name}
    if opt.flag != own:  # a flag of its own (--model for proxy_model): its variable is RAG_OPT_<SETTING>
        extra["flag"] = opt.flag
    if opt.form.metavar:
        extra["metavar"] = opt.form.metavar
    if opt.form.choices:
        extra["choices"] = list(opt.form.choices)
    annotation: Any = opt.form.kind if default is not None else opt.form.kind | None
    b = opt.form.bounds
    info = Field(
        default=default,
        description=opt.help,
        json_schema_extra=extra,
        gt=b.get("gt"),
        ge=b.get("ge"),
        lt=b.get("lt"),
        le=b.get("le"),
    )
    return annotation, info


def options_settings_model() -> type[BaseModel]:
    """A pydantic model with a field per option written as text on the server (see the module docstring)."""
    options = text_options("server")
    return create_model(  # type: ignore[call-overload]
        "OptimizerSettings",
        __doc__="The optimizer's options as settings (generated from rag_opt.options.OptimizerOptions).",
        __validators__={f"_check_{o.setting}": _validator(o) for o in options},
        **{o.setting: _field(o) for o in options},
    )


#: setting name -> option name, for the options the server takes as settings
OPTION_SETTINGS: dict[str, str] = {o.setting: o.name for o in text_options("server")}


def settings_options(settings: BaseModel) -> OptimizerOptions:
    """The :class:`~rag_opt.options.OptimizerOptions` of ``settings`` (a model from :func:`options_settings_model`):
    each option the server takes, from its setting; the others at their defaults."""
    return OptimizerOptions(**{o.name: o.value(getattr(settings, o.setting)) for o in text_options("server")})
