"""The Gemini routes (``/v1beta/models/{model}:generateContent`` and ``:streamGenerateContent``, and their ``/v1``
forms), end to end: uvicorn on 127.0.0.1, the official ``google-genai`` SDK (streaming and not), a recording
upstream (tests/upstream_server.py) standing in for the Gemini API, real HotpotQA documents (``../shared/data``;
skipped without them) and the real embedded proxy model for every optimization.

Byte identity is checked against the bytes the SDK itself sent (captured by an httpx event hook): every byte
outside the context values is the same upstream. The API key's travel and its absence from every log are
checked too, as are Google-shaped errors, path aliases and where the context is looked for (no server).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types

from rag_opt.server.errors import error_json
from rag_opt.server.paths import check_path, error_format, gemini_model, gemini_route, is_gemini_path, upstream_url
from rag_opt.server.security import redact
from rag_opt.server.settings import ProxySettings
from rag_opt.server.upstream import without_query_credentials
from rag_opt.types import OptimizeResult, OutputDocument
from rag_opt.wire.documents import ContextPlan
from rag_opt.wire.errors import RequestError, RewriteError
from rag_opt.wire.gemini import check_gemini_body, plan_gemini
from rag_opt.wire.json_edit import JsonPath
from tests.helpers import (
    assert_only_context_changed,
    assert_optimized,
    blocks,
    hotpot_dev,
    hotpot_docs,
    value,
)
from tests.upstream_server import FakeUpstream, ServerThread, bm25_optimizer, parse_metrics, serve_proxy

MODEL = "gemini-2.5-flash"
ROUTE = f"/v1beta/models/{MODEL}:generateContent"
STREAM = f"/v1beta/models/{MODEL}:streamGenerateContent"
CLIENT_KEY = "AIzaSy-client-key-0001"
GEMINI_KEY = "AIzaSy-operator-key-0002"
PROXY_KEY = "rk-proxy-gemini-Zq81mM2pLx"
SETTINGS = ProxySettings(upstream="http://127.0.0.1:9/v1", tool_min_chars=300)


# -- servers, clients and data --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def upstream() -> Iterator[FakeUpstream]:
    fake = FakeUpstream()
    with ServerThread(fake) as server:
        fake.url = server.url  # type: ignore[attr-defined]
        yield fake


@pytest.fixture(scope="module")
def proxy(upstream: FakeUpstream) -> Iterator[str]:
    from rag_opt import ContextOptimizer

    # the real embedded model (loaded once per process, shared with the other server tests)
    with serve_proxy(upstream.url, ContextOptimizer(), ordering="input") as (url, _):
        yield url


@pytest.fixture(scope="module")
def up_url(upstream: FakeUpstream) -> str:
    return str(upstream.url)  # type: ignore[attr-defined]


@pytest.fixture
def up(upstream: FakeUpstream) -> FakeUpstream:
    upstream.gate.clear()
    upstream.gate_released = None
    return upstream


@pytest.fixture
def sent() -> list[bytes]:
    """The request bodies the SDK clients below sent, in order."""
    return []


def client(
    url: str, sent: list[bytes] | None = None, api_key: str = CLIENT_KEY, version: str = "v1beta"
) -> genai.Client:
    """The official SDK pointed at the proxy (``version``: the API version in its paths; the SDK's own default is
    v1), its request bodies recorded in ``sent``."""
    hooks = {"request": [lambda r: sent.append(r.read())]} if sent is not None else {}
    options = types.HttpOptions(
        base_url=url,
        api_version=version,
        httpx_client=httpx.Client(timeout=None, event_hooks=hooks),
        retry_options=types.HttpRetryOptions(attempts=1),
    )
    return genai.Client(api_key=api_key, http_options=options)


@pytest.fixture(scope="module")
def hotpot() -> list[tuple[str, list[dict[str, Any]], list[dict[str, Any]]]]:
    """Real HotpotQA dev questions, each with its two supporting paragraphs and four distractors (skipped without
    ../shared/data)."""
    out = []
    for ex in hotpot_dev(3):
        docs, gold = hotpot_docs(ex), {title for title, _ in ex["supporting_facts"]}
        out.append(
            (ex["question"], [d for d in docs if d["title"] in gold], [d for d in docs if d["title"] not in gold][:4])
        )
    return out


def google_error(r: httpx.Response, status: int, kind: str) -> dict[str, Any]:
    """The body of a Google-shaped error answer, checked."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["status"] == kind and isinstance(error["message"], str)
    return dict(error)


# -- where the context is (no server) --------------------------------------------------------------------------
def found(plan: ContextPlan) -> list[tuple[JsonPath, str]]:
    return [(plan.containers[d.container].path, d.text[:10]) for d in plan.documents if d.container is not None]


def test_where_gemini_context_is_looked_for():
    long = "Tool sentence. " * 30
    body = {
        "systemInstruction": {"role": "user", "parts": [{"text": "Be terse <document>Sys doc.</document>"}]},
        "contents": [
            {"role": "user", "parts": [{"text": "<document>Earlier turn: not context.</document> q0"}]},
            {"role": "model", "parts": [{"text": "<document>Model: not context.</document>"}]},
            {
                "parts": [  # no role: a user content
                    {"text": '<document id="1">Doc one.</document> Q?'},
                    {"text": "<document>A thought: not context.</document>", "thought": True},
                    {"inlineData": {"mimeType": "image/png", "data": "iVBORw0KGgo="}},
                ]
            },
            {"role": "model", "parts": [{"functionCall": {"name": "search", "args": {"q": "x"}}}]},
            {
                "role": "user",
                "parts": [
                    {
                        "functionResponse": {
                            "name": "search",
                            "response": {
                                "output": long,
                                "short": "Too short to be a document.",
                                "hits": [{"title": "T", "text": "<document>Hit one.</document>", "n": 3}],
                                "count": 2,
                            },
                        }
                    }
                ],
            },
            {"role": "function", "parts": {"function_response": {"name": "f", "response": {"out": long}}}},
        ],
    }
    plan = plan_gemini(json.dumps(body).encode(), {}, SETTINGS)
    fr = ("contents", 4, "parts", 0, "functionResponse", "response")
    assert found(plan) == [
        (("systemInstruction", "parts", 0, "text"), "Sys doc."),
        (("contents", 2, "parts", 0, "text"), "Doc one."),
        ((*fr, "output"), long[:10]),
        ((*fr, "hits", 0, "text"), "Hit one."),
        (("contents", 5, "parts", "function_response", "response", "out"), long[:10]),
    ]
    assert plan.query == "Q?"
    assert [d.required for d in plan.documents] == [False, False, True, False, True]  # whole tool texts stay
    no_tools = plan_gemini(json.dumps(body).encode(), {}, ProxySettings(upstream="http://x/v1", tool_messages=False))
    assert [t for _, t in found(no_tools)] == ["Sys doc.", "Doc one.", "Hit one."]  # blocks are still context
    snake = {
        "system_instruction": {"parts": {"text": "<document>S.</document>"}},
        "contents": [{"parts": {"text": "q"}}],
    }
    plan = plan_gemini(json.dumps(snake).encode(), {}, SETTINGS)
    assert found(plan) == [(("system_instruction", "parts", "text"), "S.")] and plan.query == "q"
    ext = {"contents": [{"parts": [{"text": "Q?"}]}], "rag_opt": {"query": "Other?", "documents": ["One."]}}
    plan = plan_gemini(json.dumps(ext).encode(), {}, SETTINGS)
    assert plan.query == "Other?" and [d.text for d in plan.documents] == ["One."]


def _result(plan: ContextPlan, kept: dict[int, str]) -> OptimizeResult:
    """A result keeping documents ``kept`` (index: text) and dropping the others."""
    n = len(plan.documents)
    return OptimizeResult(
        query="Q?",
        documents=[OutputDocument(id=str(i), index=i, text=t) for i, t in kept.items()],
        dropped=[OutputDocument(id=str(i), index=i, text="") for i in range(n) if i not in kept],
        tokens_before=9,
        tokens_after=3,
        target_tokenizer="o200k_base",
        scorer="probe",
    )


def test_text_parts_left_blank_are_removed_not_sent_empty():
    """The API refuses an empty text part: a part that held only dropped documents goes, with its comma; a
    systemInstruction of nothing goes whole; a content whose every part would go is forwarded unoptimized."""
    raw = (
        b'{"systemInstruction": {"parts": [{"text": "<document>Dropped sys.</document>"}]}, "contents": [{"role": '
        b'"user", "parts": [{"text": "<document>Dropped one.</document>"}, {"text": "<document>Kept. Cut.</document>'
        b' Q?"}]}], "generationConfig": {"temperature": 0}}'
    )
    plan = plan_gemini(raw, {}, SETTINGS)
    assert [d.text for d in plan.documents] == ["Dropped sys.", "Dropped one.", "Kept. Cut."]
    assert plan.render(_result(plan, {2: "Kept."})) == (
        b'{"contents": [{"role": "user", "parts": [{"text": "<document>Kept.</document> Q?"}]}], '
        b'"generationConfig": {"temperature": 0}}'
    )
    # a system instruction with another part keeps it; a single part object (not an array) goes with its member
    raw = (
        b'{"contents": [{"parts": [{"text": "Q?"}]}], "system_instruction": {"parts": {"text": "<document>D.'
        b'</document>"}}}'
    )
    plan = plan_gemini(raw, {}, SETTINGS)
    assert plan.render(_result(plan, {})) == b'{"contents": [{"parts": [{"text": "Q?"}]}]}'
    raw = b'{"contents": [{"parts": [{"text": "<document>D. E.</document>"}]}], "rag_opt": {"query": "Q?"}}'
    plan = plan_gemini(raw, {}, SETTINGS)
    with pytest.raises(RewriteError, match="every part of a content"):
        plan.render(_result(plan, {}))
    assert plan.render(None) == b'{"contents": [{"parts": [{"text": "<document>D. E.</document>"}]}]}'


def test_extension_documents_go_first_in_the_question_or_last_in_the_system_instruction():
    docs = [{"text": "One.", "id": "a"}, {"text": "Two.", "title": "T"}]
    body = {"contents": [{"role": "user", "parts": [{"text": "Q?"}]}], "rag_opt": {"documents": docs}}
    out = plan_gemini(json.dumps(body).encode(), {}, SETTINGS).render(None)
    rendered = '<document id="a">One.</document>\n<document title="T">Two.</document>'
    assert json.loads(out) == {"contents": [{"role": "user", "parts": [{"text": rendered}, {"text": "Q?"}]}]}
    one = {"contents": [{"parts": {"text": "Q?"}}], "rag_opt": {"documents": docs}}
    out = plan_gemini(json.dumps(one).encode(), {}, SETTINGS).render(None)
    assert json.loads(out) == {"contents": [{"parts": {"text": rendered + "\n\nQ?"}}]}
    system = {
        "systemInstruction": {"parts": [{"text": "Be terse."}]},
        "contents": [{"parts": [{"text": "Q?"}]}],
        "rag_opt": {"documents": docs, "placement": "system"},
    }
    out = plan_gemini(json.dumps(system).encode(), {}, SETTINGS).render(None)
    assert json.loads(out)["systemInstruction"] == {"parts": [{"text": "Be terse.\n\n" + rendered}]}
    none = {"contents": [{"parts": [{"text": "Q?"}]}], "rag_opt": {"documents": docs, "placement": "system"}}
    out = plan_gemini(json.dumps(none).encode(), {}, SETTINGS).render(None)
    assert (
        out
        == b'{"contents": [{"parts": [{"text": "Q?"}]}],"systemInstruction":{"parts":[{"text":'
        + json.dumps(rendered, separators=(",", ":")).encode()
        + b"}]}}"
    )


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ({"model": "m"}, "missing required parameter 'contents'", "contents"),
        ({"contents": {"parts": [{"text": "q"}]}}, "contents must be an array", "contents"),
        ({"contents": ["q"]}, "contents[0] must be a Content object", "contents[0]"),
        ({"contents": [{"role": 5, "parts": []}]}, "contents[0].role must be a string", "contents[0].role"),
        ({"contents": [{"parts": "q"}]}, "contents[0].parts must be an array", "contents[0].parts"),
        ({"contents": [{"parts": [{"text": 3}]}]}, "contents[0].parts[0].text must be a string", None),
        ({"contents": [{"parts": [7]}]}, "contents[0].parts[0] must be a Part object", None),
        ({"contents": [{"parts": [{"functionResponse": "x"}]}]}, "functionResponse must be an object", None),
        ({"contents": [{"parts": [{"functionResponse": {"response": []}}]}]}, "response must be a JSON object", None),
        ({"contents": [], "systemInstruction": "Be terse."}, "systemInstruction must be a Content object", None),
        ({"contents": [], "systemInstruction": {}, "system_instruction": {}}, "sent twice", "systemInstruction"),
    ],
)
def test_malformed_bodies_are_refused_naming_the_place(body, message, param):
    with pytest.raises(RequestError, match=message.replace("[", r"\[").replace("]", r"\]")) as exc:
        check_gemini_body(body)
    if param is not None:
        assert exc.value.param == param
    raw = b'{"contents": [{"parts": [{"text": "q", "text": "r"}]}]}'
    with pytest.raises(RequestError, match="appears more than once"):
        plan_gemini(raw, {}, SETTINGS)
    raw = b'{"contents": [{"parts": [{"functionResponse": {"response": {"a": "x", "a": "y"}}}]}]}'
    with pytest.raises(RequestError, match="response.a appears more than once"):
        plan_gemini(raw, {}, SETTINGS)


# -- paths, errors, redaction (no server) ----------------------------------------------------------------------
def test_gemini_paths_routes_and_upstream_urls():
    assert gemini_route(ROUTE) == "gemini_generate_content" and gemini_route(STREAM) == "gemini_stream_generate_content"
    assert gemini_route("/v1/models/gemini-2.0-flash-001:generateContent") == "gemini_generate_content"
    assert gemini_route("/v1beta/tunedModels/my-model:generateContent") == "gemini_generate_content"
    assert gemini_model("/v1beta/tunedModels/my-model:streamGenerateContent") == "tunedModels/my-model"
    assert gemini_model(ROUTE) == MODEL and gemini_route("/v1beta/models/x:countTokens") is None
    for path in ("/v1beta/models", "/v1beta/models/x:countTokens", "/v1/models/x:embedContent", "/v1beta"):
        assert is_gemini_path(path) and error_format(path) == "google"
    for path in ("/v1/models", "/v1/models/ft:gpt-4o:org:abc", "/v1/chat/completions", "/v1betax"):
        assert not is_gemini_path(path)
    assert error_format("/v1/messages") == "anthropic" and error_format("/v1/models") == "openai"
    base = httpx.URL("https://gateway.example/gemini")
    url = upstream_url(base, b"/v1beta/models/m:streamGenerateContent", b"alt=sse", below=b"")
    assert str(url) == "https://gateway.example/gemini/v1beta/models/m:streamGenerateContent?alt=sse"
    assert without_query_credentials(b"alt=sse&key=AIza&%6Bey=x&KEY=y&access_token=t&keyx=1") == b"alt=sse&keyx=1"
    with pytest.raises(ValueError, match="root URL"):
        ProxySettings(upstream="http://x/v1", gemini_upstream="https://generativelanguage.googleapis.com/v1beta")


@pytest.mark.parametrize(
    "raw",
    [
        b"/v1beta/models/m:generatecontent",
        b"/v1beta/models/m:GenerateContent",
        b"/v1beta/Models/m:generateContent",
        b"/V1BETA/models/m:generateContent",
        b"/v1beta/models/m:generateContent;x=1",
        b"/v1beta/models/m:generateContent%20",
        b"/v1beta/models/m:generateContent.",
        b"/v1beta/models/m%3AgenerateContent%2e",
        b"/v1beta/models/m%253agenerateContent%2520",
        b"/v1beta/models/m:\xef\xbd\x87enerateContent",  # a fullwidth letter (NFKC: g)
        b"/v1beta/models/m\xef\xbc\x9agenerateContent",  # a fullwidth colon (NFKC: ':')
        b"/v1beta/models/m%20x:generateContent",
        b"/v1beta/models/m;x:streamGenerateContent",
        b"/v1/models/m:streamgeneratecontent",
    ],
)
def test_aliases_of_the_gemini_routes_are_refused(raw):
    from urllib.parse import unquote

    with pytest.raises(RequestError, match="Gemini generateContent route"):
        check_path(raw, unquote(raw.decode("utf-8")))


def test_the_gemini_routes_and_plain_paths_pass_the_path_check():
    for raw in (ROUTE, STREAM, "/v1/models/gemini-2.0-flash-001:generateContent", "/v1beta/models/x:countTokens"):
        check_path(raw.encode(), raw)
    check_path(b"/v1beta/models/m%3AgenerateContent", "/v1beta/models/m:generateContent")  # the route itself
    check_path(b"/v1beta/tunedModels/generatecontent-tuned", "/v1beta/tunedModels/generatecontent-tuned")


def test_errors_in_googles_shape():
    body = json.loads(error_json("bad", "invalid_request_error", "invalid_json", "google"))
    assert body == {
        "error": {
            "code": 400,
            "message": "bad",
            "status": "INVALID_ARGUMENT",
            "details": [
                {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "INVALID_JSON", "domain": "rag-opt"}
            ],
        }
    }
    statuses = {404: "NOT_FOUND", 405: "UNIMPLEMENTED", 413: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED"}
    statuses |= {500: "INTERNAL", 502: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED", 401: "UNAUTHENTICATED"}
    for status, kind in statuses.items():
        assert json.loads(error_json("m", "t", "c", "google", status))["error"]["status"] == kind


def test_redaction_of_google_keys():
    text = (
        "POST https://g.example/v1beta/models/m:generateContent?alt=sse&key=AIzaSECRET1 and ?access_token=ya29.SECRET2"
    )
    out = redact(text)
    assert "SECRET1" not in out and "SECRET2" not in out and "alt=sse&key=[redacted]" in out


# -- the SDK through the proxy: generateContent ------------------------------------------------------------------
@pytest.mark.model
def test_generate_content_compresses_text_parts_and_function_responses_and_forwards_the_rest_byte_for_byte(
    proxy, sent, up, hotpot
):
    question, gold, distractors = hotpot[0]
    docs = [gold[0], distractors[0], gold[1]]
    tool_output = " ".join(d["text"] for d in distractors[1:3])  # a long tool result, off the question
    before = parse_metrics(httpx.get(f"{proxy}/metrics").text)
    r = client(proxy, sent).models.generate_content(
        model=MODEL,
        contents=[
            types.Content(role="user", parts=[types.Part(text="Earlier <document>Old context. It stays.</document>")]),
            types.Content(role="model", parts=[types.Part(text="Earlier answer.")]),
            types.Content(
                role="user",
                parts=[
                    types.Part(text=f"Answer from these documents only.\n\n{blocks(docs)}\n\nQuestion: {question}"),
                    types.Part(inline_data=types.Blob(mime_type="image/png", data=b"\x89PNG\r\n")),
                ],
            ),
            types.Content(role="model", parts=[types.Part(function_call=types.FunctionCall(name="search", args={}))]),
            types.Content(
                role="user",
                parts=[
                    types.Part(
                        function_response=types.FunctionResponse(
                            name="search", response={"output": tool_output, "count": 3, "source": "wiki"}
                        )
                    )
                ],
            ),
        ],
        config=types.GenerateContentConfig(
            system_instruction="You are terse.",
            temperature=0.25,
            max_output_tokens=64,
            stop_sequences=["END"],
            safety_settings=[types.SafetySetting(category="HARM_CATEGORY_HARASSMENT", threshold="BLOCK_NONE")],
            tools=[
                types.Tool(function_declarations=[types.FunctionDeclaration(name="search", description="Look up.")])
            ],
        ),
    )
    assert r.text == "ok"
    assert_optimized(r.sdk_http_response.headers)
    rec = up.last(ROUTE)
    text = ("contents", 2, "parts", 0, "text")
    output = ("contents", 4, "parts", 0, "functionResponse", "response", "output")
    assert_only_context_changed(sent[-1], rec.body, [text, output])
    assert value(rec.body, text).endswith(f"\n\nQuestion: {question}")
    assert len(value(rec.body, output)) < len(tool_output)  # the function response is context, and was cut
    assert rec.header("x-goog-api-key") == CLIENT_KEY and rec.query == ""  # the client's key, as it came
    after = parse_metrics(httpx.get(f"{proxy}/metrics").text)
    label = 'ragopt_requests_total{route="gemini_generate_content"}'
    assert after[label] == before.get(label, 0.0) + 1
    assert httpx.get(f"{proxy}/stats").json()["models"][MODEL]["optimizations"] >= 1


@pytest.mark.model
def test_the_sdks_default_api_version_v1_and_extension_documents(proxy, sent, up, hotpot):
    question, gold, distractors = hotpot[1]
    docs = [*gold, *distractors[:2]]
    r = client(proxy, sent, version="v1").models.generate_content(
        model=MODEL,
        contents=question,
        config=types.GenerateContentConfig(
            system_instruction="You are terse.",
            http_options=types.HttpOptions(extra_body={"rag_opt": {"documents": docs, "ratio": 0.3}}),
        ),
    )
    assert r.text == "ok"
    assert_optimized(r.sdk_http_response.headers)
    rec = up.last(f"/v1/models/{MODEL}:generateContent")
    got, original = json.loads(rec.body), json.loads(sent[-1])
    first = got["contents"][0]["parts"].pop(0)["text"]  # the documents, first in the question's content
    assert first.startswith("<document id=") and len(first) < len(blocks(docs))
    del original["rag_opt"]
    assert got == original and b"rag_opt" not in rec.body  # the rest as sent, the extension field removed


def test_a_request_without_context_is_forwarded_as_its_original_bytes(proxy, sent, up):
    r = client(proxy, sent).models.generate_content(model=MODEL, contents="Just a question, no documents.")
    assert r.text == "ok" and r.sdk_http_response.headers["x-ragopt-status"] == "no_context"
    assert up.last(ROUTE).body == sent[-1]


# -- the stream -----------------------------------------------------------------------------------------------
@pytest.mark.model
def test_stream_arrives_as_the_upstream_sends_it_and_its_context_is_compressed(proxy, sent, up, hotpot):
    question, gold, distractors = hotpot[2]
    docs = [distractors[0], *gold, distractors[1]]
    stream = client(proxy, sent, version="v1").models.generate_content_stream(
        model="gated", contents=f"{blocks(docs)}\n\nQuestion: {question}"
    )
    first = next(stream)  # the upstream is still holding the rest back
    assert first.text == "Hel" and up.gate_released is None
    assert_optimized(first.sdk_http_response.headers)
    up.gate.set()
    rest = list(stream)
    assert up.gate_released is True and [c.text for c in rest] == ["lo"]
    assert rest[-1].candidates[0].finish_reason == types.FinishReason.STOP
    rec = up.last("/v1/models/gated:streamGenerateContent")
    assert rec.query == "alt=sse"
    assert_only_context_changed(sent[-1], rec.body, [("contents", 0, "parts", 0, "text")])


def test_a_stream_without_alt_sse_one_json_array_is_relayed_as_it_arrives(proxy, up):
    body = {"contents": [{"role": "user", "parts": [{"text": "Hi"}]}]}
    with httpx.stream("POST", f"{proxy}/v1beta/models/gated:streamGenerateContent", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        chunks = r.iter_raw()
        head = next(chunks)  # before the upstream sent the rest: not buffered for a JSON check
        assert head.startswith(b"[") and up.gate_released is None
        up.gate.set()
        whole = head + b"".join(chunks)
    assert [c["candidates"][0]["content"]["parts"][0]["text"] for c in json.loads(whole)] == ["Hel", "lo"]


# -- errors ---------------------------------------------------------------------------------------------------
def test_upstream_errors_reach_the_sdk_as_its_error_types(proxy, up):
    with pytest.raises(genai_errors.ClientError) as exc:
        client(proxy).models.generate_content(model="error-400", contents="hi")
    assert exc.value.code == 400 and exc.value.status == "INVALID_ARGUMENT" and exc.value.message == "bad thing"
    with pytest.raises(genai_errors.ServerError) as server_exc:
        client(proxy).models.generate_content_stream(model="error-500", contents="hi").__next__()
    assert server_exc.value.code == 500 and server_exc.value.message == "upstream broke"


def test_own_errors_come_in_googles_shape_and_are_not_forwarded(proxy, up):
    n = len(up.requests)
    with pytest.raises(genai_errors.ClientError) as exc:
        client(proxy).models.generate_content(
            model=MODEL,
            contents="hi",
            config=types.GenerateContentConfig(http_options=types.HttpOptions(headers={"x-ragopt-ratio": "7"})),
        )
    assert exc.value.code == 400 and exc.value.status == "INVALID_ARGUMENT" and "ratio must be in" in exc.value.message
    url = f"{proxy}{ROUTE}"
    error = google_error(httpx.post(url, content=b'{"contents": [', timeout=None), 400, "INVALID_ARGUMENT")
    assert "not valid JSON" in error["message"] and error["details"][0]["reason"] == "INVALID_JSON"
    error = google_error(httpx.post(url, json={"contents": "hi"}, timeout=None), 400, "INVALID_ARGUMENT")
    assert error["message"].startswith("contents must be an array") and error["details"][0]["metadata"] == {
        "param": "contents"
    }
    bad = {"contents": [{"role": "user", "parts": [{"text": ["not", "a", "string"]}]}]}
    error = google_error(httpx.post(url, json=bad, timeout=None), 400, "INVALID_ARGUMENT")
    assert error["details"][0]["metadata"] == {"param": "contents[0].parts[0].text"}
    r = httpx.post(url, content=b"{}", headers={"content-type": "text/plain"}, timeout=None)
    google_error(r, 415, "INVALID_ARGUMENT")
    r = httpx.get(url, timeout=None)
    assert google_error(r, 405, "UNIMPLEMENTED") and r.headers["allow"] == "POST"
    google_error(httpx.get(f"{proxy}/v1beta", timeout=None), 404, "NOT_FOUND")
    error = google_error(httpx.post(f"{proxy}/v1beta/models/m:GenerateContent", json={}), 400, "INVALID_ARGUMENT")
    assert error["details"][0]["reason"] == "INVALID_PATH"
    assert len(up.requests) == n
    # other Gemini paths are forwarded unchanged to the Gemini upstream
    raw = b'{"contents" : "hi"}'
    count = httpx.post(f"{proxy}/v1beta/models/{MODEL}:countTokens", content=raw, timeout=None)
    assert count.json() == {"totalTokens": 3} and "x-ragopt-status" not in count.headers
    assert up.last(f"/v1beta/models/{MODEL}:countTokens").body == raw
    assert httpx.get(f"{proxy}/v1beta/models?pageSize=5").json() == {"models": [{"name": "models/fake-gemini"}]}
    assert up.last("/v1beta/models").query == "pageSize=5"


def test_413_and_unreachable_upstream_answers_in_googles_shape(up_url):
    with serve_proxy(up_url, bm25_optimizer(), max_body_bytes=200) as (url, _):
        r = httpx.post(f"{url}{ROUTE}", json={"contents": [{"parts": [{"text": "x" * 300}]}]}, timeout=None)
        google_error(r, 413, "INVALID_ARGUMENT")
    with serve_proxy(up_url, bm25_optimizer(), gemini_upstream="http://127.0.0.1:9") as (url, _):
        with pytest.raises(genai_errors.ServerError) as exc:
            client(url).models.generate_content(model=MODEL, contents="hi")
        assert exc.value.code == 502 and exc.value.status == "UNAVAILABLE"


# -- the API key -----------------------------------------------------------------------------------------------
def test_the_key_travels_as_the_client_sent_it_or_is_replaced_by_the_operators(up_url, up):
    body = {"contents": [{"parts": [{"text": "hi"}]}]}
    with serve_proxy(up_url, bm25_optimizer(), upstream_api_key="sk-openai-never-to-google") as (url, _):
        client(url).models.generate_content(model=MODEL, contents="hi")
        assert up.last(ROUTE).header("x-goog-api-key") == CLIENT_KEY  # the OpenAI upstream's key never goes there
        httpx.post(f"{url}{STREAM}?alt=sse&key={CLIENT_KEY}", json=body, timeout=None)
        rec = up.last(STREAM)
        assert rec.query == f"alt=sse&key={CLIENT_KEY}" and rec.header("x-goog-api-key") is None
        assert "sk-openai-never-to-google" not in str(rec.headers)
    with serve_proxy(up_url, bm25_optimizer(), gemini_upstream_api_key=GEMINI_KEY) as (url, _):
        client(url).models.generate_content(model=MODEL, contents="hi")
        rec = up.last(ROUTE)
        assert [v for k, v in rec.headers if k == "x-goog-api-key"] == [GEMINI_KEY]
        headers = {"authorization": "Bearer ya29.client", "x-goog-api-key": CLIENT_KEY}
        httpx.post(f"{url}{STREAM}?alt=sse&key={CLIENT_KEY}&access_token=t", json=body, headers=headers, timeout=None)
        rec = up.last(STREAM)
        assert rec.query == "alt=sse" and [v for k, v in rec.headers if k == "x-goog-api-key"] == [GEMINI_KEY]
        assert rec.header("authorization") is None and CLIENT_KEY not in str(rec.headers)


def test_a_gemini_client_holding_only_the_proxy_key(up_url, up):
    """The SDK sends its api_key as x-goog-api-key: on the Gemini paths that may be the proxy key, which is then
    removed, and the operator's Gemini key goes upstream."""
    settings = {"api_key": PROXY_KEY, "gemini_upstream_api_key": GEMINI_KEY}
    with serve_proxy(up_url, bm25_optimizer(), **settings) as (url, _):
        assert client(url, api_key=PROXY_KEY).models.generate_content(model=MODEL, contents="hi").text == "ok"
        rec = up.last(ROUTE)
        assert [v for k, v in rec.headers if k == "x-goog-api-key"] == [GEMINI_KEY]
        assert PROXY_KEY not in str(rec.headers) + rec.query
        r = httpx.post(f"{url}{STREAM}?alt=sse&key={PROXY_KEY}", json={"contents": []}, timeout=None)
        assert r.status_code == 200 and up.last(STREAM).query == "alt=sse"
        n = len(up.requests)
        with pytest.raises(genai_errors.ClientError) as exc:
            client(url, api_key="AIza-wrong-key").models.generate_content(model=MODEL, contents="hi")
        assert exc.value.code == 401 and exc.value.status == "UNAUTHENTICATED"
        assert "x-goog-api-key" in exc.value.message
        # only on the Gemini paths: elsewhere x-goog-api-key is not where the proxy key goes
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(f"{url}/v1/chat/completions", json=chat, headers={"x-goog-api-key": PROXY_KEY})
        assert r.status_code == 401 and "type" in r.json()["error"]
        assert len(up.requests) == n


def test_keys_are_never_logged(up_url, caplog):
    caplog.set_level(logging.DEBUG)
    # httpx's own request lines too (a library imported earlier in the session, e.g. litellm, may have raised the
    # httpx logger's level: then nothing of it would be captured, and its lines not checked)
    caplog.set_level(logging.DEBUG, logger="httpx")
    settings = {"api_key": PROXY_KEY, "gemini_upstream_api_key": GEMINI_KEY, "log_bodies": True}
    secrets = [PROXY_KEY, GEMINI_KEY, CLIENT_KEY, "AIza-query-secret-77"]
    with serve_proxy(up_url, bm25_optimizer(), **settings) as (url, _):
        client(url, api_key=PROXY_KEY).models.generate_content(
            model=MODEL, contents="<document>Paris is in France. It is big.</document> Where is Paris?"
        )
        headers = {"x-ragopt-api-key": PROXY_KEY, "x-goog-api-key": CLIENT_KEY}
        body = {"contents": [{"parts": [{"text": "hi"}]}]}
        httpx.post(f"{url}{STREAM}?alt=sse&key=AIza-query-secret-77", json=body, headers=headers, timeout=None)
        httpx.post(f"{url}{ROUTE}?key=AIza-query-secret-77", content=b"{", headers=headers, timeout=None)
        httpx.get(f"{url}/v1beta/models?key=AIza-query-secret-77", timeout=None)  # 401
    for gemini_upstream in (up_url, "http://127.0.0.1:9"):  # the client's key forwarded; an unreachable upstream
        with serve_proxy(up_url, bm25_optimizer(), gemini_upstream=gemini_upstream, log_bodies=True) as (url, _):
            httpx.post(f"{url}{ROUTE}?key=AIza-query-secret-77", json=body, headers={"x-goog-api-key": CLIENT_KEY})
    logged = "\n".join(r.getMessage() + (str(r.exc_info) if r.exc_info else "") for r in caplog.records)
    assert f"POST {ROUTE} 200" in logged and "upstream failed" in logged and "body=" in logged
    # httpx's request line, its query string blanked (by rag-opt's filter, or by litellm's, which runs first on the
    # httpx logger once litellm has been imported in the process)
    assert f"{ROUTE}?[redacted]" in logged or f"{ROUTE}?REDACTED" in logged
    assert "x-goog-api-key: [redacted]" in logged  # the headers were logged, the key blanked
    for secret in secrets:
        assert secret not in logged
