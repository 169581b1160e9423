"""``rag-opt mcp`` end to end: the ``mcp`` client spawns the server over stdio and calls ``optimize_context``."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import hotpot_dev, hotpot_docs

pytest.importorskip("mcp.server.mcpserver", reason="the mcp extra (mcp 2) is not installed: pip install -e '.[mcp]'")

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.model


async def _session(log: Any, calls: list[tuple[str, dict[str, Any]]]) -> tuple[Any, list[Any]]:
    from mcp import ClientSession, StdioServerParameters, stdio_client

    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "rag_opt.cli", "mcp", "--ratio", "0.5", "--ordering", "input"],  # in-process runs compare below
        env={
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        },
        cwd=str(ROOT),
    )
    async with stdio_client(params, errlog=log) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        tools = await session.list_tools()
        results = [await session.call_tool(name, args, read_timeout_seconds=300) for name, args in calls]
    return tools, results


def _text(result: Any) -> str:
    return " ".join(getattr(c, "text", "") for c in result.content)


def test_the_optimize_context_tool_over_stdio(tmp_path):
    from rag_opt import optimize

    ex = hotpot_dev(1)[0]
    question, docs = ex["question"], hotpot_docs(ex)
    mixed = [docs[0]["text"], {"text": docs[1]["text"], "id": 7}, *docs[2:]]
    calls = [
        ("optimize_context", {"question": question, "documents": docs, "ratio": 0.33}),
        ("optimize_context", {"question": question, "documents": docs, "target_tokens": 200}),
        ("optimize_context", {"question": question, "documents": mixed}),  # the server's default ratio (0.5)
        ("optimize_context", {"question": question, "documents": docs, "ratio": 1.5}),
        ("optimize_context", {"question": question, "documents": docs, "ratio": 0.5, "target_tokens": 100}),
        ("optimize_context", {"question": "  ", "documents": docs}),
        ("optimize_context", {"question": question, "documents": [{"text": ""}]}),
        ("optimize_context", {"question": question, "documents": [{"txt": "a typo"}]}),
        ("optimize_context", {"question": question, "documents": "not a list"}),
        ("optimize_context", {"documents": docs}),
    ]
    with open(tmp_path / "server.log", "w") as log:
        tools, results = asyncio.run(_session(log, calls))
    server_log = (tmp_path / "server.log").read_text()

    (tool,) = tools.tools
    assert tool.name == "optimize_context"
    assert {"question", "documents", "ratio", "target_tokens"} <= set(tool.input_schema["properties"])
    assert set(tool.input_schema["required"]) == {"question", "documents"}

    ok = results[:3]
    assert not any(r.is_error for r in ok), [_text(r) for r in ok] + [server_log]
    for r, expected in zip(
        ok,
        [
            optimize(question, docs, ratio=0.33, ordering="input"),
            optimize(question, docs, target_tokens=200, ordering="input"),
            optimize(question, mixed, ratio=0.5, ordering="input"),
        ],
        strict=True,
    ):
        out = r.structured_content
        assert out["context"] == expected.context()
        assert (out["tokens_before"], out["tokens_after"]) == (expected.tokens_before, expected.tokens_after)
        assert [d["id"] for d in out["documents"]] == [d.id for d in expected.documents]
        assert json.loads(_text(r)) == out  # the same result as text content, for clients that read only text
    assert ok[0].structured_content["tokens_after"] <= 0.33 * ok[0].structured_content["tokens_before"]
    assert ok[1].structured_content["tokens_after"] <= 200
    assert docs[0]["title"] not in [d["id"] for d in ok[2].structured_content["documents"]]  # string → index id
    assert "7" in [d["id"] for d in ok[2].structured_content["documents"]] + ok[2].structured_content["dropped_ids"]

    errors = [(r.is_error, _text(r)) for r in results[3:]]
    assert all(is_error for is_error, _ in errors), errors
    messages = [m for _, m in errors]
    assert messages[0].endswith("ratio must be in (0, 1], got 1.5")
    assert "give at most one of ratio, target_tokens and threshold" in messages[1]
    assert messages[2].endswith("question is empty")
    assert "documents[0] is empty" in messages[3]
    assert "documents[0]: unknown field(s) ['txt']; expected text" in messages[4]
    assert "documents" in messages[5] and "valid list" in messages[5]  # the SDK's schema validation
    assert "question" in messages[6] and "Field required" in messages[6]
    assert "Traceback" not in server_log
