"""The LiteLLM guardrail (rag_opt.adapters.litellm) in the real LiteLLM proxy: ``litellm --config`` in a subprocess
with the guardrail in front of the loopback recording upstream (tests/upstream_server.py), driven with the official
``openai`` SDK (and plain HTTP for Anthropic's Messages API), over real HotpotQA documents. Nothing leaves the
machine. The proxy starts once for the module (tens of seconds: LiteLLM's start-up, then the proxy model loads in
its process); every guardrail is off by default and a request names the one it wants (LiteLLM's ``guardrails``)."""

from __future__ import annotations

import json
import os
import re
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

from rag_opt.adapters.gateway import GatewayError  # noqa: E402
from rag_opt.adapters.litellm import RagOptGuardrail  # noqa: E402
from rag_opt.errors import ConfigurationError, RagOptError  # noqa: E402
from tests.helpers import assert_verbatim, blocks, hotpot_dev, hotpot_docs  # noqa: E402
from tests.upstream_server import UNLIMITED_MS, FakeUpstream, ServerThread  # noqa: E402

pytestmark = [pytest.mark.model, pytest.mark.data, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
LITELLM = Path(sys.executable).with_name("litellm")
KEY = "sk-" + secrets.token_hex(16)
BLOCK = re.compile(r'<document id="([^"]*)" title="[^"]*">\n?(.*?)\n?</document>', re.S)
RECORDER = '''
import json, os
from litellm.integrations.custom_logger import CustomLogger


class Recorder(CustomLogger):
    """Writes each request's guardrail information (LiteLLM's standard logging payload) to RAGOPT_TEST_LOG."""

    async def async_log_success_event(self, kwargs, response_obj, start_time, end_time):
        self._write(kwargs)

    async def async_log_failure_event(self, kwargs, response_obj, start_time, end_time):
        self._write(kwargs)

    def _write(self, kwargs):
        slo = kwargs.get("standard_logging_object") or {}
        line = {"id": slo.get("id"), "call_id": kwargs.get("litellm_call_id")}
        line["guardrails"] = slo.get("guardrail_information")
        with open(os.environ["RAGOPT_TEST_LOG"], "a") as fh:
            fh.write(json.dumps(line, default=str) + "\\n")


recorder = Recorder()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(upstream: str, sidecar: str, dead: str) -> str:
    guard = "rag_opt.adapters.litellm.RagOptGuardrail"
    common = {"guardrail": guard, "mode": "pre_call", "default_on": False, "timeout": UNLIMITED_MS / 1e3}
    common["ordering"] = "input"  # the checks below read the documents in their input order (default: relevance)
    guardrails = {
        "rag-opt": {"ratio": 0.4},
        "rag-opt-sidecar": {"backend": "sidecar", "sidecar_url": sidecar, "tier": "model"},
        "rag-opt-dead": {"backend": "sidecar", "sidecar_url": dead, "timeout": 10},
        "rag-opt-closed": {"backend": "sidecar", "sidecar_url": dead, "timeout": 10, "fail_closed": True},
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
        "litellm_settings": {"callbacks": ["ragopt_recorder.recorder"]},
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
def upstream(served: tuple[FakeUpstream, str]) -> FakeUpstream:
    return served[0]


@pytest.fixture(scope="module")
def sidecar() -> Iterator[str]:
    """A real ``rag-opt serve`` app (its ``/v1/compress``) with the embedded proxy model."""
    from rag_opt import ContextOptimizer
    from rag_opt.server.app import create_app
    from rag_opt.server.settings import ProxySettings

    settings = ProxySettings(
        upstream="http://127.0.0.1:9/v1", warmup=False, time_budget_ms=UNLIMITED_MS, ordering="input"
    )
    app = create_app(settings, optimizer=ContextOptimizer(ordering="input"))
    with ServerThread(app) as server:
        yield server.url
    app.state.ragopt.pool.shutdown()


@pytest.fixture(scope="module")
def proxy(
    served: tuple[FakeUpstream, str], sidecar: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """The LiteLLM proxy (``litellm --config``) with the rag-opt guardrails; yields its URL and its log files."""
    if not LITELLM.exists():
        pytest.skip(f"the litellm command is not installed next to {sys.executable} (pip install -e '.[litellm]')")
    hotpot_dev(1)  # skips now, before the proxy starts, without the real data
    folder = tmp_path_factory.mktemp("litellm")
    (folder / "config.yaml").write_text(_config(served[1], sidecar, f"http://127.0.0.1:{_free_port()}"))
    (folder / "ragopt_recorder.py").write_text(RECORDER)
    log, out = folder / "guardrails.jsonl", folder / "litellm.log"
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "LITELLM_MASTER_KEY")}
    env.update(
        LITELLM_LOCAL_MODEL_COST_MAP="True",  # no price-list download (offline)
        LITELLM_TELEMETRY="False",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        RAGOPT_TEST_LOG=str(log),
    )
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
        yield {"url": url, "log": log, "out": out}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def client(proxy: dict[str, Any]) -> Any:
    return openai.OpenAI(base_url=proxy["url"] + "/v1", api_key=KEY, max_retries=0, timeout=UNLIMITED_MS / 1e3)


@pytest.fixture(scope="module")
def example() -> tuple[str, list[dict[str, Any]]]:
    ex = hotpot_dev(1)[0]
    return ex["question"], hotpot_docs(ex)[:4]


def _messages(question: str, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "Answer from the documents.\n" + blocks(docs)},
        {"role": "user", "content": question},
    ]


def _chat(client: Any, messages: list[dict[str, Any]], guardrail: str | None, **extra: Any) -> Any:
    """One chat completion through LiteLLM (``guardrail``: the one to run); the raw response (headers)."""
    body = {"guardrails": [guardrail]} if guardrail else {}
    headers = extra.pop("headers", None)
    return client.chat.completions.with_raw_response.create(
        model="fake-llm",
        messages=messages,
        temperature=0.2,
        max_tokens=64,
        user="tester",
        extra_body={**body, **extra},
        extra_headers=headers,
    )


def _sent(upstream: FakeUpstream, path: str = "/v1/chat/completions") -> dict[str, Any]:
    body: dict[str, Any] = upstream.last(path).json()
    return body


def _check_compressed(text: str, docs: list[dict[str, Any]]) -> list[str]:
    """The documents in ``text`` (as blocks): each kept one is verbatim pieces of its original, in order, in the
    original order of documents; something was cut. Returns the kept ids."""
    found = BLOCK.findall(text)
    by_id = {d["id"]: d["text"] for d in docs}
    assert found, text
    ids = [i for i, _ in found]
    assert ids == [d["id"] for d in docs if d["id"] in ids], "documents kept their order (ordering: input)"
    for doc_id, kept in found:
        assert_verbatim(kept.strip(), by_id[doc_id])
    assert sum(len(k) for _, k in found) < sum(len(d["text"]) for d in docs)
    return ids


def _without(body: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in keys}


def _logged(proxy: dict[str, Any], call_id: str) -> dict[str, Any]:
    """The rag-opt entry of LiteLLM's guardrail logging for the request ``call_id`` (the log is written after
    the answer: waited for)."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        lines = proxy["log"].read_text().splitlines() if proxy["log"].exists() else []
        for line in map(json.loads, lines):
            if call_id in (line["id"], line["call_id"]):
                entries = [g for g in line["guardrails"] or [] if g.get("guardrail_provider") == "rag_opt"]
                assert len(entries) == 1, line
                return dict(entries[0])
        time.sleep(0.2)
    raise AssertionError(f"no logging entry for {call_id}")


# -- the real proxy ---------------------------------------------------------------------------------------------
def test_in_process_guardrail_compresses_the_context(client: Any, upstream: Any, proxy: Any, example: Any) -> None:
    question, docs = example
    messages = _messages(question, docs)
    _chat(client, messages, None)
    baseline = _sent(upstream)  # what LiteLLM sends without the guardrail
    raw = _chat(client, messages, "rag-opt")
    assert raw.parse().choices[0].message.content == "ok"
    sent = _sent(upstream)
    assert _without(sent, "messages") == _without(baseline, "messages")  # model, temperature, ... unchanged
    assert sent["model"] == "fake-llm" and sent["temperature"] == 0.2 and "rag_opt" not in sent
    assert sent["messages"][1] == messages[1] and len(sent["messages"]) == 2
    system = sent["messages"][0]
    assert system["role"] == "system" and system["content"].startswith("Answer from the documents.\n")
    _check_compressed(system["content"], docs)
    # tokens before and after: in the response headers and in LiteLLM's guardrail logging
    headers = raw.headers
    assert headers["x-ragopt-status"] == "optimized" and "rag-opt" in headers["x-litellm-applied-guardrails"]
    before, after = int(headers["x-ragopt-tokens-before"]), int(headers["x-ragopt-tokens-after"])
    assert 0 < after < before
    entry = _logged(proxy, headers["x-litellm-call-id"])
    assert entry["guardrail_name"] == "rag-opt" and entry["guardrail_status"] == "success"
    report = entry["guardrail_response"]
    assert (report["status"], report["tokens_before"], report["tokens_after"]) == ("optimized", before, after)
    assert report["backend"] == "in_process"


def test_anthropic_messages_through_the_guardrail(upstream: Any, proxy: Any, example: Any) -> None:
    """Anthropic's Messages API (LiteLLM translates it for the openai/ model): the system prompt's documents are
    compressed before the translation, the rest goes on as LiteLLM sends it."""
    question, docs = example
    body = {
        "model": "fake-llm",
        "max_tokens": 32,
        "system": "Answer from the documents.\n" + blocks(docs),
        "messages": [{"role": "user", "content": [{"type": "text", "text": question}]}],
        "guardrails": ["rag-opt"],
        "rag_opt": {"ratio": 0.3},
    }
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    r = httpx.post(proxy["url"] + "/v1/messages", json=body, headers=headers, timeout=UNLIMITED_MS / 1e3)
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == "ok" and r.headers["x-ragopt-status"] == "optimized"
    sent = upstream.last("/v1/responses").json()
    assert "rag_opt" not in sent and sent["max_output_tokens"] == 32
    assert sent["instructions"].startswith("Answer from the documents.\n")
    _check_compressed(sent["instructions"], docs)
    assert json.dumps(question) in json.dumps(sent["input"])


def test_sidecar_guardrail_with_extension_documents(client: Any, upstream: Any, example: Any) -> None:
    """backend: sidecar against a real rag-opt serve; the documents come in the rag_opt field, with a budget."""
    question, docs = example
    ext = [{"id": d["id"], "title": d["title"], "text": d["text"]} for d in docs]
    messages = [{"role": "user", "content": question}]
    raw = _chat(client, messages, "rag-opt-sidecar", rag_opt={"documents": ext, "ratio": 0.3})
    sent = _sent(upstream)
    assert "rag_opt" not in sent and len(sent["messages"]) == 1
    content = sent["messages"][0]["content"]
    assert content.endswith("\n\n" + question)  # the documents go first in the question's message
    _check_compressed(content, docs)
    assert raw.headers["x-ragopt-status"] == "optimized"
    assert int(raw.headers["x-ragopt-tokens-after"]) < int(raw.headers["x-ragopt-tokens-before"])


def test_fail_open_forwards_the_request_unchanged(client: Any, upstream: Any, proxy: Any, example: Any) -> None:
    """A sidecar that cannot be reached: the request goes on unoptimized (fail-open, the default)."""
    messages = _messages(*example)
    raw = _chat(client, messages, "rag-opt-dead", rag_opt={"ratio": 0.3})
    assert raw.parse().choices[0].message.content == "ok"
    sent = _sent(upstream)
    assert sent["messages"] == messages and "rag_opt" not in sent
    assert raw.headers["x-ragopt-status"] == "fail_open"
    assert raw.headers["x-ragopt-reason"].startswith("sidecar unreachable")
    entry = _logged(proxy, raw.headers["x-litellm-call-id"])
    assert entry["guardrail_status"] == "guardrail_failed_to_respond"


def test_fail_closed_refuses_the_request(client: Any, upstream: Any, example: Any) -> None:
    n = len(upstream.requests)
    with pytest.raises(openai.APIStatusError) as info:
        _chat(client, _messages(*example), "rag-opt-closed")
    assert info.value.status_code == 503
    assert "fail-closed" in info.value.message and "sidecar unreachable" in info.value.message
    assert len(upstream.requests) == n  # the upstream got nothing


def test_per_request_bypass(client: Any, upstream: Any, example: Any) -> None:
    messages = _messages(*example)
    raw = _chat(client, messages, "rag-opt", rag_opt={"enabled": False})
    sent = _sent(upstream)
    assert sent["messages"] == messages and "rag_opt" not in sent
    assert raw.headers["x-ragopt-status"] == "disabled"
    raw = _chat(client, messages, "rag-opt", headers={"x-ragopt-disable": "true"})
    assert _sent(upstream)["messages"] == messages and raw.headers["x-ragopt-status"] == "disabled"
    # streamed: the headers come too
    raw = client.chat.completions.with_raw_response.create(
        model="fake-llm",
        messages=messages,
        stream=True,
        extra_body={"guardrails": ["rag-opt"], "rag_opt": {"enabled": False}},
    )
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices) == "Hello"
    assert raw.headers["x-ragopt-status"] == "disabled" and _sent(upstream)["messages"] == messages


def test_bad_input_is_a_400_in_litellm_shape(client: Any, upstream: Any, proxy: Any, example: Any) -> None:
    n = len(upstream.requests)
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, _messages(*example), "rag-opt", rag_opt={"ratio": 2})
    error = info.value.body
    assert isinstance(error, dict) and "rag_opt" in error["message"] and "ratio" in error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == "rag_opt"
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, _messages(*example), "rag-opt", headers={"x-ragopt-ratoi": "0.5"})
    assert "unknown header x-ragopt-ratoi" in info.value.message
    r = httpx.post(
        proxy["url"] + "/v1/chat/completions",
        headers={"authorization": f"Bearer {KEY}"},
        json={"model": "fake-llm", "messages": [{"role": "user", "content": "hi"}], "guardrails": ["rag-opt"],
              "rag_opt": {"placement": "middle"}},
    )  # fmt: skip
    assert r.status_code == 400 and set(r.json()["error"]) >= {"message", "type", "param", "code"}
    assert len(upstream.requests) == n


# -- configuration (no proxy) -----------------------------------------------------------------------------------
def test_configuration_errors_are_clear() -> None:
    base = {"guardrail_name": "g", "event_hook": "pre_call", "warmup": False}
    with pytest.raises(ConfigurationError, match="rati .*did you mean ratio"):
        RagOptGuardrail(**base, rati=0.5)
    with pytest.raises(ConfigurationError, match=r"ratio must be in \(0, 1\]"):
        RagOptGuardrail(**base, ratio=1.5)
    with pytest.raises(ConfigurationError, match="needs sidecar_url"):
        RagOptGuardrail(**base, backend="sidecar")
    with pytest.raises(ConfigurationError, match="device: in-process options"):
        RagOptGuardrail(**base, backend="sidecar", sidecar_url="http://127.0.0.1:9", device="cpu")
    with pytest.raises(ConfigurationError, match="ordering"):
        RagOptGuardrail(**base, ordering="sideways")
    # what LiteLLM fills in for every guardrail (its own parameters) is not refused; api_base is the sidecar's URL
    g = RagOptGuardrail(**base, backend="sidecar", api_base="http://127.0.0.1:9", unreachable_fallback="fail_closed")
    assert g.settings.sidecar_url == "http://127.0.0.1:9" and not g.settings.fail_closed
    assert issubclass(GatewayError, RagOptError) and issubclass(ConfigurationError, RagOptError)


def test_the_example_configuration_is_valid() -> None:
    yaml = pytest.importorskip("yaml", reason="PyYAML (a LiteLLM dependency) is not installed")
    config = yaml.safe_load((ROOT / "examples" / "litellm" / "config.yaml").read_text())
    (entry,) = config["guardrails"]
    params = dict(entry["litellm_params"])
    assert params.pop("guardrail") == "rag_opt.adapters.litellm.RagOptGuardrail"
    mode, default_on = params.pop("mode"), params.pop("default_on")
    g = RagOptGuardrail(
        guardrail_name=entry["guardrail_name"], event_hook=mode, default_on=default_on, warmup=False, **params
    )
    assert g.settings.ratio == params["ratio"] and g.settings.backend == "in_process"


def test_without_litellm_the_import_error_says_how_to_install() -> None:
    code = "import sys; sys.modules['litellm'] = None\nimport rag_opt.adapters.litellm"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "pip install" in out.stderr and "[litellm]" in out.stderr, out.stderr


# -- the sidecar's answers (a stand-in sidecar: no proxy, no model) ----------------------------------------------
def _gateway(answer: Any, **options: Any) -> Any:
    from rag_opt.adapters.gateway import GatewaySettings, RequestOptimizer

    settings = GatewaySettings(backend="sidecar", sidecar_url="http://sidecar.test", tool_min_chars=50, **options)
    gateway = RequestOptimizer(settings)
    gateway._client = httpx.AsyncClient(base_url="http://sidecar.test", transport=httpx.MockTransport(answer))
    return gateway


def _tool_turn(example: Any) -> dict[str, Any]:
    question, docs = example
    call = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{}"}}
    return {
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": docs[0]["text"]},
        ]
    }


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_sidecar_answers_are_translated(anyio_backend: str, example: Any) -> None:
    body = _tool_turn(example)
    nothing_kept = {"status": "optimized", "documents": [], "tokens_before": 50, "tokens_after": 0}
    answers = {
        "dropped": httpx.Response(200, json=nothing_kept),
        "fail_open": httpx.Response(200, json={"status": "fail_open", "reason": "timeout"}),
        "500": httpx.Response(500, json={"error": {"message": "boom"}}),
    }
    # a tool result is never emptied (the proxy's 'required'): one the sidecar dropped goes on unchanged
    outcome, new = await _gateway(lambda r: answers["dropped"]).rewrite("chat", body, {})
    assert outcome.status == "optimized" and new is None  # (None: nothing to change)
    for name, reason in (("fail_open", "sidecar failed open: timeout"), ("500", "sidecar answered HTTP 500")):
        outcome, new = await _gateway(lambda r, name=name: answers[name]).rewrite("chat", body, {})
        assert (outcome.status, outcome.reason, new) == ("fail_open", reason, None)
        with pytest.raises(GatewayError) as info:
            await _gateway(lambda r, name=name: answers[name], fail_closed=True).rewrite("chat", body, {})
        assert info.value.status_code == 503 and reason in info.value.message
    with pytest.raises(GatewayError) as info:  # an invalid per-request option: a 400 naming it
        await _gateway(lambda r: answers["500"]).rewrite("chat", {**body, "rag_opt": {"ordering": "x"}}, {})
    assert (info.value.status_code, info.value.param) == (400, "rag_opt.ordering")
