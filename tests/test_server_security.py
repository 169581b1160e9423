"""Security of the proxy: loopback by default, the optional proxy key (constant-time, never forwarded),
credentials and bodies kept out of the logs (bodies only with --log-bodies, redacted), no pickle or remote code,
probe files validated before serving. uvicorn on 127.0.0.1 runs the proxy and the recording upstream
(tests/upstream_server.py); the official ``openai`` client talks to it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from rag_opt.server import security
from rag_opt.server.security import redact
from rag_opt.server.settings import ProxySettings
from rag_opt.server.settings_checks import redact_url
from tests.upstream_server import FakeUpstream, ServerThread, bm25_optimizer, parse_metrics, serve_proxy

PROXY_KEY = "rk-proxy-Zq81mM2pLx"
UPSTREAM_KEY = "sk-operator-9f8e7d6c5b4a"
CLIENT_KEY = "sk-client-1a2b3c4d5e6f"
MESSAGES = [{"role": "user", "content": "<document>Paris is in France. It is big.</document>\n\nWhere is Paris?"}]


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[FakeUpstream, str]]:
    fake = FakeUpstream()
    with ServerThread(fake) as server:
        yield fake, server.url


@pytest.fixture(scope="module")
def keyed(upstream: tuple[FakeUpstream, str]) -> Iterator[str]:
    with serve_proxy(upstream[1], bm25_optimizer(), api_key=PROXY_KEY) as (url, _):
        yield url


# -- binding and settings --------------------------------------------------------------------------------------
def test_binds_to_loopback_by_default():
    assert ProxySettings(upstream="http://x/v1").host == "127.0.0.1"
    assert ProxySettings.from_sources({"upstream": "http://x/v1"}, {}).host == "127.0.0.1"
    from rag_opt.cli import build_parser

    args = build_parser().parse_args(["serve", "--upstream", "http://x/v1"])
    assert args.host is None  # so the settings' default, 127.0.0.1, applies


def test_keys_come_from_the_environment_and_never_show():
    s = ProxySettings.from_sources({}, {"RAG_OPT_UPSTREAM": "http://x/v1", "RAG_OPT_API_KEY": PROXY_KEY})
    assert s.api_key is not None and s.api_key.get_secret_value() == PROXY_KEY
    assert PROXY_KEY not in repr(s) and PROXY_KEY not in str(s.model_dump())
    with pytest.raises(ValueError, match="api_key"):
        ProxySettings(upstream="http://x/v1", api_key=" padded ")


# -- the proxy key -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": "Bearer wrong"}, {"x-ragopt-api-key": "wrong"}, {"authorization": PROXY_KEY}],
    ids=["none", "wrong-bearer", "wrong-header", "no-scheme"],
)
def test_requests_without_the_proxy_key_get_a_401_and_are_not_forwarded(keyed, upstream, headers):
    fake = upstream[0]
    n = len(fake.requests)
    for method, path in [("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/metrics")]:
        body = json.dumps({"model": "m", "messages": MESSAGES}).encode() if method == "POST" else None
        r = httpx.request(method, f"{keyed}{path}", content=body, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["type"] == "invalid_request_error"
        assert r.headers["www-authenticate"].startswith("Bearer")
    assert len(fake.requests) == n
    assert httpx.get(f"{keyed}/healthz").status_code == 200  # liveness stays open


def test_proxy_key_as_bearer_is_never_forwarded(keyed, upstream):
    fake = upstream[0]
    client = openai.OpenAI(base_url=f"{keyed}/v1", api_key=PROXY_KEY, max_retries=0)
    out = client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
    assert out.parse().choices[0].message.content == "ok" and out.headers["x-ragopt-status"] == "optimized"
    rec = fake.last()
    assert rec.header("authorization") is None  # no upstream key configured: no Authorization at all
    assert PROXY_KEY not in json.dumps(rec.headers) and PROXY_KEY not in rec.body.decode()


def test_proxy_key_in_its_own_header_lets_the_client_key_through(keyed, upstream):
    fake = upstream[0]
    client = openai.OpenAI(
        base_url=f"{keyed}/v1", api_key=CLIENT_KEY, max_retries=0, default_headers={"X-RagOpt-Api-Key": PROXY_KEY}
    )
    assert [m.id for m in client.models.list()] == ["fake-llm"]
    rec = fake.last("/v1/models")
    assert rec.header("authorization") == f"Bearer {CLIENT_KEY}"
    assert rec.header("x-ragopt-api-key") is None and PROXY_KEY not in json.dumps(rec.headers)
    metrics = httpx.get(f"{keyed}/metrics", headers={"authorization": f"Bearer {PROXY_KEY}"})
    assert metrics.status_code == 200
    assert parse_metrics(metrics.text)['ragopt_local_errors_total{kind="unauthorized"}'] >= 0


def test_proxy_key_with_an_operator_upstream_key(upstream):
    fake = upstream[0]
    with serve_proxy(upstream[1], bm25_optimizer(), api_key=PROXY_KEY, upstream_api_key=UPSTREAM_KEY) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=PROXY_KEY, max_retries=0)
        client.chat.completions.create(model="m", messages=MESSAGES)
    assert [v for k, v in fake.last().headers if k == "authorization"] == [f"Bearer {UPSTREAM_KEY}"]


def test_the_key_is_compared_in_constant_time(keyed, monkeypatch):
    calls: list[tuple[bytes, bytes]] = []
    real = security.hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(security.hmac, "compare_digest", spy)
    r = httpx.get(f"{keyed}/v1/models", headers={"authorization": "Bearer nope", "x-ragopt-api-key": "nope2"})
    assert r.status_code == 401
    assert (b"nope", PROXY_KEY.encode()) in calls and (b"nope2", PROXY_KEY.encode()) in calls


# -- logs ------------------------------------------------------------------------------------------------------
SECRETS = [PROXY_KEY, CLIENT_KEY, UPSTREAM_KEY, "qs-secret-777", "azure-key-31337", "cookie-secret-42"]
MARKER = "BODY-MARKER-ZX9"


def _noisy_traffic(url: str, up_url: str) -> None:
    """Requests that carry credentials everywhere a client might put them, and bodies with a marker; some fail."""
    headers = {
        "authorization": f"Bearer {PROXY_KEY}",
        "api-key": "azure-key-31337",
        "cookie": "session=cookie-secret-42",
    }
    body = {"model": "m", "messages": [{"role": "user", "content": f"<document>{MARKER} one. Two.</document> Q?"}]}
    httpx.post(f"{url}/v1/chat/completions?api-key=qs-secret-777", json=body, headers=headers)
    httpx.post(f"{url}/v1/chat/completions", json={**body, "model": "stream-error", "stream": True}, headers=headers)
    httpx.post(f"{url}/v1/chat/completions", content=b'{"messages": "' + MARKER.encode(), headers=headers)
    httpx.get(
        f"{url}/v1/models?key=qs-secret-777",
        headers={"x-ragopt-api-key": PROXY_KEY, "authorization": f"Bearer {CLIENT_KEY}"},
    )
    httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {CLIENT_KEY}"})  # 401


class _Failing:
    """An optimizer that fails with the request's content in its message (as a tokenizer error might)."""

    def optimize(self, query: str, documents: Any, **kwargs: Any) -> Any:
        raise ValueError(f"cannot handle {documents[0]['text']!r}")


def _all_logged(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() + (str(r.exc_info) if r.exc_info else "") for r in caplog.records)


@pytest.mark.parametrize("optimizer", ["bm25", "failing"])
def test_credentials_and_bodies_are_never_logged_by_default(upstream, caplog, optimizer):
    caplog.set_level(logging.DEBUG)
    opt = bm25_optimizer() if optimizer == "bm25" else _Failing()
    with serve_proxy(upstream[1], opt, api_key=PROXY_KEY, upstream_api_key=UPSTREAM_KEY) as (url, _):
        _noisy_traffic(url, upstream[1])
    logged = _all_logged(caplog)
    assert "POST /v1/chat/completions 200" in logged  # the access log is there ...
    for secret in SECRETS:
        assert secret not in logged  # ... without a credential
    assert MARKER not in logged  # and without a body
    if optimizer == "failing":
        assert "optimization failed (ValueError)" in logged


def test_log_bodies_logs_bodies_with_credentials_redacted(upstream, caplog):
    caplog.set_level(logging.DEBUG)
    with serve_proxy(upstream[1], _Failing(), api_key=PROXY_KEY, log_bodies=True) as (url, _):
        _noisy_traffic(url, upstream[1])
        body = {"model": "m", "messages": [{"role": "user", "content": f"{MARKER} {PROXY_KEY}"}], "api_key": CLIENT_KEY}
        httpx.post(f"{url}/v1/chat/completions", json=body, headers={"x-ragopt-api-key": PROXY_KEY})
    logged = _all_logged(caplog)
    assert MARKER in logged and "[redacted]" in logged
    assert re.search(r'\\?"api_key\\?":\s*\\?"\[redacted\]', logged)
    assert re.search(r"response 200 .*body=", logged)  # the upstream's answer too
    for secret in SECRETS:
        assert secret not in logged


def test_redaction():
    text = (
        '{"api_key": "abc", "Authorization": "Bearer xyz.123", "nested": {"client_secret": "s3", "x-api-key": "k"},'
        ' "password": "hunter2", "text": "use sk-abcdefghijklmnop or Bearer tok_123 here", "keep": "visible"}'
    )
    out = redact(text, ["visible-not"])
    for gone in ("abc", "xyz.123", "s3", '"k"', "hunter2", "sk-abcdefghijklmnop", "tok_123"):
        assert gone not in out
    assert '"keep": "visible"' in out and json.loads(out)["nested"]["client_secret"] == "[redacted]"
    assert redact("my key is rk-proxy-Zq81mM2pLx!", [PROXY_KEY]) == "my key is [redacted]!"
    assert redact_url("https://user:pa55@api.example.com/v1") == "https://***@api.example.com/v1"
    assert redact_url("http://localhost:8080/v1") == "http://localhost:8080/v1"


# -- the serve command ---------------------------------------------------------------------------------------
@pytest.fixture
def no_uvicorn(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Record uvicorn.run's arguments instead of serving."""
    import uvicorn

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append({"app": app, **kw}))
    return calls


def test_serve_warns_when_exposed_without_a_key_and_hides_url_credentials(no_uvicorn, caplog, capsys):
    from rag_opt.cli import main

    caplog.set_level(logging.WARNING)
    assert main(["serve", "--upstream", "http://bob:pa55@up.example:8080/v1", "--host", "0.0.0.0", "--no-warmup"]) == 0
    (call,) = no_uvicorn
    assert call["host"] == "0.0.0.0" and call["access_log"] is False and call["timeout_keep_alive"] == 75
    assert "without --api-key" in caplog.text
    err = capsys.readouterr().err
    assert "pa55" not in err and "http://***@up.example:8080/v1" in err and "proxy key off" in err
    state = call["app"].state.ragopt
    assert state.optimizer.trust_remote_code is False  # off unless asked


def test_serve_flags_reach_the_settings(no_uvicorn, monkeypatch):
    from rag_opt.cli import main

    monkeypatch.setenv("RAG_OPT_API_KEY", PROXY_KEY)
    argv = ["serve", "--upstream", "http://up/v1", "--no-warmup", "--trust-remote-code", "--log-bodies"]
    argv += ["--max-queue", "3", "--on-overload", "reject", "--max-body-bytes", "1000", "--max-concurrency", "2"]
    argv += ["--optimizer-nice", "4"]
    assert main(argv) == 0
    state = no_uvicorn[0]["app"].state.ragopt
    s = state.settings
    assert (s.max_queue, s.on_overload, s.max_body_bytes, s.max_concurrency) == (3, "reject", 1000, 2)
    assert s.optimizer_nice == 4
    assert s.log_bodies is True and s.api_key.get_secret_value() == PROXY_KEY
    assert state.optimizer.trust_remote_code is True and state.pool.gauges()[2:] == (2, 3)


@pytest.mark.parametrize(
    "content",
    [
        b"\x80\x04\x95\x15\x00\x00\x00\x00\x00\x00\x00\x8c\x08builtins\x94\x8c\x04eval\x94\x93\x94.",  # a pickle
        b'{"format": "something-else"}',
        b"[1, 2, 3]",
    ],
    ids=["pickle", "wrong-format", "not-an-object"],
)
def test_probe_files_are_validated_before_serving(no_uvicorn, tmp_path, capsys, content):
    from rag_opt.cli import main

    probe = tmp_path / "probe.json"
    probe.write_bytes(content)
    assert main(["serve", "--upstream", "http://up/v1", "--probe", str(probe)]) == 2
    assert capsys.readouterr().err.startswith("rag-opt: error: ") and not no_uvicorn
    assert main(["serve", "--upstream", "http://up/v1", "--probe", str(tmp_path / "absent.json")]) == 2


def test_no_pickle_or_remote_code_loading_in_the_package():
    root = Path(__file__).resolve().parents[1] / "rag_opt"
    pattern = re.compile(
        r"^\s*(import pickle|from pickle|import dill|import joblib)|torch\.load\(|allow_pickle\s*=\s*True"
        r"|trust_remote_code\s*=\s*True|weights_only\s*=\s*False",
        re.M,
    )
    offenders = [
        f"{p.relative_to(root)}: {m.group(0).strip()}"
        for p in root.rglob("*.py")
        for m in pattern.finditer(p.read_text())
    ]
    assert offenders == []
    from rag_opt import ContextOptimizer

    assert ContextOptimizer().trust_remote_code is False
    assert ProxySettings(upstream="http://x/v1").trust_remote_code is False
