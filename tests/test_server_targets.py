"""The target tokenizers a ``/v1/compress`` request may name: only the allow-list (``--allowed-targets``; default
the bundled encodings and ``--target``) ever loads, and any other name is refused before anything is loaded or
fetched, with a message that names no server path. On the real app (httpx's ASGI transport), lexical tier (no
proxy model needed: the target check comes first)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tiktoken.load

from rag_opt.server.app import create_app
from rag_opt.server.settings import ProxySettings
from rag_opt.server.settings_cli import add_settings_arguments, settings_from_args
from rag_opt.text import tokens
from rag_opt.text.tokens import get_token_counter
from tests.helpers import EXAMPLE_DOCS, EXAMPLE_QUESTION

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def optimizer() -> Any:
    from rag_opt import ContextOptimizer

    return ContextOptimizer()


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Everything that loads or fetches a tokenizer is recorded (the network, tiktoken's downloads, the builds of
    the tokenizer cache); the network raises. The cache starts empty."""
    seen: list[str] = []
    build = tokens._build_counter

    def no_network(*args: Any, **kwargs: Any) -> Any:
        seen.append(f"network {args[1:2]}")
        raise ConnectionError("network disabled in this test")

    def download(blobpath: str) -> bytes:
        seen.append(f"download {blobpath}")
        raise ConnectionError("network disabled in this test")

    def recorded_build(key: str) -> Any:
        seen.append(f"build {key}")
        return build(key)

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", no_network)
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: no_network(None, a))
    monkeypatch.setattr(tiktoken.load, "read_file", download)
    monkeypatch.setattr(tokens, "_build_counter", recorded_build)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # as on a server with the network: the hub would be tried
    get_token_counter.cache_clear()
    yield seen
    get_token_counter.cache_clear()


@pytest.fixture
def make_client() -> Iterator[Any]:
    apps: list[Any] = []

    def make(optimizer: Any, **settings: Any) -> httpx.AsyncClient:
        values = {"upstream": "http://127.0.0.1:9/v1", "warmup": False, **settings}
        app = create_app(ProxySettings(**values), optimizer=optimizer)
        apps.append(app)
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000")

    yield make
    for app in apps:
        app.state.ragopt.pool.shutdown()


def body(target: str) -> dict[str, Any]:
    docs = [{"text": d["text"], "id": d["id"]} for d in EXAMPLE_DOCS[:3]]
    return {"question": EXAMPLE_QUESTION, "documents": docs, "target": target, "tier": "lexical"}


async def test_a_target_not_allowed_is_refused_before_anything_loads(
    make_client: Any, optimizer: Any, loads: list[str]
) -> None:
    refused = [
        "p50k_base",  # a tiktoken encoding that is downloaded on first use
        "text-davinci-003",  # an OpenAI model of that encoding
        "r50k_base",
        "hf:gpt2",  # a hub tokenizer
        "hf:openai-community/gpt2",
        "hf:~/.ssh",
        "hf:/etc",
        "hf:/no/such/folder",
        "hf:../../etc",
        "my-llama",  # unknown names are not counted as o200k_base here: they are not allowed
        "",
        "x" * 100_000,
    ]
    messages = {}
    async with make_client(optimizer) as client:
        for target in refused:
            r = await client.post("/v1/compress", json=body(target))
            assert loads == [], target[:40]  # nothing was loaded, downloaded or connected to
            assert r.status_code == 400, (target[:40], r.text[:300])
            error = r.json()["error"]
            assert error["param"] == "target"
            messages[target] = error["message"]
    assert get_token_counter.cache_info().currsize == 0
    # the message is the same whichever path was named (it tells nothing about the server's files) and
    # names no server path
    shapes = {messages[t].replace(repr(t), "NAME") for t in ("hf:~/.ssh", "hf:/etc", "hf:/no/such/folder")}
    assert len(shapes) == 1
    home = os.path.expanduser("~")
    for target, message in messages.items():
        assert home not in message.replace(target, "")
        assert "directory" not in message and "No such" not in message
        assert len(message) < 400  # a 100,000-character name is not echoed back whole
    assert "o200k_base, cl100k_base" in messages["p50k_base"]


async def test_allowed_targets_and_the_model_names_of_their_encodings_are_served(
    make_client: Any, optimizer: Any, loads: list[str]
) -> None:
    async with make_client(optimizer) as client:
        for target, encoding in [("cl100k_base", "cl100k_base"), ("gpt-4", "cl100k_base"), ("gpt-4o", "o200k_base")]:
            r = await client.post("/v1/compress", json=body(target))
            assert r.status_code == 200, r.text[:300]
            assert r.json()["target_tokenizer"] == encoding
    assert [x for x in loads if not x.startswith("build")] == []  # bundled: no network
    assert sorted(loads) == ["build cl100k_base", "build o200k_base"]  # each loaded once


async def test_the_allow_list_flag(
    make_client: Any, optimizer: Any, loads: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "the": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    mine, broken = f"hf:{tmp_path}", f"hf:{tmp_path / 'missing'}"
    async with make_client(optimizer, allowed_targets=f"{mine}, {broken}", target="gpt-4") as client:
        r = await client.post("/v1/compress", json=body(mine))
        assert r.status_code == 200 and r.json()["target_tokenizer"] == mine
        r = await client.post("/v1/compress", json=body("gpt-4"))  # the server's own --target is always allowed
        assert r.status_code == 200 and r.json()["target_tokenizer"] == "cl100k_base"
        for other in [f"{mine}/", "o200k_base"]:  # another spelling, an encoding not listed
            r = await client.post("/v1/compress", json=body(other))
            assert r.status_code == 400 and "not a tokenizer this server allows" in r.json()["error"]["message"]
            assert "hf: tokenizers of the operator's choosing" in r.json()["error"]["message"]
            assert str(tmp_path) not in r.json()["error"]["message"].replace(other, "")
        for _ in range(2):  # allowed, but it cannot load: refused without the cause, and not tried again
            r = await client.post("/v1/compress", json=body(broken))
            assert r.status_code == 400
            assert "could not be loaded" in r.json()["error"]["message"]
            assert "directory" not in r.json()["error"]["message"]
    assert loads.count(f"build {broken}") == 1
    assert [x for x in loads if not x.startswith("build")] == []


def test_allowed_targets_from_the_command_line_and_the_environment() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    args = parser.parse_args(["--upstream", "http://x/v1", "--allowed-targets", "gpt-4o,hf:org/tok"])
    assert settings_from_args(args, env={}).allowed_targets == "gpt-4o,hf:org/tok"
    args = parser.parse_args(["--upstream", "http://x/v1"])
    assert settings_from_args(args, env={"RAG_OPT_ALLOWED_TARGETS": "cl100k_base"}).allowed_targets == "cl100k_base"
    with pytest.raises(ValueError, match="at least one tokenizer"):
        ProxySettings(upstream="http://x/v1", allowed_targets=" , ")
