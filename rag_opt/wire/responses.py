"""The OpenAI Responses API (``POST /v1/responses``): a request body read, its context found.

``input`` is a string or a list of items. The question is the string ``input`` (document blocks removed), or the
text of the last ``user`` message item (its ``input_text`` parts, or its string content, joined by newlines
with document blocks removed), unless ``rag_opt.query`` gives one; that message and the items after it are the
current turn. Context is:

1. ``<document ...>...</document>`` blocks (the tag is ``--document-tag``) in a string ``input``, in the
   ``instructions``, in ``system``/``developer`` message items and in the last user message, as on the chat
   route (so a string ``input`` without blocks is forwarded unchanged);
2. ``function_call_output`` items of the current turn: their ``<document>`` blocks, or, without any, their whole
   ``output`` (a string, or each of its ``input_text`` parts) when at least ``--tool-min-chars`` long (unless
   ``--no-tool-messages``);
3. ``rag_opt.documents``: rendered as blocks first in the question (a string ``input``, or the last user
   message: a new first ``input_text`` part when its content is a list), or with ``"placement": "system"`` at the
   end of a string ``instructions``.

Everything else is forwarded byte for byte (:meth:`rag_opt.wire.documents.ContextPlan.render`); the flow is
:class:`rag_opt.wire.flow.RequestFlow` (``rag-opt serve``'s route: :class:`rag_opt.server.routes.Responses`, with
OpenAI-style errors). Nothing is scored, selected or ordered here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rag_opt.wire.documents import SYSTEM_ROLES, ContextPlan, place_first, texts_of
from rag_opt.wire.errors import RequestError, RewriteError
from rag_opt.wire.json_edit import Edit, JsonEditor, JsonPath
from rag_opt.wire.request import EXTENSION_FIELD, check_parts, check_unique, json_type, parse_request
from rag_opt.wire.settings import WireSettings

__all__ = ["check_responses_body", "plan_responses"]

_BODY_KEYS = frozenset({"input", "instructions", EXTENSION_FIELD})
_ITEM_KEYS = frozenset({"type", "role", "content", "output"})
_TEXT = ("input_text",)


def _is_message(item: Any) -> bool:
    return isinstance(item, dict) and "role" in item and item.get("type", "message") == "message"


def check_responses_body(body: dict[str, Any]) -> None:
    """The structure rag-opt reads: ``input`` absent, a string or a list of objects; a message item's string
    ``role`` and its string or part-list ``content`` (``input_text`` parts with a string ``text``); a
    ``function_call_output`` item's string or part-list ``output``. The rest is the upstream's to validate."""
    check_unique(body, "", _BODY_KEYS)
    items = body.get("input")
    if items is None or isinstance(items, str):
        return
    if not isinstance(items, list):
        raise RequestError(f"input must be a string or an array of items, got {json_type(items)}", "input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object, got {json_type(item)}", where, "invalid_type")
        check_unique(item, where, _ITEM_KEYS)
        if _is_message(item) and not isinstance(item["role"], str):
            raise RequestError(f"{where}.role must be a string", f"{where}.role", "invalid_type")
        key = "content" if _is_message(item) else "output" if item.get("type") == "function_call_output" else None
        value = item.get(key) if key else None
        if isinstance(value, list):
            check_parts(value, f"{where}.{key}", _TEXT)
        elif value is not None and not isinstance(value, str):
            raise RequestError(
                f"{where}.{key} must be a string or an array of parts, got {json_type(value)}",
                f"{where}.{key}",
                "invalid_type",
            )


def _last_user(items: list[Any]) -> int | None:
    users = [i for i, item in enumerate(items) if _is_message(item) and item["role"] == "user"]
    return users[-1] if users else None


def plan_responses(raw: bytes, headers: Mapping[str, str], settings: WireSettings) -> ContextPlan:
    """The context of a Responses API request body (see the module docstring); RequestError when invalid."""
    body, options, ext_docs = parse_request(raw, headers, check_responses_body)
    plan = ContextPlan(raw=raw, body=body, tag=settings.document_tag, query=None, options=options)
    plan.has_extension_field = EXTENSION_FIELD in body
    plan.placer = _place
    if isinstance(body.get("instructions"), str):
        plan.add_text(("instructions",), body["instructions"])
    items = body.get("input")
    question: list[str] = []
    if isinstance(items, str):
        plan.add_text(("input",), items)
        question = [items]
    elif isinstance(items, list):
        last_user = _last_user(items)
        whole_min = settings.tool_min_chars if settings.tool_messages else None
        for i, item in enumerate(items):
            if _is_message(item) and (item["role"] in SYSTEM_ROLES or i == last_user):
                for path, text in texts_of(item.get("content"), ("input", i, "content"), "input_text"):
                    plan.add_text(path, text)
            elif item.get("type") == "function_call_output" and (last_user is None or i > last_user):
                for path, text in texts_of(item.get("output"), ("input", i, "output"), "input_text"):
                    plan.add_text(path, text, whole_min)
        if last_user is not None:
            question = [t for _, t in texts_of(items[last_user].get("content"), (), "input_text")]
    plan.add_extension(ext_docs)
    plan.set_query(question)
    return plan


def _place(plan: ContextPlan, editor: JsonEditor, values: dict[JsonPath, str], ext_text: str) -> list[Edit]:
    """Insert the extension documents: at the end of a string ``instructions`` (``placement: "system"``), else
    first in the question."""
    instructions = plan.body.get("instructions")
    if plan.options.placement == "system" and isinstance(instructions, str):
        values[("instructions",)] = values.get(("instructions",), instructions) + "\n\n" + ext_text
        return []
    items = plan.body.get("input")
    placed: list[Edit] | None = None
    if isinstance(items, str):
        placed = place_first(editor, values, ("input",), items, "input_text", ext_text)
    elif isinstance(items, list) and (i := _last_user(items)) is not None:
        placed = place_first(editor, values, ("input", i, "content"), items[i].get("content"), "input_text", ext_text)
    if placed is None:
        raise RewriteError("no user input to place the documents in")
    return placed
