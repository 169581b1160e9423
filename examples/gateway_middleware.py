"""A gateway that calls rag-opt's compress sidecar before its own LLM call: a small ASGI middleware.

The gateway's route ``POST /answer`` takes ``{"question", "documents"}`` and builds the prompt for its LLM. The
middleware in front of it sends the question and documents to ``POST /v1/compress`` and hands the gateway the
kept text instead (fail-open: if the sidecar cannot be reached or fails, the documents pass unchanged). The
gateway's code does not change.

Run it (in-process: the sidecar is rag-opt's app on the embedded proxy model, the "LLM" a stub that reports the
prompt it got)::

    python examples/gateway_middleware.py

or against a running ``rag-opt serve --upstream ... --port 8000``::

    python examples/gateway_middleware.py --sidecar http://127.0.0.1:8000

Either way the gateway waits until the sidecar is ready (``GET /readyz``: its proxy model loaded) before its first
request, as a deployment's readiness check would: a request sent while the model loads gets the lexical tier, and
the model's loading must not eat the request's time budget (``--time-budget-ms``, 10 s by default). It prints the
prompt its LLM got with rag-opt and the same prompt built from the documents as sent, and the sidecar's ``status``,
``tier`` and, when it did not use the model, its ``reason``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("gateway")
HERE = Path(__file__).resolve().parent


class CompressContextMiddleware:
    """Before ``POST path`` reaches the app, replace its JSON body's ``documents`` by rag-opt's kept text.

    ``sidecar``: an ``httpx.AsyncClient`` whose base URL is the rag-opt server; ``options``: more fields of the
    compress request (``budget``, ``ordering``, ``target``, ``language``, ``tier``).
    """

    def __init__(self, app: ASGIApp, *, sidecar: httpx.AsyncClient, path: str = "/answer", **options: Any) -> None:
        self.app = app
        self.sidecar = sidecar
        self.path = path
        self.options = options

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.path:
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = await self.compressed(b"".join(chunks))
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return await receive()  # the client's disconnect, if it comes
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.app({**scope, "headers": headers}, replay, send)

    async def compressed(self, raw: bytes) -> bytes:
        """The body with its documents compressed (unchanged when the sidecar fails or it has none)."""
        try:
            payload = json.loads(raw)
            question, documents = payload["question"], payload["documents"]
        except (ValueError, KeyError, TypeError):
            return raw  # not ours to judge: the app answers it
        try:
            r = await self.sidecar.post(
                "/v1/compress", json={"question": question, "documents": documents, **self.options}
            )
            r.raise_for_status()
        except httpx.HTTPError as exc:
            logger.warning("the rag-opt sidecar failed (%s): documents passed unchanged", type(exc).__name__)
            return raw
        answer = r.json()
        payload["documents"] = [d["text"] for d in answer["documents"]]
        fields = ("status", "tier", "reason", "tokens_before", "tokens_after")
        payload["rag_opt"] = {k: answer[k] for k in fields if answer.get(k) is not None}
        return json.dumps(payload).encode()


def build_prompt(question: str, documents: list[str]) -> str:
    """The gateway's prompt for its LLM."""
    context = "\n\n".join(documents)
    return f"Answer from the context.\n\n{context}\n\nQuestion: {question}"


async def answer(request: Request) -> JSONResponse:
    """The gateway's own route: build the prompt and call its LLM (here a stub that reports the prompt)."""
    payload = await request.json()
    prompt = build_prompt(payload["question"], payload["documents"])
    return JSONResponse(
        {"prompt_chars": len(prompt), "documents": len(payload["documents"]), **payload.get("rag_opt", {})}
    )


def gateway(sidecar: httpx.AsyncClient, **options: Any) -> ASGIApp:
    """The gateway app with the middleware in front."""
    app = Starlette(routes=[Route("/answer", answer, methods=["POST"])])
    return CompressContextMiddleware(app, sidecar=sidecar, **options)


async def wait_ready(sidecar: httpx.AsyncClient, timeout_s: float = 600.0) -> bool:
    """Wait until the sidecar answers ``GET /readyz`` with 200 (its proxy model loaded, or pass-through settled);
    False when it did not within ``timeout_s`` (the gateway then goes on: the sidecar fails open)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if (await sidecar.get("/readyz")).status_code == 200:
                return True
        except httpx.HTTPError:
            pass  # not listening yet
        await asyncio.sleep(0.2)
    logger.warning("the rag-opt sidecar is not ready after %.0f s: going on (it fails open)", timeout_s)
    return False


@contextlib.asynccontextmanager
async def in_process_sidecar(**settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    """rag-opt's app, in this process (the upstream is never called by /v1/compress), started as ``rag-opt serve``
    starts it: its start-up (the lifespan) loads the proxy model in the background; ``settings``: other
    ``ProxySettings`` fields, e.g. ``time_budget_ms``."""
    from rag_opt.server import ProxySettings, create_app

    app = create_app(ProxySettings(**{"upstream": "http://127.0.0.1:9/v1", **settings}))
    async with app.router.lifespan_context(app):  # httpx's ASGI transport runs no lifespan: run it here
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=120) as client:
            yield client


async def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sidecar", help="a running rag-opt server's base URL (default: rag-opt in this process)")
    p.add_argument("--ratio", type=float, default=0.33)
    args = p.parse_args(argv)
    docs = [json.loads(line)["text"] for line in (HERE / "hotpotqa_docs.jsonl").read_text().splitlines() if line]
    question = (HERE / "hotpotqa_question.txt").read_text().strip()
    remote = httpx.AsyncClient(base_url=args.sidecar, timeout=120) if args.sidecar else None
    async with remote or in_process_sidecar() as sidecar:
        await wait_ready(sidecar)
        app = gateway(sidecar, budget={"ratio": args.ratio})
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
            r = await client.post("/answer", json={"question": question, "documents": docs}, timeout=120)
    out: dict[str, Any] = r.json()
    # the same prompt, built from the documents as sent: what the LLM would have got without rag-opt
    out["prompt_chars_without_rag_opt"] = len(build_prompt(question, docs))
    out["documents_without_rag_opt"] = len(docs)
    sys.stdout.write(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    asyncio.run(main())
