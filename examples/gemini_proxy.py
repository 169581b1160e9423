"""The official Gemini SDK (``google-genai``) through ``rag-opt serve``: the retrieved context of a
``generateContent`` request is compressed on its way to the Gemini API; the client code only changes its base URL.

Run it offline (rag-opt's app in this process, in front of a stub Gemini API that answers with what it received)::

    pip install -e '.[server]' google-genai
    python examples/gemini_proxy.py

against the real Gemini API (rag-opt still in this process; your key travels as the SDK sends it)::

    GEMINI_API_KEY=... RAG_OPT_GEMINI_UPSTREAM=https://generativelanguage.googleapis.com python examples/gemini_proxy.py

or through a running proxy (``rag-opt serve --upstream ... --port 8000``; its ``--gemini-upstream`` defaults to
Google's API)::

    GEMINI_API_KEY=... python examples/gemini_proxy.py --proxy http://127.0.0.1:8000

It sends the HotpotQA question of ``examples/hotpotqa_question.txt`` with its ten retrieved paragraphs as
``<document>`` blocks, prints rag-opt's ``x-ragopt-*`` headers and the answer, then streams a second answer.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from google import genai
from google.genai import types

HERE = Path(__file__).resolve().parent


async def stub_gemini(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A stand-in for the Gemini API: answers ``generateContent`` (and its SSE stream) with the number of
    characters of the request's text it received."""
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": message["type"] + ".complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    request = json.loads(body or b"{}")
    chars = sum(len(p.get("text", "")) for c in request.get("contents", []) for p in c.get("parts", []))
    words = ["(stub Gemini)", f" received {chars} characters", " of text."]

    def chunk(text: str, last: bool) -> bytes:
        candidate: dict[str, Any] = {"content": {"role": "model", "parts": [{"text": text}]}, "index": 0}
        if last:
            candidate["finishReason"] = "STOP"
        return json.dumps({"candidates": [candidate], "modelVersion": "stub"}).encode()

    if scope["path"].endswith(":streamGenerateContent"):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for i, word in enumerate(words):
            data = b"data: " + chunk(word, i == len(words) - 1) + b"\r\n\r\n"
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    data = chunk("".join(words), True)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """Serve an ASGI app on a free loopback port in a thread; yields its URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def in_process_proxy(gemini_upstream: str) -> Iterator[str]:
    """rag-opt's app (the embedded proxy model) in this process, in front of ``gemini_upstream``."""
    from rag_opt.server import ProxySettings, create_app

    settings = ProxySettings(upstream="http://127.0.0.1:9/v1", gemini_upstream=gemini_upstream, ratio=0.33)
    with serving(create_app(settings)) as url:
        while httpx.get(f"{url}/readyz").status_code != 200:  # the proxy model loads at start-up
            time.sleep(0.2)
        yield url


def ask(proxy: str, api_key: str, model: str) -> None:
    question = (HERE / "hotpotqa_question.txt").read_text(encoding="utf-8").strip()
    docs = [json.loads(line) for line in (HERE / "hotpotqa_docs.jsonl").read_text(encoding="utf-8").splitlines()]
    blocks = "\n".join(f'<document title="{d["title"]}">{d["text"]}</document>' for d in docs)
    # the only change to the client: its base URL (the SDK's api_version v1 works too)
    client = genai.Client(api_key=api_key, http_options=types.HttpOptions(base_url=proxy, api_version="v1beta"))
    config = types.GenerateContentConfig(system_instruction="Answer from the documents only.", temperature=0)
    response = client.models.generate_content(model=model, contents=f"{blocks}\n\n{question}", config=config)
    headers = response.sdk_http_response.headers if response.sdk_http_response else {}
    print(f"the client sent {len(blocks) + len(question) + 2} characters of text")
    print({k: v for k, v in (headers or {}).items() if k.startswith("x-ragopt-")})
    print(response.text)
    for chunk in client.models.generate_content_stream(model=model, contents=f"{blocks}\n\n{question}"):
        print(chunk.text, end="", flush=True)  # relayed chunk by chunk as the upstream sends them
    print()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--proxy", default=os.environ.get("RAG_OPT_PROXY_URL"), help="a running rag-opt serve's URL")
    p.add_argument("--model", default=os.environ.get("GEMINI_MODEL", "gemini-2.5-flash"))
    args = p.parse_args(argv)
    api_key = os.environ.get("GEMINI_API_KEY", "stub-key")
    if args.proxy:
        ask(args.proxy, api_key, args.model)
        return
    upstream = os.environ.get("RAG_OPT_GEMINI_UPSTREAM")
    if upstream:
        with in_process_proxy(upstream) as proxy:
            ask(proxy, api_key, args.model)
        return
    with serving(stub_gemini) as stub, in_process_proxy(stub) as proxy:
        ask(proxy, api_key, args.model)


if __name__ == "__main__":
    main()
