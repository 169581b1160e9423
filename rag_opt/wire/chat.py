"""The OpenAI chat completions API (``POST /v1/chat/completions``): a request body read, its context found.

Its context is found by :func:`plan_request` (``<document>`` blocks, large tool messages of the current turn,
the ``rag_opt`` field: the rules are in :mod:`rag_opt.wire.documents`, with the plan they fill); the rest of the
flow — the job, fail-open, writing the result back, the outcome — is :class:`rag_opt.wire.flow.RequestFlow`, driven
by ``rag-opt serve``'s route (:class:`rag_opt.server.routes.ChatCompletions`: the worker pool, the lexical tier,
the ``x-ragopt-*`` headers, forwarding) and by the gateway adapter (:mod:`rag_opt.adapters.gateway`).
"""

from __future__ import annotations

from collections.abc import Mapping

from rag_opt.wire.documents import SYSTEM_ROLES, TOOL_ROLES, ContextPlan, place_first, texts_of
from rag_opt.wire.errors import RewriteError
from rag_opt.wire.json_edit import Edit, JsonEditor, JsonPath
from rag_opt.wire.request import EXTENSION_FIELD, parse_request
from rag_opt.wire.settings import WireSettings

__all__ = ["plan_chat", "plan_request"]


def _place(plan: ContextPlan, editor: JsonEditor, values: dict[JsonPath, str], ext_text: str) -> list[Edit]:
    """Insert the extension documents into a chat completion: first in the last user message, or last in the
    first system message with a string content, else as a new first system message."""
    msgs = plan.body.get("messages")
    msgs = msgs if isinstance(msgs, list) else []
    roles = [m.get("role") if isinstance(m, dict) else None for m in msgs]
    if plan.options.placement == "user" and "user" in roles:
        i = len(roles) - 1 - roles[::-1].index("user")
        placed = place_first(editor, values, ("messages", i, "content"), msgs[i].get("content"), "text", ext_text)
        if placed is not None:
            return placed
    if plan.options.placement == "system":
        for i, role in enumerate(roles):
            if role in SYSTEM_ROLES and isinstance(msgs[i].get("content"), str):
                path: JsonPath = ("messages", i, "content")
                values[path] = values.get(path, msgs[i]["content"]) + "\n\n" + ext_text
                return []
    if not editor.is_array(("messages",)):
        raise RewriteError("no messages to place the documents in")
    return [editor.insert_first(("messages",), {"role": "system", "content": ext_text})]


def plan_request(
    raw: bytes,
    headers: Mapping[str, str],
    *,
    tag: str = "document",
    tool_messages: bool = True,
    tool_min_chars: int = 2000,
) -> ContextPlan:
    """Find the context of a chat completion request body.

    Raises :class:`~rag_opt.wire.errors.RequestError` for a body that is not a valid chat completion request,
    an invalid ``rag_opt`` field or ``x-ragopt-*`` header (see :func:`rag_opt.wire.request.parse_request`).
    """
    body, options, ext_docs = parse_request(raw, headers)
    plan = ContextPlan(raw=raw, body=body, tag=tag, query=None, options=options)
    plan.has_extension_field = EXTENSION_FIELD in body
    plan.placer = _place
    messages = body["messages"]
    users = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"]
    last_user = users[-1] if users else None
    whole_min = tool_min_chars if tool_messages else None
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        is_tool = role in TOOL_ROLES and (last_user is None or i > last_user)
        if not (role in SYSTEM_ROLES or i == last_user or is_tool):
            continue
        for path, text in texts_of(m.get("content"), ("messages", i, "content")):
            plan.add_text(path, text, whole_min if is_tool else None)
    plan.add_extension(ext_docs)
    plan.set_query([t for _, t in texts_of(messages[last_user].get("content"), ())] if last_user is not None else [])
    return plan


def plan_chat(raw: bytes, headers: Mapping[str, str], settings: WireSettings) -> ContextPlan:
    """The context of a chat completion request, with the proxy's settings (document tag, tool messages)."""
    return plan_request(
        raw,
        headers,
        tag=settings.document_tag,
        tool_messages=settings.tool_messages,
        tool_min_chars=settings.tool_min_chars,
    )
