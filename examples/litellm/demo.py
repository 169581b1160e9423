"""rag-opt as a LiteLLM guardrail, end to end on this machine (nothing leaves it).

    pip install -e '.[litellm]'
    python examples/litellm/demo.py

It starts ``litellm --config examples/litellm/config.yaml`` (the rag-opt guardrail in front of a loopback stand-in
for the LLM), sends one real HotpotQA question with its ten retrieved paragraphs as ``<document>`` blocks through it
with the official ``openai`` SDK, and prints rag-opt's ``x-ragopt-*`` response headers and the context the LLM
received. Against a real server, run ``litellm`` with the same config yourself (see its first lines).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent
received: list[dict[str, Any]] = []


async def stand_in_llm(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An OpenAI-compatible chat completions endpoint that records what it gets and answers "ok"."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if not scope["path"].endswith("/chat/completions"):  # (LiteLLM may look at other routes: none here)
        await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"error": {"message": "not found"}}'})
        return
    received.append(json.loads(body))
    choice = {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
    answer = {"id": "demo", "object": "chat.completion", "created": 0, "model": "demo-llm", "choices": [choice]}
    data = json.dumps(answer).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": data})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    llm_port, port, key = free_port(), free_port(), "sk-" + secrets.token_hex(16)
    server = uvicorn.Server(uvicorn.Config(stand_in_llm, host="127.0.0.1", port=llm_port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    env = {
        **os.environ,
        "UPSTREAM_API_BASE": f"http://127.0.0.1:{llm_port}/v1",
        "UPSTREAM_API_KEY": "none",
        "LITELLM_MASTER_KEY": key,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # offline: LiteLLM's bundled price list
    }
    litellm = Path(sys.executable).with_name("litellm")
    cmd = [str(litellm), "--config", str(HERE / "config.yaml"), "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        print("starting LiteLLM (tens of seconds) ...")
        while True:
            if proc.poll() is not None:
                sys.exit(f"litellm exited ({proc.returncode}): run the command above to see why")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health/liveliness", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        docs = [json.loads(line) for line in (EXAMPLES / "hotpotqa_docs.jsonl").read_text().splitlines() if line]
        question = (EXAMPLES / "hotpotqa_question.txt").read_text().strip()
        context = "\n".join(f'<document id="{d["id"]}" title="{d["title"]}">\n{d["text"]}\n</document>' for d in docs)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=600)
        raw = client.chat.completions.with_raw_response.create(
            model="demo-llm",
            messages=[
                {"role": "system", "content": "Answer from the documents.\n" + context},
                {"role": "user", "content": question},
            ],
            temperature=0,
        )
        print("answer:", raw.parse().choices[0].message.content)
        for name, value in raw.headers.items():
            if name.startswith("x-ragopt-") or name == "x-litellm-applied-guardrails":
                print(f"{name}: {value}")
        sent = received[-1]["messages"][0]["content"]
        print(f"\ncontext sent to the LLM ({len(sent)} characters, {len(context)} retrieved):\n{sent}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        server.should_exit = True


if __name__ == "__main__":
    main()
