"""The gateway adapter (rag_opt.adapters.gateway) fails open where ``rag-opt serve`` does: a result that cannot be
written back into the request, or a request that cannot be rewritten unoptimized, goes on as it came (status
``fail_open``, reason ``error: <exception type>``, a warning naming the type and never the request's content);
under ``fail_closed`` both are a 503 :class:`GatewayError`, as a failed optimization is.

Runnable alone: ``python -m pytest tests/test_gateway_fail_open.py``. The gateway optimizes in-process with rag-opt's
real pipeline and the BM25 scorer (no proxy model, no sidecar); the failures are made by the planner's write-back
(``ContextPlan.render``, which the core calls) raising.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest

from rag_opt.adapters.gateway import GatewayError, GatewaySettings, RequestOptimizer
from rag_opt.compressors import BM25Scorer
from rag_opt.wire.documents import ContextPlan
from rag_opt.wire.errors import RewriteError
from tests.helpers import EXAMPLE_DOCS, EXAMPLE_QUESTION, blocks

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio"])]

LOGGER = "rag_opt.adapters.gateway"
SECRET = "Zq7-unlogged-marker"  # in the request's context: never in a log line
MESSAGES = [
    {"role": "system", "content": f"Answer from the documents ({SECRET}).\n" + blocks(EXAMPLE_DOCS)},
    {"role": "user", "content": EXAMPLE_QUESTION},
]
RENDER = ContextPlan.render  # the planner's own write-back


def _gateway(**options: Any) -> RequestOptimizer:
    return RequestOptimizer(GatewaySettings(optimizer={"scorer": BM25Scorer()}, warmup=False, **options))


def _body(**extra: Any) -> dict[str, Any]:
    return {"messages": copy.deepcopy(MESSAGES), **extra}


def _failing(monkeypatch: pytest.MonkeyPatch, results: bool = True, unoptimized: bool = False) -> list[Any]:
    """Make the write-back raise: of a result (``results``) and/or of the request unoptimized (``unoptimized``);
    returns what it was asked to write (a result, or None)."""
    asked: list[Any] = []

    def render(plan: ContextPlan, result: Any) -> bytes:
        asked.append(result)
        if (result is not None and results) or (result is None and unoptimized):
            raise RewriteError("optimizer result does not match the documents sent")
        return RENDER(plan, result)

    monkeypatch.setattr(ContextPlan, "render", render)
    return asked


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


async def test_the_optimization_writes_back_unpatched(anyio_backend: str) -> None:
    """(The baseline the failures below break: this request is optimized and written back.)"""
    outcome, new = await _gateway().rewrite("chat", _body(), {})
    assert outcome.status == "optimized" and outcome.tokens_after < outcome.tokens_before
    assert new is not None and new["messages"] != MESSAGES


async def test_a_result_not_written_back_forwards_the_original_messages(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    asked = _failing(monkeypatch)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    body = _body(rag_opt={"ratio": 0.4})
    outcome, new = await _gateway().rewrite("chat", body, {})
    assert asked and asked[0] is not None, "the optimizer gave a result, which could not be written back"
    assert (outcome.status, outcome.reason) == ("fail_open", "error: RewriteError")
    assert outcome.tokens_after == 0 and outcome.result is None
    assert new == {"messages": MESSAGES}  # as sent, less the rag_opt field
    (warning,) = _warnings(caplog)
    assert "writing the optimized context back failed" in warning and "error: RewriteError" in warning
    assert SECRET not in caplog.text and EXAMPLE_QUESTION not in caplog.text


async def test_a_request_not_rewritten_forwards_its_messages_as_sent(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Removing the rag_opt field (a bypassed request) fails: the original body goes on (None: unchanged; the
    guardrail removes the field itself)."""
    asked = _failing(monkeypatch, results=False, unoptimized=True)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    outcome, new = await _gateway().rewrite("chat", _body(rag_opt={"enabled": False}), {})
    assert asked == [None] and outcome.status == "disabled" and new is None
    (warning,) = _warnings(caplog)
    assert "rewriting the request failed" in warning and "error: RewriteError" in warning
    assert SECRET not in caplog.text


async def test_both_write_backs_failing_forward_the_original_body(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    asked = _failing(monkeypatch, results=True, unoptimized=True)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    outcome, new = await _gateway().rewrite("chat", _body(rag_opt={"ratio": 0.4}), {})
    assert len(asked) == 2 and asked[0] is not None and asked[1] is None
    assert (outcome.status, outcome.reason, new) == ("fail_open", "error: RewriteError", None)
    assert len(_warnings(caplog)) == 2 and SECRET not in caplog.text


@pytest.mark.parametrize("failing", ["result", "unoptimized"])
async def test_fail_closed_refuses_what_cannot_be_written(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    _failing(monkeypatch, results=failing == "result", unoptimized=failing == "unoptimized")
    body = _body(rag_opt={"ratio": 0.4} if failing == "result" else {"enabled": False})
    with pytest.raises(GatewayError) as info:
        await _gateway(fail_closed=True).rewrite("chat", body, {})
    assert (info.value.status_code, info.value.code) == (503, "ragopt_unavailable")
    assert "error: RewriteError" in info.value.message and "fail-closed" in info.value.message
