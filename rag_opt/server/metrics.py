"""The proxy's metrics, through ``prometheus_client``: one :class:`~prometheus_client.CollectorRegistry` per app,
with the process and platform collectors on it, rendered by ``GET /metrics``; and the JSON summary of
``GET /stats`` (:meth:`Metrics.stats`).

The encoding cache's counters and sizes (``ragopt_encoding_cache_*``) are read at scrape time by
:class:`~rag_opt.server.cache_metrics.EncodingCacheCollector`: the cache counts, the metrics only show.

Updated from the event loop and the optimizer's worker threads (``prometheus_client``'s instruments are
thread-safe). Every labelled family starts with its documented label values at 0, so a scrape always shows
them; a route label value not listed in :data:`ROUTES` appears on first use.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from rag_opt.server.cache_metrics import EncodingCacheCollector

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.models.encoding_cache import EncodingCache

__all__ = [
    "BATCH_BUCKETS",
    "COMPRESS_OUTCOMES",
    "CONTENT_TYPE",
    "FAIL_OPEN_REASONS",
    "LATENCY_BUCKETS",
    "LEXICAL_REASONS",
    "LOCAL_ERRORS",
    "MAX_MODELS",
    "MAX_MODEL_CHARS",
    "OPTIMIZER_STATES",
    "OUTCOMES",
    "ROUTES",
    "SHED_REASONS",
    "TIERS",
    "TIMEOUT_STAGES",
    "UPSTREAM_ERRORS",
    "WAIT_BUCKETS",
    "Metrics",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # what generate_latest writes

_LLM_ROUTES = ("chat_completions", "messages", "responses", "gemini_generate_content", "gemini_stream_generate_content")
ROUTES = (*_LLM_ROUTES, "compress", "passthrough")  # others appear on first use
# outcomes of a request of an LLM API route (chat completions, messages, responses, Gemini; also the x-ragopt-status
# response header); "overloaded" = answered 429
# "optimized_lexical" = optimized by the lexical tier (x-ragopt-status: optimized_lexical, the same spelling)
OUTCOMES = (
    "optimized",
    "optimized_lexical",
    "no_context",
    "no_query",
    "disabled",
    "fail_open",
    "rejected",
    "overloaded",
)
# outcomes of a POST /v1/compress request: "unchanged" = no compression asked for (nothing to score); "fail_open"
# = the documents returned as they came (the optimizer could not help); "rejected" = a 4xx; "overloaded" = a 429;
# a messages body (Headroom's contract) also: "no_context", "no_query", "disabled" (the messages returned as sent)
COMPRESS_OUTCOMES = (
    "optimized",
    "optimized_lexical",
    "unchanged",
    "no_context",
    "no_query",
    "disabled",
    "fail_open",
    "rejected",
    "overloaded",
)
TIERS = ("model", "lexical")
# why the lexical tier ran instead of the proxy model: the pool was overloaded (queue full, estimate over the
# budget); the time budget ran out first; the proxy model is still loading; the context is over
# --lexical-over-tokens
LEXICAL_REASONS = ("overload", "timeout", "loading", "size")
# why a request was forwarded unoptimized: the optimizer raised; the time budget ran out (waiting or running);
# the optimizer was overloaded (queue full, or the estimated wait + run exceeded the budget); the proxy model
# failed to load at start-up (pass-through mode)
# a request over the work limits (--max-documents before queueing, --max-units / --max-proxy-tokens in the worker)
FAIL_OPEN_REASONS = ("error", "timeout", "overload", "unavailable", "limit")
SHED_REASONS = ("queue_full", "estimate")
TIMEOUT_STAGES = ("queued", "running")
UPSTREAM_ERRORS = ("connect", "timeout", "stream", "invalid_response")
# requests the proxy answered itself before forwarding: 400 (bad input), 401, 413/414/431, 408 (the client did
# not send its headers or body in time), 503 (connection limit)
LOCAL_ERRORS = (
    "invalid_request",
    "unauthorized",
    "forbidden",
    "too_large",
    "request_timeout",
    "send_timeout",
    "too_many_connections",
)
OPTIMIZER_STATES = ("cold", "loading", "ready", "failed")
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
MAX_MODELS = 100  # distinct model names kept by /stats; later ones are counted under "other"
MAX_MODEL_CHARS = 200  # a longer model name is kept cut to this many characters (and marked so)
OTHER_MODEL = "other"


def _labelled(registry: CollectorRegistry, name: str, doc: str, label: str, values: tuple[str, ...]) -> Counter:
    """A counter with one label, every value in ``values`` shown (at 0) from the start."""
    counter = Counter(name, doc, [label], registry=registry)
    for value in values:
        counter.labels(value)
    return counter


class Metrics:
    """The metrics of one proxy app, on its own registry (``registry``). ``encoding_cache`` and ``encoding``
    (set by the app) say which encoding cache to report and the optimizer's encoding."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        reg = self.registry
        self._requests = _labelled(reg, "ragopt_requests", "Requests received by the proxy, by route.", "route", ROUTES)
        self._outcomes = _labelled(
            reg,
            "ragopt_chat_requests",
            "Chat completions, messages and responses requests by what rag-opt did.",
            "outcome",
            OUTCOMES,
        )
        self._compress = _labelled(
            reg,
            "ragopt_compress_requests",
            "POST /v1/compress requests by what rag-opt did.",
            "outcome",
            COMPRESS_OUTCOMES,
        )
        self._tiers = _labelled(
            reg, "ragopt_optimizations", "Optimizations written back, by the tier that scored.", "tier", TIERS
        )
        self._lexical = _labelled(
            reg,
            "ragopt_lexical_tier",
            "Optimizations sent to the lexical tier instead of the proxy model, by reason.",
            "reason",
            LEXICAL_REASONS,
        )
        self._fail_open = _labelled(
            reg, "ragopt_fail_open", "Requests forwarded unoptimized, by reason.", "reason", FAIL_OPEN_REASONS
        )
        self._shed = _labelled(
            reg,
            "ragopt_optimizer_shed",
            "Optimizations not admitted: queue full, or estimated wait + run over the time budget.",
            "reason",
            SHED_REASONS,
        )
        self._timeouts = _labelled(
            reg,
            "ragopt_optimizer_timeouts",
            "Optimizations over the time budget: still queued (never run) or running (left to finish).",
            "stage",
            TIMEOUT_STAGES,
        )
        self._abandoned = Counter(
            "ragopt_optimizer_abandoned_finished",
            "Timed-out optimizations that later finished on their worker (result discarded).",
            registry=reg,
        )
        self._cancelled = Counter(
            "ragopt_optimizer_cancelled",
            "Timed-out or abandoned optimizations stopped early, between stages or forward passes.",
            registry=reg,
        )
        self._local_errors = _labelled(
            reg, "ragopt_local_errors", "Requests the proxy refused itself (4xx, 503), by kind.", "kind", LOCAL_ERRORS
        )
        self._tokens_before = Counter(
            "ragopt_tokens_before", "Context tokens before optimization (target tokenizer).", registry=reg
        )
        self._tokens_after = Counter(
            "ragopt_tokens_after", "Context tokens after optimization (target tokenizer).", registry=reg
        )
        self._documents_before = Counter(
            "ragopt_documents_before", "Context documents found in requests.", registry=reg
        )
        self._documents_after = Counter("ragopt_documents_after", "Context documents kept (not dropped).", registry=reg)
        self._latency = Histogram(
            "ragopt_optimizer_latency_seconds",
            "Optimizer latency of finished optimizations.",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self._queue_wait = Histogram(
            "ragopt_optimizer_queue_wait_seconds",
            "Time admitted optimizations waited for a worker.",
            buckets=WAIT_BUCKETS,
            registry=reg,
        )
        self._batch = Histogram(
            "ragopt_optimizer_batch_size",
            "Jobs run together as one optimize_batch call (micro-batches of 2 or more).",
            buckets=BATCH_BUCKETS,
            registry=reg,
        )
        self._in_flight = Gauge(
            "ragopt_optimizations_in_flight", "Chat requests waiting for or running an optimization.", registry=reg
        )
        # pool gauges, read at scrape time: (queued, busy, workers, queue limit)
        self.pool_gauges: Callable[[], tuple[int, int, int, int]] = lambda: (0, 0, 0, 0)
        self.optimizer_state: Callable[[], str] = lambda: "cold"
        self.encoding_cache: Callable[[], EncodingCache | None] = lambda: None
        self.encoding: Callable[[], str | None] = lambda: None
        reg.register(EncodingCacheCollector(lambda: self.encoding_cache()))
        pool = (
            ("ragopt_optimizer_queue_depth", "Optimizations admitted and waiting for a worker.", 0),
            ("ragopt_optimizer_queue_limit", "Most optimizations that may wait for a worker.", 3),
            ("ragopt_optimizer_workers_busy", "Workers running an optimization (timed-out ones too).", 1),
            ("ragopt_optimizer_workers", "Optimizer worker threads (--max-concurrency).", 2),
        )
        for name, doc, k in pool:
            Gauge(name, doc, registry=reg).set_function(self._pool_gauge(k))
        state = Gauge(
            "ragopt_optimizer_state",
            "1 for the proxy model's current state (failed: pass-through).",
            ["state"],
            registry=reg,
        )
        for st in OPTIMIZER_STATES:
            state.labels(st).set_function(self._state_is(st))
        self._upstream_errors = _labelled(
            reg, "ragopt_upstream_errors", "Upstream failures by kind.", "kind", UPSTREAM_ERRORS
        )
        self._upstream_responses = Counter(
            "ragopt_upstream_responses", "Upstream responses relayed, by status code.", ["code"], registry=reg
        )
        # for GET /stats: since when, and the tokens by model (a name the client chose: bounded by MAX_MODELS)
        self.started = time.time()
        self._models_lock = threading.Lock()
        self._models: dict[str, list[int]] = {}  # model -> [optimizations, tokens before, tokens after]

    def _pool_gauge(self, k: int) -> Callable[[], float]:
        return lambda: float(self.pool_gauges()[k])

    def _state_is(self, st: str) -> Callable[[], float]:
        return lambda: float(self.optimizer_state() == st)

    # -- updates (their names and signatures are relied on by every route) ----------------------------------
    def request(self, route: str) -> None:
        self._requests.labels(route).inc()

    def outcome(self, outcome: str) -> None:
        self._outcomes.labels(outcome).inc()

    def compress_outcome(self, outcome: str) -> None:
        """Count one ``POST /v1/compress`` request by its outcome (:data:`COMPRESS_OUTCOMES`)."""
        self._compress.labels(outcome).inc()

    def failed_open(self, reason: str) -> None:
        self._fail_open.labels(reason).inc()

    def shed_load(self, reason: str) -> None:
        self._shed.labels(reason).inc()

    def timed_out(self, stage: str) -> None:
        self._timeouts.labels(stage).inc()

    def local_error(self, kind: str) -> None:
        self._local_errors.labels(kind).inc()

    def upstream_error(self, kind: str) -> None:
        self._upstream_errors.labels(kind).inc()

    def upstream_response(self, status: int) -> None:
        self._upstream_responses.labels(str(status)).inc()

    def queue_wait(self, seconds: float) -> None:
        self._queue_wait.observe(seconds)

    def abandoned_done(self) -> None:
        self._abandoned.inc()

    def cancelled(self) -> None:
        self._cancelled.inc()

    def batch(self, size: int) -> None:
        """Record one run of ``size`` (> 1) jobs as one ``optimize_batch`` call."""
        self._batch.observe(size)

    def lexical_used(self, reason: str) -> None:
        self._lexical.labels(reason).inc()

    def add_in_flight(self, n: int) -> None:
        self._in_flight.inc(n)

    def optimization(
        self,
        seconds: float,
        tokens_before: int,
        tokens_after: int,
        docs_before: int,
        docs_after: int,
        tier: str = "model",
        model: str | None = None,
    ) -> None:
        """Record one finished optimization (by the ``model`` or the ``lexical`` tier); ``model``: the LLM it was
        for (the request's ``model``, or the compress request's ``target``), for ``GET /stats``."""
        self._tiers.labels(tier).inc()
        self._tokens_before.inc(tokens_before)
        self._tokens_after.inc(tokens_after)
        self._documents_before.inc(docs_before)
        self._documents_after.inc(docs_after)
        self._latency.observe(seconds)
        name = model if model else "unknown"
        if len(name) > MAX_MODEL_CHARS:  # a name the client chose: bounded in length as in number
            name = name[:MAX_MODEL_CHARS] + "..."
        with self._models_lock:
            if name not in self._models and len(self._models) >= MAX_MODELS:
                name = OTHER_MODEL
            row = self._models.setdefault(name, [0, 0, 0])
            row[0] += 1
            row[1] += tokens_before
            row[2] += tokens_after

    # -- reading ----------------------------------------------------------------------------------------------
    def value(self, name: str, **labels: str) -> float:
        """The current value of one sample (0 when it has none yet), e.g.
        ``value("ragopt_fail_open_total", reason="error")``."""
        found = self.registry.get_sample_value(name, labels)
        return 0.0 if found is None else found

    @property
    def abandoned_finished(self) -> int:
        return int(self.value("ragopt_optimizer_abandoned_finished_total"))

    @property
    def tokens_before(self) -> int:
        return int(self.value("ragopt_tokens_before_total"))

    @property
    def tokens_after(self) -> int:
        return int(self.value("ragopt_tokens_after_total"))

    def render(self) -> str:
        """All metrics in the Prometheus text format (version 0.0.4)."""
        return generate_latest(self.registry).decode("utf-8")

    def _by_label(self, family: str, label: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for metric in self.registry.collect():
            if metric.name != family:
                continue
            for sample in metric.samples:
                if sample.name == family + "_total" and label in sample.labels:
                    out[sample.labels[label]] = int(sample.value)
        return out

    def stats(self) -> dict[str, Any]:
        """The ``GET /stats`` summary since the app started: requests by route and by outcome, tokens saved in
        total and per model (at most :data:`MAX_MODELS` names of at most :data:`MAX_MODEL_CHARS` characters),
        the optimizer's ``encoding`` and its ``encoding_cache`` counters (null: no cache)."""
        chat = self._by_label("ragopt_chat_requests", "outcome")
        compress = self._by_label("ragopt_compress_requests", "outcome")
        routes = self._by_label("ragopt_requests", "route")
        outcomes = {k: chat.get(k, 0) + compress.get(k, 0) for k in dict.fromkeys([*OUTCOMES, *COMPRESS_OUTCOMES])}
        outcomes["passthrough"] = routes.get("passthrough", 0)  # forwarded unchanged (routes with no context)
        outcomes["error"] = sum(self._by_label("ragopt_local_errors", "kind").values()) + sum(
            self._by_label("ragopt_upstream_errors", "kind").values()
        )
        before, after = self.tokens_before, self.tokens_after
        cache = self.encoding_cache()
        with self._models_lock:
            models = {
                name: {
                    "optimizations": n,
                    "tokens_before": b,
                    "tokens_after": a,
                    "tokens_saved": b - a,
                }
                for name, (n, b, a) in sorted(self._models.items())
            }
        return {
            "since": datetime.datetime.fromtimestamp(self.started, datetime.timezone.utc).isoformat(),
            "uptime_s": round(time.time() - self.started, 3),
            "requests": {
                "total": sum(routes.values()),
                "by_route": routes,
                "by_outcome": outcomes,
                "chat_completions": chat,
                "compress": compress,
                "fail_open": self._by_label("ragopt_fail_open", "reason"),
            },
            "tokens": {"before": before, "after": after, "saved": before - after},
            "models": models,
            "encoding": self.encoding(),
            "encoding_cache": cache.stats().to_dict() if cache is not None else None,
        }

    def stats_json(self) -> bytes:
        """:meth:`stats` as the JSON body of ``GET /stats`` (the app builds it off the event loop)."""
        return json.dumps(self.stats(), ensure_ascii=False, separators=(",", ":")).encode("utf-8")
