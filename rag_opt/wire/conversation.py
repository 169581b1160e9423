"""The context of a conversation sent as a list of messages (``POST /v1/compress`` with ``{"messages": [...]}``,
Headroom's contract), found with the proxy's own planners and written back into the messages.

Nothing is detected here: each part of the conversation is read by the planner of its API —
:func:`rag_opt.wire.chat.plan_chat` for OpenAI messages (string content or text parts; ``tool``/``function``
results), :func:`rag_opt.wire.anthropic_messages.plan_messages` for Anthropic messages (``text``,
``tool_result`` and ``document`` blocks) — so the context is what the proxy finds in a chat request:
``<document>`` blocks, tool results of at least ``--tool-min-chars`` characters (one JSON value or a table is
compressed at its own grain), and nothing else. The shape is told apart by the messages (:func:`message_shape`).

A conversation can hold several questions, each with its own context (earlier turns of an agent loop, which a
gateway sends again on every request). It is read turn by turn (:func:`find_turns`): a turn starts at a user
message (Anthropic: one that has text, not only tool results) and runs to the next one, so each tool result and
each document is read by the latest user message before it. The system prompt (``system``/``developer``
messages) belongs to the last turn: the current question reads it, as on the proxy. Messages before the first
user message form a turn of their own. A turn whose context has no user message before it is read by the
arguments of the tool calls it answers (matched by ``tool_call_id`` / ``tool_use_id``; else the latest tool call
before it): their string values, one per line.

Each turn is planned as a request of its own — ``{"messages": [its messages]}`` — and an optimization result is
written back by the plan (:meth:`rag_opt.wire.documents.ContextPlan.render`): only the optimized texts change,
each message keeps its other fields and its content shape (a string stays a string, a list of parts a list of
parts; a block left blank is removed from its list, as on the Messages route). No scoring, selection or ordering
happens here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from rag_opt.wire.anthropic_messages import plan_messages
from rag_opt.wire.chat import plan_chat
from rag_opt.wire.documents import SYSTEM_ROLES, TOOL_ROLES, ContextPlan, texts_of
from rag_opt.wire.errors import RewriteError
from rag_opt.wire.settings import WireSettings

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.types import OptimizeResult

__all__ = [
    "ANTHROPIC_BLOCKS",
    "QuestionSource",
    "Shape",
    "Turn",
    "find_turns",
    "message_shape",
    "tool_call_question",
]

Shape = Literal["openai", "anthropic"]
QuestionSource = Literal["user", "tool_call"]
ANTHROPIC_BLOCKS = frozenset({"tool_result", "tool_use", "document"})  # content blocks only Anthropic's API has
_Planner = Callable[[bytes, Mapping[str, str], WireSettings], ContextPlan]
_PLANNERS: dict[Shape, _Planner] = {"openai": plan_chat, "anthropic": plan_messages}


@dataclass
class Turn:
    """The messages read together (``indexes``: their positions in the conversation, in order) and the context
    their planner found in them; ``question_from``: where the question came from (None: there is none)."""

    indexes: list[int]
    messages: list[Any]
    plan: ContextPlan
    question_from: QuestionSource | None

    @property
    def context_messages(self) -> list[int]:
        """The positions (in the conversation) of the messages that hold this turn's context."""
        return sorted({self.indexes[int(c.path[1])] for c in self.plan.containers})

    def written(self, result: OptimizeResult) -> dict[int, Any]:
        """The messages ``result`` changes, by position in the conversation: each as the plan renders it (only
        its optimized texts differ). Raises :class:`~rag_opt.wire.errors.RewriteError` when it cannot be
        written back."""
        try:
            rendered = json.loads(self.plan.render(result))["messages"]
        except (ValueError, KeyError, TypeError) as exc:  # (render's own failures are RewriteErrors)
            raise RewriteError(f"the optimized messages could not be read back ({exc})") from None
        if not isinstance(rendered, list) or len(rendered) != len(self.messages):
            raise RewriteError("the optimized messages do not match the messages sent")
        return {i: new for i, new, old in zip(self.indexes, rendered, self.messages, strict=True) if new != old}


def _blocks(message: Any) -> list[dict[str, Any]]:
    content = message.get("content") if isinstance(message, dict) else None
    return [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []


def message_shape(messages: list[Any]) -> Shape:
    """``openai`` for OpenAI's chat messages (also plain text conversations, which read the same in both),
    ``anthropic`` when a message holds a block only Anthropic's Messages API has (:data:`ANTHROPIC_BLOCKS`) and
    none is an OpenAI tool message or tool call."""
    openai = any(
        isinstance(m, dict) and (m.get("role") in TOOL_ROLES or "tool_calls" in m or "function_call" in m)
        for m in messages
    )
    if openai:
        return "openai"
    anthropic = any(b.get("type") in ANTHROPIC_BLOCKS for m in messages for b in _blocks(m))
    return "anthropic" if anthropic else "openai"


def _asks(message: Any, shape: Shape) -> bool:
    """Whether ``message`` starts a turn: a user message (Anthropic: one with text, not only tool results)."""
    if not isinstance(message, dict) or message.get("role") != "user":
        return False
    return shape == "openai" or bool(texts_of(message.get("content"), ()))


def _groups(messages: list[Any], shape: Shape) -> list[list[int]]:
    """The messages of each turn (see the module docstring), in order; the system prompt goes to the last turn
    that has a user message (the first group when none has)."""
    system = {i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") in SYSTEM_ROLES}
    groups: list[list[int]] = [[]]
    for i, m in enumerate(messages):
        if i in system:
            continue
        if _asks(m, shape):
            groups.append([])
        groups[-1].append(i)
    asking = [g for g in groups if g and _asks(messages[g[0]], shape)]
    (asking[-1] if asking else groups[0]).extend(system)
    return [sorted(g) for g in groups if g]


def _strings(value: Any) -> list[str]:
    """The string values in ``value`` (a JSON value), depth first, in order."""
    out: list[str] = []
    stack: list[Any] = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, dict):
            stack.extend(reversed(list(v.values())))
        elif isinstance(v, list):
            stack.extend(reversed(v))
    return out


def _argument_text(arguments: Any) -> str:
    """A tool call's arguments as a question: their string values, one per line (OpenAI sends them as a JSON
    string; text that is not JSON is taken as it is; arguments without strings as compact JSON)."""
    value = arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments.strip()
    lines = [s.strip() for s in _strings(value) if s.strip()]
    if lines:
        return "\n".join(lines)
    return "" if value in (None, "", {}, []) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _tool_calls(messages: list[Any], before: int) -> list[tuple[str, Any]]:
    """The tool calls made before position ``before``, in order: (the id a result names, the arguments)."""
    calls: list[tuple[str, Any]] = []
    for m in messages[:before]:
        if not isinstance(m, dict) or m.get("role") != "assistant":
            continue
        tool_calls = m.get("tool_calls")
        for call in tool_calls if isinstance(tool_calls, list) else []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                calls.append((str(call.get("id")), function.get("arguments")))
        legacy = m.get("function_call")
        if isinstance(legacy, dict):
            calls.append((f"function:{legacy.get('name')}", legacy.get("arguments")))
        calls += [(str(b.get("id")), b.get("input")) for b in _blocks(m) if b.get("type") == "tool_use"]
    return calls


def _answered(message: Any) -> list[str]:
    """The ids of the tool calls ``message`` answers (an OpenAI tool message, Anthropic ``tool_result`` blocks)."""
    if not isinstance(message, dict):
        return []
    if message.get("role") == "tool":
        return [str(message.get("tool_call_id"))]
    if message.get("role") == "function":
        return [f"function:{message.get('name')}"]
    return [str(b.get("tool_use_id")) for b in _blocks(message) if b.get("type") == "tool_result"]


def tool_call_question(messages: list[Any], context: list[int]) -> str | None:
    """The question read from tool calls for the context in the messages at ``context`` (positions): the
    arguments of the calls those messages answer, else of the latest call before them; None without any."""
    if not context:
        return None
    calls = _tool_calls(messages, context[0])
    ids = {i for k in context for i in _answered(messages[k])}
    chosen = [args for call_id, args in calls if call_id in ids] or [args for _, args in calls[-1:]]
    texts = list(dict.fromkeys(t for t in map(_argument_text, chosen) if t))
    return "\n".join(texts) or None


def find_turns(messages: list[Any], headers: Mapping[str, str], settings: WireSettings) -> list[Turn]:
    """The turns of a conversation with their context, by the planner of its shape (see the module docstring).

    Raises :class:`~rag_opt.wire.errors.RequestError` for messages the planner refuses (a malformed message,
    an invalid ``x-ragopt-*`` header)."""
    shape = message_shape(messages)
    planner = _PLANNERS[shape]
    turns: list[Turn] = []
    for indexes in _groups(messages, shape):
        sent = [messages[i] for i in indexes]
        raw = json.dumps({"messages": sent}, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        plan = planner(raw, headers, settings)
        source: QuestionSource | None = "user" if plan.query is not None else None
        turn = Turn(indexes, sent, plan, source)
        if plan.documents and plan.query is None:
            plan.query = tool_call_question(messages, turn.context_messages)
            turn.question_from = "tool_call" if plan.query is not None else None
        turns.append(turn)
    return turns
