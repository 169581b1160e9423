"""What a settings field says of itself: its extra schema values and its base type (the flags are generated from
them: :mod:`rag_opt.server.settings_cli`)."""

from __future__ import annotations

import types
from typing import Any, Union, get_args, get_origin

from pydantic.fields import FieldInfo

__all__ = ["base_type", "field_extra"]


def field_extra(info: FieldInfo) -> dict[str, Any]:
    """A settings field's extra schema values (``flag``, ``metavar``, ``choices``)."""
    extra = info.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def base_type(annotation: Any) -> Any:
    """``X`` of ``X | None``."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation
