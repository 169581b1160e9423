"""The sidecar clients against the real app: the LangChain compressor and runnable over HTTP (uvicorn on
127.0.0.1), and the ASGI middleware example (examples/gateway_middleware.py) through httpx's ASGI transport."""

from __future__ import annotations

import functools
import importlib.util
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from langchain_core.documents import Document as LCDocument

from rag_opt.adapters.sidecar import RemoteContextOptimizer, SidecarCompressor, SidecarError
from rag_opt.server.app import create_app
from rag_opt.server.settings import ProxySettings
from rag_opt.text.units import join_spans
from tests.helpers import EXAMPLE_DOCS, EXAMPLE_QUESTION
from tests.upstream_server import ServerThread

pytestmark = [pytest.mark.anyio, pytest.mark.model]

# a client timeout no machine load reaches (the first call loads the model): these tests check what the sidecar
# returns, never how fast the machine is
SLOW_OK = 600.0
ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    LCDocument(page_content=d["text"], id=d["id"], metadata={"title": d["title"], "k": i})
    for i, d in enumerate(EXAMPLE_DOCS[:4])
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def app() -> Iterator[Any]:
    from rag_opt import ContextOptimizer

    settings = ProxySettings(
        upstream="http://127.0.0.1:9/v1", warmup=False, time_budget_ms=86_400_000.0, api_key="s3cret-sidecar16"
    )
    application = create_app(settings, optimizer=ContextOptimizer())
    yield application
    application.state.ragopt.pool.shutdown()


@pytest.fixture(scope="module")
def url(app: Any) -> Iterator[str]:
    with ServerThread(app) as server:
        yield server.url


def check(out: list[LCDocument], budget_tokens: int) -> None:
    assert out and len(out) <= len(DOCS)
    by_id = {d.id: d for d in DOCS}
    for rank, doc in enumerate(out):
        info = doc.metadata["rag_opt"]
        source = by_id[doc.id]
        assert info["rank"] == rank and info["status"] == "optimized" and info["tier"] == "model"
        assert doc.metadata["k"] == source.metadata["k"] and doc.metadata["title"] == source.metadata["title"]
        assert doc.page_content == join_spans(source.page_content, [tuple(s) for s in info["kept_spans"]])
    assert sum(d.metadata["rag_opt"]["tokens_after"] for d in out) <= budget_tokens


def test_compressor_sync_over_http(url: str) -> None:
    comp = SidecarCompressor(url=url, api_key="s3cret-sidecar16", budget={"target_tokens": 120}, timeout=SLOW_OK)
    check(list(comp.compress_documents(DOCS, EXAMPLE_QUESTION)), 120)


async def test_compressor_and_runnable_async_over_http(url: str) -> None:
    comp = SidecarCompressor(
        url=url, api_key="s3cret-sidecar16", budget={"target_tokens": 100}, ordering="relevance", timeout=SLOW_OK
    )
    check(list(await comp.acompress_documents(DOCS, EXAMPLE_QUESTION)), 100)
    runnable = RemoteContextOptimizer(
        url=url, api_key="s3cret-sidecar16", budget={"target_tokens": 100}, timeout=SLOW_OK
    )
    out = await runnable.ainvoke({"question": EXAMPLE_QUESTION, "documents": DOCS})
    check(out, 100)
    assert [d.page_content for d in runnable.invoke({"question": EXAMPLE_QUESTION, "documents": DOCS})] == [
        d.page_content for d in out
    ]


def test_refusals_raise_and_failures_fail_open(url: str) -> None:
    with pytest.raises(SidecarError) as exc:
        SidecarCompressor(url=url, api_key="wrong").compress_documents(DOCS, EXAMPLE_QUESTION)
    assert exc.value.status == 401
    with pytest.raises(SidecarError, match="ISO 639") as exc:
        SidecarCompressor(url=url, api_key="s3cret-sidecar16", language="??").compress_documents(DOCS, EXAMPLE_QUESTION)
    assert exc.value.status == 400
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert list(SidecarCompressor(url=dead, timeout=5).compress_documents(DOCS, EXAMPLE_QUESTION)) == DOCS
    with pytest.raises(SidecarError):
        SidecarCompressor(url=dead, timeout=5, fail_open=False).compress_documents(DOCS, EXAMPLE_QUESTION)


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("gateway_middleware", ROOT / "examples" / "gateway_middleware.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_gateway_middleware_compresses_before_the_llm_call(app: Any) -> None:
    example = _example()
    texts = [d.page_content for d in DOCS]
    sidecar = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://127.0.0.1",
        headers={"x-ragopt-api-key": "s3cret-sidecar16"},
    )
    async with sidecar:
        gw = example.gateway(sidecar, budget={"ratio": 0.3})
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gw), base_url="http://gw") as client:
            r = await client.post("/answer", json={"question": EXAMPLE_QUESTION, "documents": texts})
            plain = await client.post("/other", json={})  # other routes are not touched
    out = r.json()
    assert r.status_code == 200 and out["status"] == "optimized" and out["tokens_after"] < out["tokens_before"]
    assert out["prompt_chars"] < sum(map(len, texts)) and plain.status_code == 404
    dead = httpx.AsyncClient(base_url="http://127.0.0.1:9")  # fail-open: the gateway still answers
    async with dead:
        gw = example.gateway(dead)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gw), base_url="http://gw") as client:
            r = await client.post("/answer", json={"question": EXAMPLE_QUESTION, "documents": texts})
    assert r.status_code == 200 and r.json()["documents"] == len(texts) and "status" not in r.json()


async def test_gateway_example_main_runs_in_process() -> None:
    example = _example()
    # the example's in-process sidecar starts as rag-opt serve does: the model loads at start-up, and the gateway
    # waits for /readyz before its first request (a request during the load would get the lexical tier, and the
    # load would eat its time budget: the example once ended fail_open)
    async with example.in_process_sidecar() as sidecar:
        assert await example.wait_ready(sidecar)
        health = (await sidecar.get("/healthz")).json()
        assert health["optimizer"] == "ready"
    # main, with a time budget no machine load reaches: the test checks what the example does, never how fast the
    # machine is
    example.in_process_sidecar = functools.partial(example.in_process_sidecar, time_budget_ms=86_400_000.0)
    out = await example.main(["--ratio", "0.3"])
    assert out["status"] == "optimized" and out["tier"] == "model" and "reason" not in out
    # the comparison is like for like: the same prompt, built from the documents as sent
    docs = [json.loads(line)["text"] for line in (ROOT / "examples" / "hotpotqa_docs.jsonl").read_text().splitlines()]
    question = (ROOT / "examples" / "hotpotqa_question.txt").read_text().strip()
    assert out["prompt_chars_without_rag_opt"] == len(example.build_prompt(question, docs))
    assert out["documents_without_rag_opt"] == len(docs) >= out["documents"]
    assert out["prompt_chars"] < out["prompt_chars_without_rag_opt"]
