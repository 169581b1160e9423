"""Call rag-opt's MCP tool the way an agent does: the ``mcp`` client starts ``rag-opt mcp`` over stdio.

    pip install -e '.[mcp]'
    python examples/mcp_client.py            # compresses the HotpotQA example to a third of its tokens

It lists the server's tools, calls ``optimize_context`` with the question and the ten retrieved paragraphs of
``examples/hotpotqa_docs.jsonl``, prints the optimized context and the token counts, then shows the tool error
a bad argument gets.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from mcp import ClientSession, StdioServerParameters, stdio_client

HERE = Path(__file__).resolve().parent


async def main() -> None:
    question = (HERE / "hotpotqa_question.txt").read_text(encoding="utf-8").strip()
    documents = [json.loads(line) for line in (HERE / "hotpotqa_docs.jsonl").read_text(encoding="utf-8").splitlines()]
    server = StdioServerParameters(
        command=sys.executable,
        args=["-m", "rag_opt.cli", "mcp", "--ratio", "0.5"],  # the same as `rag-opt mcp --ratio 0.5`
        env={k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "OMP_NUM_THREADS", "RAG_OPT_CACHE_DIR")},
    )
    async with stdio_client(server) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        tools = await session.list_tools()
        print("tools:", [t.name for t in tools.tools])
        result = await session.call_tool(
            "optimize_context", {"question": question, "documents": documents, "ratio": 0.33}
        )
        out = result.structured_content
        print(out["context"])
        print(
            f"\n{out['tokens_before']} -> {out['tokens_after']} tokens ({out['target_tokenizer']}), "
            f"{len(out['documents'])} of {len(documents)} documents kept"
        )
        bad = await session.call_tool("optimize_context", {"question": question, "documents": documents, "ratio": 2})
        print("a bad argument:", bad.is_error, bad.content[0].text)


if __name__ == "__main__":
    asyncio.run(main())
