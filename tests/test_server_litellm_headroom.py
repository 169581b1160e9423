"""A real client of ``POST /v1/compress``'s messages contract: LiteLLM's own ``guardrail: headroom`` (from the
installed litellm), in a LiteLLM proxy started by the test (``litellm --config`` in a subprocess), pointed at a real
``rag-opt serve`` app (its key passed as LiteLLM's guardrail ``api_key``), with the loopback recording upstream
(tests/upstream_server.py) as the LLM. Nothing leaves the machine.

LiteLLM sends the compressor only the rows it lets it rewrite: it holds back the system messages, the last user
message, every assistant message and the tool exchange of the last assistant message, and puts them back in place.
So an earlier turn's tool result is sent with the user question before it, and reaches the upstream shorter; a
request whose rows hold no question comes back as sent."""

from __future__ import annotations

import copy
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM would fetch its price list at import
pytest.importorskip("litellm", reason="LiteLLM is not installed (pip install -e '.[litellm]')")
pytest.importorskip("fastapi", reason="LiteLLM's proxy is not installed (pip install -e '.[litellm]')")
openai = pytest.importorskip("openai", reason="the openai SDK is not installed (pip install -e '.[dev]')")

import httpx  # noqa: E402

from tests.helpers import assert_verbatim, hotpot_dev  # noqa: E402
from tests.upstream_server import UNLIMITED_MS, FakeUpstream, ServerThread, parse_metrics  # noqa: E402

pytestmark = [pytest.mark.model, pytest.mark.data, pytest.mark.slow]
LITELLM = Path(sys.executable).with_name("litellm")
KEY = "sk-" + secrets.token_hex(16)  # LiteLLM's master key
RAGOPT_KEY = "rk-" + secrets.token_hex(16)  # rag-opt serve's --api-key, LiteLLM's guardrail api_key


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(upstream: str, ragopt: str, dead: str) -> str:
    common = {"guardrail": "headroom", "mode": "pre_call", "default_on": False, "timeout": 600}
    guardrails = {
        "headroom": {"api_base": ragopt, "api_key": RAGOPT_KEY},
        "headroom-down": {"api_base": dead},  # LiteLLM's default: fail closed (a 502)
        "headroom-down-open": {"api_base": dead, "unreachable_fallback": "fail_open"},
    }
    config = {
        "model_list": [
            {
                "model_name": "fake-llm",
                "litellm_params": {"model": "openai/fake-llm", "api_base": f"{upstream}/v1", "api_key": "sk-up"},
            }
        ],
        "guardrails": [
            {"guardrail_name": name, "litellm_params": {**common, **params}} for name, params in guardrails.items()
        ],
        "general_settings": {"master_key": KEY},
    }
    return json.dumps(config, indent=2)  # (JSON is YAML)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[FakeUpstream, str]]:
    """The loopback recording upstream and its URL."""
    app = FakeUpstream()
    with ServerThread(app) as server:
        yield app, server.url


@pytest.fixture(scope="module")
def ragopt() -> Iterator[tuple[str, Any]]:
    """A real ``rag-opt serve`` app with the embedded proxy model (loaded at start-up) and an API key; yields its
    URL and its state."""
    from rag_opt import ContextOptimizer
    from rag_opt.server.app import create_app
    from rag_opt.server.settings import ProxySettings

    hotpot_dev(1)  # skips now, before anything starts, without the real data
    settings = ProxySettings(upstream="http://127.0.0.1:9/v1", time_budget_ms=UNLIMITED_MS, api_key=RAGOPT_KEY)
    app = create_app(settings, optimizer=ContextOptimizer())
    with ServerThread(app) as server:
        yield server.url, app.state.ragopt
    app.state.ragopt.pool.shutdown()


@pytest.fixture(scope="module")
def proxy(
    served: tuple[FakeUpstream, str], ragopt: tuple[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The LiteLLM proxy (``litellm --config``) with LiteLLM's headroom guardrail pointed at rag-opt; its URL.
    Yields once the proxy answers and rag-opt's model has loaded (they start side by side)."""
    if not LITELLM.exists():
        pytest.skip(f"the litellm command is not installed next to {sys.executable} (pip install -e '.[litellm]')")
    folder = tmp_path_factory.mktemp("litellm-headroom")
    (folder / "config.yaml").write_text(_config(served[1], ragopt[0], f"http://127.0.0.1:{_free_port()}"))
    out = folder / "litellm.log"
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "LITELLM_MASTER_KEY")}
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_TELEMETRY="False")
    cmd = [str(LITELLM), "--config", "config.yaml", "--host", "127.0.0.1", "--port", str(port)]
    with open(out, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=fh, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the LiteLLM proxy did not start:\n{out.read_text(errors='replace')[-4000:]}")
            try:
                if httpx.get(f"{url}/health/liveliness", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        while ragopt[1].optimizer_state not in ("ready", "failed"):  # the model loads in the background
            assert time.monotonic() < deadline, "rag-opt's proxy model did not load"
            time.sleep(0.5)
        assert ragopt[1].optimizer_state == "ready"
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def client(proxy: str) -> Any:
    return openai.OpenAI(base_url=proxy + "/v1", api_key=KEY, max_retries=0, timeout=UNLIMITED_MS / 1e3)


@pytest.fixture(scope="module")
def held_out() -> tuple[str, str]:
    """A held-out (dev) HotpotQA question and its 10 paragraphs as one search tool's result."""
    ex = hotpot_dev(1)[0]
    assert len(ex["context"]) == 10
    return ex["question"], "\n\n".join(f"{title}\n{''.join(sents)}" for title, sents in ex["context"])


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _chat(client: Any, messages: list[dict[str, Any]], guardrail: str | None) -> Any:
    """One chat completion through LiteLLM (``guardrail``: the one to run); the raw response."""
    body = {"guardrails": [guardrail]} if guardrail else {}
    return client.chat.completions.with_raw_response.create(
        model="fake-llm", messages=messages, max_tokens=32, extra_body=body
    )


def _sent(upstream: FakeUpstream) -> dict[str, Any]:
    body: dict[str, Any] = upstream.last().json()
    return body


def _outcomes(ragopt: tuple[str, Any]) -> dict[str, float]:
    r = httpx.get(ragopt[0] + "/metrics", headers={"authorization": f"Bearer {RAGOPT_KEY}"})
    m = parse_metrics(r.text)
    return {k.split('"')[1]: v for k, v in m.items() if k.startswith("ragopt_compress_requests_total{")}


def test_an_earlier_tool_result_reaches_the_upstream_shorter(
    client: Any, served: tuple[FakeUpstream, str], ragopt: tuple[str, Any], held_out: tuple[str, str]
) -> None:
    """A multi-turn RAG conversation: the first question's search result (10 held-out paragraphs) is compressed
    by that question; the follow-up (the last user message), the system prompt and the assistant turns are held
    back by LiteLLM, and every message but the tool result reaches the upstream as LiteLLM would send it."""
    upstream = served[0]
    question, paragraphs = held_out
    messages = [
        {"role": "system", "content": "Answer from the search results."},
        {"role": "user", "content": [{"type": "text", "text": question}]},
        {"role": "assistant", "content": None, "tool_calls": [_call("call_1", "search", {"query": question})]},
        {"role": "tool", "tool_call_id": "call_1", "content": paragraphs},
        {"role": "assistant", "content": "From the results: see above."},
        {"role": "user", "content": "Thanks. Which of them is older?"},
    ]
    sent = copy.deepcopy(messages)
    _chat(client, messages, None)
    baseline = _sent(upstream)  # what LiteLLM sends without the guardrail
    before = _outcomes(ragopt)
    raw = _chat(client, messages, "headroom")
    assert raw.parse().choices[0].message.content == "ok"
    got = _sent(upstream)
    assert {k: v for k, v in got.items() if k != "messages"} == {k: v for k, v in baseline.items() if k != "messages"}
    assert len(got["messages"]) == len(baseline["messages"]) == len(sent)
    assert [m for i, m in enumerate(got["messages"]) if i != 3] == [
        m for i, m in enumerate(baseline["messages"]) if i != 3
    ]
    assert got["messages"][1]["content"] == sent[1]["content"] and got["messages"][5] == sent[5]
    tool = got["messages"][3]
    assert {k: v for k, v in tool.items() if k != "content"} == {"role": "tool", "tool_call_id": "call_1"}
    assert isinstance(tool["content"], str) and len(tool["content"]) <= 0.8 * len(paragraphs)
    assert_verbatim(tool["content"].strip(), paragraphs)
    assert "headroom" in raw.headers.get("x-litellm-applied-guardrails", "")
    after = _outcomes(ragopt)
    assert after["optimized"] == before["optimized"] + 1  # rag-opt answered it, with the key LiteLLM passed


def test_rows_without_a_question_pass_through_unchanged(
    client: Any, served: tuple[FakeUpstream, str], ragopt: tuple[str, Any], held_out: tuple[str, str]
) -> None:
    """An agent loop: the user's question (the last user message) and the tool calls (assistant messages) are
    held back, so LiteLLM sends only the first tool result, which holds no question: rag-opt returns it as sent
    (no_query) and the upstream gets the request as without the guardrail."""
    upstream = served[0]
    question, paragraphs = held_out
    messages = [
        {"role": "system", "content": "Answer from the search results."},
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [_call("call_1", "search", {"query": question})]},
        {"role": "tool", "tool_call_id": "call_1", "content": paragraphs},
        {"role": "assistant", "content": None, "tool_calls": [_call("call_2", "lookup", {"title": "x"})]},
        {"role": "tool", "tool_call_id": "call_2", "content": "nothing found"},
    ]
    _chat(client, messages, None)
    baseline = _sent(upstream)
    before = _outcomes(ragopt)
    raw = _chat(client, messages, "headroom")
    assert raw.parse().choices[0].message.content == "ok"
    assert _sent(upstream) == baseline
    after = _outcomes(ragopt)
    assert after["no_query"] == before["no_query"] + 1  # rag-opt was asked, and had nothing to read it by


def test_with_rag_opt_down_litellm_follows_its_own_fail_open_setting(
    client: Any, served: tuple[FakeUpstream, str], held_out: tuple[str, str]
) -> None:
    """LiteLLM's default for an unreachable compressor is a 502 (the upstream is not called); with
    ``unreachable_fallback: fail_open`` the request goes on as sent."""
    upstream = served[0]
    question, paragraphs = held_out
    messages = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [_call("call_1", "search", {"query": question})]},
        {"role": "tool", "tool_call_id": "call_1", "content": paragraphs},
        {"role": "assistant", "content": "See above."},
        {"role": "user", "content": "And the other one?"},
    ]
    _chat(client, messages, None)
    baseline = _sent(upstream)
    n = len(upstream.requests)
    with pytest.raises(openai.APIStatusError) as info:
        _chat(client, messages, "headroom-down")
    assert info.value.status_code == 502 and len(upstream.requests) == n
    raw = _chat(client, messages, "headroom-down-open")
    assert raw.parse().choices[0].message.content == "ok" and _sent(upstream) == baseline
