"""The command line of :class:`~rag_opt.server.settings.ProxySettings`: one flag per field, generated from the model
(:func:`add_settings_arguments`), and the settings read back from them over the ``RAG_OPT_*`` environment
(:func:`settings_from_args`). Flag names: :func:`cli_flag`."""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping
from typing import Any, Literal, get_args, get_origin

from pydantic import SecretStr
from pydantic.fields import FieldInfo

from rag_opt.server.settings import BUDGET_FIELDS, ENV_PREFIX, ProxySettings, base_type, cli_flag, field_extra

__all__ = ["add_settings_arguments", "settings_from_args"]


def _help(name: str, info: FieldInfo, description: str | None = None) -> str:
    text = description or info.description or name.replace("_", " ")
    base = base_type(info.annotation)
    if base is bool:
        text = f"turn off (on by default): {text}" if info.default is True else f"{text} (off by default)"
    elif not info.is_required() and info.default is not None:
        default = info.default
        shown = str(int(default)) if isinstance(default, float) and default.is_integer() else str(default)
        text += f" (default: {shown})"
    if base is SecretStr:
        text += f" (prefer {ENV_PREFIX}{name.upper()}: the command line is visible to other users)"
    elif isinstance(field_extra(info).get("flag"), str):  # a flag of its own: its variable is not RAG_OPT_<FLAG>
        text += f" (environment: {ENV_PREFIX}{name.upper()})"
    return text.replace("%", "%%")


def add_settings_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    names: Collection[str] | None = None,
    descriptions: Mapping[str, str] | None = None,
) -> None:
    """Add one command-line flag per :class:`ProxySettings` field to ``parser`` (help: the field's description;
    the optimizer's options under their own heading; ``--ratio``, ``--target-tokens`` and ``--threshold`` exclude
    each other). A flag not given leaves its
    attribute None, so :func:`settings_from_args` falls back to the environment, then the default. ``names``:
    only these fields (another command's flags for the same settings, e.g. :data:`SERVICE_LIMITS`), described by
    ``descriptions`` where it has one of its own (its default, bounds and variable stay the field's)."""
    wanted = set(ProxySettings.model_fields if names is None else names)
    # the optimizer's options (generated from rag_opt.options) after the server's own settings, under a heading
    own = [n for n, info in ProxySettings.model_fields.items() if "option" not in field_extra(info)]
    options = [n for n in ProxySettings.model_fields if n not in own]
    group = parser
    if isinstance(parser, argparse.ArgumentParser) and wanted & set(options):
        group = parser.add_argument_group("optimizer options (rag_opt.OptimizerOptions)")
    budget = group.add_mutually_exclusive_group() if wanted & set(BUDGET_FIELDS) else group
    for name in [*own, *options]:
        if name not in wanted:
            continue
        info = ProxySettings.model_fields[name]
        flag, base = cli_flag(name), base_type(info.annotation)
        target = budget if name in BUDGET_FIELDS else parser if name in own else group
        described = (descriptions or {}).get(name)
        if base is bool:
            target.add_argument(
                flag, dest=name, action="store_const", const=not info.default, help=_help(name, info, described)
            )
            continue
        kwargs: dict[str, Any] = {
            "dest": name,
            "help": _help(name, info, described),
            "type": base if base in (int, float) else str,
        }
        choices = list(get_args(base)) if get_origin(base) is Literal else field_extra(info).get("choices")
        if choices:
            kwargs["choices"] = choices
        else:
            kwargs["metavar"] = field_extra(info).get("metavar", flag.removeprefix("--").replace("-", "_").upper())
        target.add_argument(flag, **kwargs)


def settings_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> ProxySettings:
    """:class:`ProxySettings` from the flags of :func:`add_settings_arguments` over the ``RAG_OPT_*``
    environment variables (``env``, default ``os.environ``); raises
    :class:`~rag_opt.errors.ConfigurationError` naming each invalid setting and where it came from."""
    cli = {name: getattr(args, name, None) for name in ProxySettings.model_fields}
    return ProxySettings.from_sources(cli, env)
