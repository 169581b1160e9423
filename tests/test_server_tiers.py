"""The proxy's lexical tier and micro-batching (issue #15, server side).

No model is loaded: optimizations use rag-opt's real pipeline with the BM25 scorer (the lexical tier is real:
BM25 and lexical features through the shipped lexical probe). Workers are held at gates the test opens, budgets
run out when the test says so: nothing depends on the machine's speed, and every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from rag_opt import ContextOptimizer
from rag_opt.compressors import BM25Scorer
from rag_opt.models.threads import ThreadPolicy
from rag_opt.server.errors import BudgetExceeded
from rag_opt.server.pool import OptimizerPool
from rag_opt.server.settings import ProxySettings
from rag_opt.server.state import ProxyState
from rag_opt.wire.chat import plan_request
from tests.helpers import EXAMPLE_DOCS
from tests.upstream_server import FakeUpstream, ServerThread, bm25_optimizer, parse_metrics, serve_proxy

DOCS = EXAMPLE_DOCS
QUESTIONS = [
    "Which magazine was started first?",
    "Who wrote the novel adapted into the film?",
    "Where was the band formed?",
    "When did the company go public?",
    "What is the capital of the region?",
]
WAIT_S = 60.0  # a bound on every wait, never a speed budget


def chat_body(i: int, docs: list[dict[str, Any]]) -> bytes:
    blocks = "\n".join(f'<document id="{d["id"]}">{d["text"]}</document>' for d in docs)
    content = f"{blocks}\n\n{QUESTIONS[i % len(QUESTIONS)]}"
    return json.dumps({"model": f"m{i}", "messages": [{"role": "user", "content": content}]}).encode()


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    h = {"content-type": "application/json", **(headers or {})}
    return httpx.post(f"{url}/v1/chat/completions", content=body, headers=h, timeout=WAIT_S)


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=WAIT_S).text)


def wait_until(cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def expected_body(body: bytes, tier: str = "model", ratio: float = 0.5) -> bytes:
    """What one single call of the BM25 pipeline makes of ``body`` (the forwarded bytes)."""
    plan = plan_request(body, {}, tool_min_chars=300)
    result = bm25_optimizer().optimize(plan.query or "", plan.optimizer_documents(), ratio=ratio, tier=tier)
    return plan.render(result)


def forwarded(fake: FakeUpstream, model: str) -> bytes:
    """The body the upstream got last for ``model`` (each test sends each model once; the upstream is shared)."""
    found = [r.body for r in fake.requests if json.loads(r.body).get("model") == model]
    assert found
    return found[-1]


class Spy(ContextOptimizer):
    """The BM25 pipeline recording every ``optimize_batch`` call (``optimize`` goes through it too); the model tier
    waits at ``gate`` on its first call, and fails every batch of several when ``fail_batches``."""

    def __init__(self, fail_batches: bool = False) -> None:
        super().__init__(scorer=BM25Scorer())
        self.gate = threading.Event()
        self.sizes: list[int] = []  # model-tier calls
        self.lexical_calls = 0
        self.fail_batches = fail_batches
        self._lock = threading.Lock()

    def optimize_batch(self, queries: Any, documents: Any, **kwargs: Any) -> Any:
        if kwargs.get("tier") == "lexical":
            with self._lock:
                self.lexical_calls += 1
            return super().optimize_batch(queries, documents, **kwargs)
        with self._lock:
            self.sizes.append(len(queries))
            first = len(self.sizes) == 1
        if first:
            assert self.gate.wait(WAIT_S), "the test never opened the gate"
        if self.fail_batches and len(queries) > 1:
            raise RuntimeError("injected batch failure")
        return super().optimize_batch(queries, documents, **kwargs)


class Background:
    def __init__(self, fn: Callable[[], httpx.Response]) -> None:
        self.out: list[Any] = []
        self.thread = threading.Thread(target=lambda: self.out.append(fn()), daemon=True)
        self.thread.start()

    def result(self) -> httpx.Response:
        self.thread.join(WAIT_S)
        assert self.out, "request did not finish"
        response: httpx.Response = self.out[0]
        return response


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[FakeUpstream, str]]:
    fake = FakeUpstream()
    with ServerThread(fake) as server:
        yield fake, server.url


def _queue_behind_first(url: str, state: Any, spy: Spy, n: int) -> list[tuple[bytes, Background]]:
    """Request 0 holds the worker at the spy's gate; requests 1..n queue behind it."""
    sent = []
    body0 = chat_body(0, DOCS[0:4])
    sent.append((body0, Background(lambda: post(url, body0))))
    wait_until(lambda: spy.sizes == [1])
    for i in range(1, n + 1):
        body = chat_body(i, DOCS[i : i + 4])
        sent.append((body, Background(lambda body=body: post(url, body))))  # type: ignore[misc]
    wait_until(lambda: state.pool.gauges()[:2] == (n, 1))
    return sent


# -- micro-batching --------------------------------------------------------------------------------------------
def test_queued_requests_with_the_same_settings_run_as_one_batch_equal_to_single_calls(upstream):
    fake, up_url = upstream
    spy = Spy()
    with serve_proxy(up_url, spy, max_concurrency=1, max_queue=8, batch_wait_ms=0, max_batch=8) as (url, state):
        sent = _queue_behind_first(url, state, spy, 4)
        spy.gate.set()
        for i, (body, bg) in enumerate(sent):
            r = bg.result()
            assert r.status_code == 200 and r.headers["x-ragopt-status"] == "optimized"
            assert forwarded(fake, f"m{i}") == expected_body(body)  # byte for byte what a single call gives
            assert int(r.headers["x-ragopt-tokens-after"]) < int(r.headers["x-ragopt-tokens-before"])
        assert spy.sizes == [1, 4]  # the four queued ones: one optimize_batch call
        m = metrics(url)
        assert m["ragopt_optimizer_batch_size_count"] == 1 and m["ragopt_optimizer_batch_size_sum"] == 4
        assert m['ragopt_optimizations_total{tier="model"}'] == 5
        assert m['ragopt_chat_requests_total{outcome="optimized"}'] == 5


def test_requests_with_other_settings_are_not_batched_together(upstream):
    fake, up_url = upstream
    spy = Spy()
    with serve_proxy(up_url, spy, max_concurrency=1, max_queue=8, batch_wait_ms=0, max_batch=8) as (url, state):
        body0 = chat_body(0, DOCS[0:4])
        first = Background(lambda: post(url, body0))
        wait_until(lambda: spy.sizes == [1])
        held = []
        for i, ratio in ((1, "0.5"), (2, "0.3"), (3, "0.5"), (4, "0.3")):
            body = chat_body(i, DOCS[i : i + 4])
            held.append((body, float(ratio), Background(lambda b=body, r=ratio: post(url, b, {"x-ragopt-ratio": r}))))
        wait_until(lambda: state.pool.gauges()[:2] == (4, 1))
        spy.gate.set()
        assert first.result().headers["x-ragopt-status"] == "optimized"
        for i, (body, ratio, bg) in enumerate(held, start=1):
            assert bg.result().headers["x-ragopt-status"] == "optimized"
            assert forwarded(fake, f"m{i}") == expected_body(body, ratio=ratio)
        assert spy.sizes == [1, 2, 2]  # one batch per budget


def test_a_failing_batch_is_retried_one_by_one(upstream):
    fake, up_url = upstream
    spy = Spy(fail_batches=True)
    with serve_proxy(up_url, spy, max_concurrency=1, max_queue=8, batch_wait_ms=0, max_batch=8) as (url, state):
        sent = _queue_behind_first(url, state, spy, 3)
        spy.gate.set()
        for i, (body, bg) in enumerate(sent):
            r = bg.result()
            assert r.headers["x-ragopt-status"] == "optimized"
            assert forwarded(fake, f"m{i}") == expected_body(body)
        assert spy.sizes == [1, 3, 1, 1, 1]


def test_pool_batch_job_over_its_budget_is_discarded_and_the_others_get_their_results():
    """One job of a running batch runs out of budget: it is told so (running), the batch goes on for the others."""
    gate, entered = threading.Event(), threading.Event()
    expiry = {1.0: asyncio.Event, 2.0: asyncio.Event}  # budgets the test expires by hand, by value
    calls: list[list[int]] = []

    def fn(items: list[int]) -> list[int]:
        calls.append(list(items))
        if items == [0]:
            entered.set()
            assert gate.wait(WAIT_S)
        return [x * 10 for x in items]

    async def main() -> None:
        events = {k: v() for k, v in expiry.items()}
        pool = OptimizerPool(workers=1, max_queue=8, max_batch=8, batch_wait_ms=0)

        async def sleep(seconds: float) -> None:
            if seconds in events:
                await events[seconds].wait()
            else:
                await asyncio.sleep(WAIT_S * 10)

        pool.sleep = sleep
        first = asyncio.ensure_future(pool.run_batched("k", 0, fn, 100.0))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        short = asyncio.ensure_future(pool.run_batched("k", 1, fn, 1.0))
        long = [asyncio.ensure_future(pool.run_batched("k", i, fn, 100.0)) for i in (2, 3)]
        while pool.gauges()[0] != 3:
            await asyncio.sleep(0.01)
        gate.set()
        assert await first == 0
        while len(calls) < 2:
            await asyncio.sleep(0.01)
        events[1.0].set()  # the short job's budget runs out (its batch may be running or done)
        assert [await f for f in long] == [20, 30]
        try:
            assert await short == 10  # finished before its budget ran out
        except BudgetExceeded as exc:
            assert exc.stage == "running"
        assert calls == [[0], [1, 2, 3]]
        pool.shutdown()

    asyncio.run(asyncio.wait_for(main(), WAIT_S))


# -- the lexical tier ------------------------------------------------------------------------------------------
def test_an_overloaded_model_is_replaced_by_the_lexical_tier(upstream):
    fake, up_url = upstream
    spy = Spy()
    with serve_proxy(up_url, spy, max_concurrency=1, max_queue=0) as (url, state):
        body0 = chat_body(0, DOCS[0:4])
        first = Background(lambda: post(url, body0))
        wait_until(lambda: spy.sizes == [1])
        body = chat_body(1, DOCS[3:8])
        r = post(url, body)  # answered while the worker is held: the lexical tier does not use the pool
        assert r.status_code == 200 and r.headers["x-ragopt-status"] == "optimized_lexical"
        assert r.headers["x-ragopt-reason"] == "overload"
        assert forwarded(fake, "m1") == expected_body(body, tier="lexical")
        m = metrics(url)
        assert m['ragopt_optimizations_total{tier="lexical"}'] == 1
        assert m['ragopt_lexical_tier_total{reason="overload"}'] == 1
        assert m['ragopt_chat_requests_total{outcome="optimized_lexical"}'] == 1
        assert m['ragopt_optimizer_shed_total{reason="queue_full"}'] == 1
        assert m['ragopt_fail_open_total{reason="overload"}'] == 0
        # an ordering that needs the proxy model cannot be served lexically: fail-open, and the reason says why
        r = post(url, chat_body(2, DOCS[3:8]), {"x-ragopt-ordering": "calibrated"})
        assert r.headers["x-ragopt-status"] == "fail_open"
        assert r.headers["x-ragopt-reason"].startswith("overload; the lexical tier cannot serve ordering=calibrated")
        spy.gate.set()
        assert first.result().headers["x-ragopt-status"] == "optimized"
        assert spy.lexical_calls == 1


def test_with_the_lexical_tier_off_an_overload_fails_open_as_before(upstream):
    _, up_url = upstream
    spy = Spy()
    with serve_proxy(up_url, spy, max_concurrency=1, max_queue=0, lexical_tier=False) as (url, _state):
        first = Background(lambda: post(url, chat_body(0, DOCS[0:4])))
        wait_until(lambda: spy.sizes == [1])
        r = post(url, chat_body(1, DOCS[3:8]))
        assert r.headers["x-ragopt-status"] == "fail_open" and r.headers["x-ragopt-reason"] == "overload"
        spy.gate.set()
        assert first.result().headers["x-ragopt-status"] == "optimized"
        assert spy.lexical_calls == 0


def test_a_timed_out_model_optimization_falls_back_to_the_lexical_tier(upstream):
    fake, up_url = upstream
    spy = Spy()
    with serve_proxy(up_url, spy, max_concurrency=1, max_queue=1) as (url, state):
        from tests.upstream_server import BudgetClock

        clock = BudgetClock()
        clock.install(state)
        body = chat_body(0, DOCS[0:5])
        bg = Background(lambda: post(url, body))
        wait_until(lambda: spy.sizes == [1])
        clock.expire()
        r = bg.result()
        assert r.headers["x-ragopt-status"] == "optimized_lexical" and r.headers["x-ragopt-reason"] == "timeout"
        assert forwarded(fake, "m0") == expected_body(body, tier="lexical")
        spy.gate.set()
        wait_until(lambda: state.pool.gauges()[1] == 0)
        assert metrics(url)['ragopt_optimizer_timeouts_total{stage="running"}'] == 1


def test_large_contexts_and_a_loading_model_go_to_the_lexical_tier(upstream):
    fake, up_url = upstream
    spy = Spy()
    spy.gate.set()
    with serve_proxy(up_url, spy, lexical_over_tokens=500) as (url, state):
        small, large = chat_body(0, DOCS[1:2]), chat_body(1, DOCS[0:8])
        r = post(url, small)
        assert r.headers["x-ragopt-status"] == "optimized" and spy.sizes == [1]
        r = post(url, large)
        assert r.headers["x-ragopt-status"] == "optimized_lexical" and r.headers["x-ragopt-reason"] == "size"
        assert forwarded(fake, "m1") == expected_body(large, tier="lexical") and spy.sizes == [1]
        state.optimizer_state = "loading"  # as while the warm-up loads the proxy model
        r = post(url, chat_body(2, DOCS[1:2]))
        assert r.headers["x-ragopt-status"] == "optimized_lexical" and r.headers["x-ragopt-reason"] == "loading"
        m = metrics(url)
        assert m['ragopt_lexical_tier_total{reason="size"}'] == 1
        assert m['ragopt_lexical_tier_total{reason="loading"}'] == 1
        assert spy.sizes == [1] and spy.lexical_calls == 2


def test_an_optimizer_without_tiers_fails_open_on_overload():
    """An optimizer that only has ``optimize`` (no lexical tier, no batches) keeps today's behaviour."""

    class Plain:
        def optimize(self, query: str, documents: Any, **kwargs: Any) -> Any:
            return bm25_optimizer().optimize(query, documents, **kwargs)

    state = ProxyState(ProxySettings(upstream="http://127.0.0.1:9/v1"), Plain())
    assert not state.lexical_tier and not state.batching
    state.pool.shutdown()


# -- settings --------------------------------------------------------------------------------------------------
def test_tier_batching_and_thread_settings():
    s = ProxySettings.from_sources(
        {"upstream": "http://127.0.0.1:9/v1", "max_concurrency": 3, "threads": "2", "lexical_over_tokens": 4000},
        env={"RAG_OPT_BATCH_WAIT_MS": "0", "RAG_OPT_LEXICAL_TIER": "false"},
    )
    assert (s.threads, s.batch_wait_ms, s.lexical_tier, s.lexical_over_tokens) == ("2", 0.0, False, 4000)
    defaults = ProxySettings(upstream="http://127.0.0.1:9/v1")
    assert defaults.lexical_tier and defaults.lexical_over_tokens is None and defaults.threads == "adaptive"
    assert defaults.batch_wait_ms > 0 and defaults.batch_bound > 1
    # the pool's defaults follow the encoding: long queues and big batches where queued questions share a pass
    parallel = ProxySettings(upstream="http://127.0.0.1:9/v1", encoding="parallel")
    joint = ProxySettings(upstream="http://127.0.0.1:9/v1", encoding="joint")
    assert (parallel.queue_bound, parallel.batch_bound, joint.queue_bound, joint.batch_bound) == (64, 16, 8, 4)
    explicit = ProxySettings(upstream="http://127.0.0.1:9/v1", encoding="parallel", max_queue=2, max_batch=1)
    assert (explicit.queue_bound, explicit.batch_bound) == (2, 1)
    with pytest.raises(ValueError, match="threads"):
        ProxySettings.from_sources({"upstream": "http://127.0.0.1:9/v1", "threads": "many"}, env={})
    state = ProxyState(ProxySettings(upstream="http://127.0.0.1:9/v1", max_concurrency=3), None)
    assert state.optimizer.threads == ThreadPolicy("adaptive", workers=3)  # type: ignore[attr-defined]
    assert state.lexical_tier and state.batching
    state.pool.shutdown()


def test_serve_has_the_new_flags(capsys):
    from rag_opt.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--no-lexical-tier", "--lexical-over-tokens", "--batch-wait-ms", "--max-batch", "--threads"):
        assert flag in out


def test_the_lexical_fallback_gets_what_is_left_of_the_request_s_budget():
    """One budget per request: after the model spent most of it, the lexical tier gets the rest (at least a twentieth),
    not a fresh budget (a 10 s budget was answered at 20 s)."""
    from rag_opt.server.engine import LEXICAL_FLOOR, Engine, lexical_budget_s
    from rag_opt.types import Budget
    from rag_opt.wire.job import Job

    assert lexical_budget_s(10.0, t0=100.0, now=102.5) == pytest.approx(7.5)
    assert lexical_budget_s(10.0, t0=100.0, now=109.8) == pytest.approx(LEXICAL_FLOOR * 10.0)
    assert lexical_budget_s(10.0, t0=100.0, now=150.0) == pytest.approx(LEXICAL_FLOOR * 10.0)

    state = ProxyState(ProxySettings(upstream="http://127.0.0.1:9/v1", time_budget_ms=10_000), bm25_optimizer())
    given: list[float] = []
    real = state.lexical_pool.run

    async def spy(fn: Callable[[], Any], budget_s: float) -> Any:
        given.append(budget_s)
        return await real(fn, budget_s)

    state.lexical_pool.run = spy  # type: ignore[method-assign]
    state.optimizer.lexical_scorer()  # loaded beforehand: the second left is for BM25's milliseconds, not a load
    job = Job(EXAMPLE_DOCS[0]["text"][:40], [dict(d) for d in EXAMPLE_DOCS], Budget(ratio=0.5), "input")
    attempt = asyncio.run(Engine(state)._lexical(job, "timeout", time.perf_counter() - 9.0))
    assert attempt.result is not None and attempt.reason == "timeout"
    assert len(given) == 1 and LEXICAL_FLOOR * 10.0 <= given[0] <= 1.0 + 1e-6  # not a fresh 10 s
    state.pool.shutdown()
    state.lexical_pool.shutdown()
