"""The proxy's counters, rendered in the Prometheus text exposition format (version 0.0.4).

Updated from the event loop and the optimizer's worker threads and read by ``GET /metrics``; a lock keeps every
update and a scrape consistent.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

__all__ = [
    "CONTENT_TYPE",
    "FAIL_OPEN_REASONS",
    "BATCH_BUCKETS",
    "LATENCY_BUCKETS",
    "LEXICAL_REASONS",
    "LOCAL_ERRORS",
    "OPTIMIZER_STATES",
    "OUTCOMES",
    "SHED_REASONS",
    "TIERS",
    "TIMEOUT_STAGES",
    "UPSTREAM_ERRORS",
    "WAIT_BUCKETS",
    "Histogram",
    "Metrics",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# outcomes of a chat completion request (also the x-ragopt-status response header); "overloaded" = answered 429
# "optimized_lexical" = optimized by the lexical tier (x-ragopt-status: optimized-lexical)
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
LOCAL_ERRORS = ("invalid_request", "unauthorized", "too_large", "request_timeout", "too_many_connections")
OPTIMIZER_STATES = ("cold", "loading", "ready", "failed")
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    """A cumulative Prometheus histogram."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, le in enumerate(self.buckets):
            if value <= le:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{le}"}} {n}' for le, n in zip(self.buckets, self.counts, strict=True)]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {self.sum:.6f}")
        out.append(f"{name}_count {self.count}")
        return out


class Metrics:
    """Counters of one proxy app."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # by route: chat_completions, passthrough
        self.outcomes: Counter[str] = Counter()
        self.fail_open: Counter[str] = Counter()
        self.shed: Counter[str] = Counter()
        self.timeouts: Counter[str] = Counter()
        self.local_errors: Counter[str] = Counter()
        self.upstream_errors: Counter[str] = Counter()
        self.upstream_responses: Counter[str] = Counter()  # by status code
        self.tokens_before = 0
        self.tokens_after = 0
        self.documents_before = 0
        self.documents_after = 0
        self.in_flight = 0  # chat requests waiting for or running an optimization
        self.abandoned_finished = 0  # optimizations that finished after their request had given up
        self.cancelled_running = 0  # ... of which stopped early at a checkpoint
        self._latency = Histogram(LATENCY_BUCKETS)
        self._queue_wait = Histogram(WAIT_BUCKETS)
        self._batch = Histogram(BATCH_BUCKETS)
        self.tiers: Counter[str] = Counter()  # finished optimizations by tier
        self.lexical: Counter[str] = Counter()  # lexical-tier optimizations by why the model did not run
        # pool gauges, read at scrape time: (queued, busy, workers, queue limit)
        self.pool_gauges: Callable[[], tuple[int, int, int, int]] = lambda: (0, 0, 0, 0)
        self.optimizer_state: Callable[[], str] = lambda: "cold"

    def request(self, route: str) -> None:
        with self._lock:
            self.requests[route] += 1

    def outcome(self, outcome: str) -> None:
        with self._lock:
            self.outcomes[outcome] += 1

    def failed_open(self, reason: str) -> None:
        with self._lock:
            self.fail_open[reason] += 1

    def shed_load(self, reason: str) -> None:
        with self._lock:
            self.shed[reason] += 1

    def timed_out(self, stage: str) -> None:
        with self._lock:
            self.timeouts[stage] += 1

    def local_error(self, kind: str) -> None:
        with self._lock:
            self.local_errors[kind] += 1

    def upstream_error(self, kind: str) -> None:
        with self._lock:
            self.upstream_errors[kind] += 1

    def upstream_response(self, status: int) -> None:
        with self._lock:
            self.upstream_responses[str(status)] += 1

    def queue_wait(self, seconds: float) -> None:
        with self._lock:
            self._queue_wait.observe(seconds)

    def abandoned_done(self) -> None:
        with self._lock:
            self.abandoned_finished += 1

    def cancelled(self) -> None:
        with self._lock:
            self.cancelled_running += 1

    def batch(self, size: int) -> None:
        """Record one run of ``size`` (> 1) jobs as one ``optimize_batch`` call."""
        with self._lock:
            self._batch.observe(size)

    def lexical_used(self, reason: str) -> None:
        with self._lock:
            self.lexical[reason] += 1

    def add_in_flight(self, n: int) -> None:
        with self._lock:
            self.in_flight += n

    def optimization(
        self,
        seconds: float,
        tokens_before: int,
        tokens_after: int,
        docs_before: int,
        docs_after: int,
        tier: str = "model",
    ) -> None:
        """Record one finished optimization (by the ``model`` or the ``lexical`` tier)."""
        with self._lock:
            self.tiers[tier] += 1
            self.tokens_before += tokens_before
            self.tokens_after += tokens_after
            self.documents_before += docs_before
            self.documents_after += docs_after
            self._latency.observe(seconds)

    def render(self) -> str:
        """All metrics in the Prometheus text format."""
        queued, busy, workers, queue_limit = self.pool_gauges()
        state = self.optimizer_state()
        with self._lock:
            out: list[str] = []

            def family(name: str, kind: str, help_text: str) -> None:
                out.append(f"# HELP {name} {help_text}")
                out.append(f"# TYPE {name} {kind}")

            family("ragopt_requests_total", "counter", "Requests received by the proxy, by route.")
            for route in sorted({"chat_completions", "passthrough", *self.requests}):
                out.append(f'ragopt_requests_total{{route="{route}"}} {self.requests[route]}')
            family("ragopt_chat_requests_total", "counter", "Chat completion requests by what rag-opt did.")
            for o in OUTCOMES:
                out.append(f'ragopt_chat_requests_total{{outcome="{o}"}} {self.outcomes[o]}')
            family("ragopt_optimizations_total", "counter", "Optimizations written back, by the tier that scored.")
            for t in TIERS:
                out.append(f'ragopt_optimizations_total{{tier="{t}"}} {self.tiers[t]}')
            family(
                "ragopt_lexical_tier_total",
                "counter",
                "Optimizations sent to the lexical tier instead of the proxy model, by reason.",
            )
            for r in LEXICAL_REASONS:
                out.append(f'ragopt_lexical_tier_total{{reason="{r}"}} {self.lexical[r]}')
            family("ragopt_fail_open_total", "counter", "Requests forwarded unoptimized, by reason.")
            for r in FAIL_OPEN_REASONS:
                out.append(f'ragopt_fail_open_total{{reason="{r}"}} {self.fail_open[r]}')
            family(
                "ragopt_optimizer_shed_total",
                "counter",
                "Optimizations not admitted: queue full, or estimated wait + run over the time budget.",
            )
            for r in SHED_REASONS:
                out.append(f'ragopt_optimizer_shed_total{{reason="{r}"}} {self.shed[r]}')
            family(
                "ragopt_optimizer_timeouts_total",
                "counter",
                "Optimizations over the time budget: still queued (never run) or running (left to finish).",
            )
            for st in TIMEOUT_STAGES:
                out.append(f'ragopt_optimizer_timeouts_total{{stage="{st}"}} {self.timeouts[st]}')
            family(
                "ragopt_optimizer_abandoned_finished_total",
                "counter",
                "Timed-out optimizations that later finished on their worker (result discarded).",
            )
            out.append(f"ragopt_optimizer_abandoned_finished_total {self.abandoned_finished}")
            family(
                "ragopt_optimizer_cancelled_total",
                "counter",
                "Timed-out or abandoned optimizations stopped early, between stages or forward passes.",
            )
            out.append(f"ragopt_optimizer_cancelled_total {self.cancelled_running}")
            family("ragopt_local_errors_total", "counter", "Requests the proxy refused itself (4xx, 503), by kind.")
            for k in LOCAL_ERRORS:
                out.append(f'ragopt_local_errors_total{{kind="{k}"}} {self.local_errors[k]}')
            family("ragopt_tokens_before_total", "counter", "Context tokens before optimization (target tokenizer).")
            out.append(f"ragopt_tokens_before_total {self.tokens_before}")
            family("ragopt_tokens_after_total", "counter", "Context tokens after optimization (target tokenizer).")
            out.append(f"ragopt_tokens_after_total {self.tokens_after}")
            family("ragopt_documents_before_total", "counter", "Context documents found in requests.")
            out.append(f"ragopt_documents_before_total {self.documents_before}")
            family("ragopt_documents_after_total", "counter", "Context documents kept (not dropped).")
            out.append(f"ragopt_documents_after_total {self.documents_after}")
            family("ragopt_optimizer_latency_seconds", "histogram", "Optimizer latency of finished optimizations.")
            out += self._latency.lines("ragopt_optimizer_latency_seconds")
            family(
                "ragopt_optimizer_queue_wait_seconds", "histogram", "Time admitted optimizations waited for a worker."
            )
            out += self._queue_wait.lines("ragopt_optimizer_queue_wait_seconds")
            family(
                "ragopt_optimizer_batch_size",
                "histogram",
                "Jobs run together as one optimize_batch call (micro-batches of 2 or more).",
            )
            out += self._batch.lines("ragopt_optimizer_batch_size")
            family("ragopt_optimizations_in_flight", "gauge", "Chat requests waiting for or running an optimization.")
            out.append(f"ragopt_optimizations_in_flight {self.in_flight}")
            family("ragopt_optimizer_queue_depth", "gauge", "Optimizations admitted and waiting for a worker.")
            out.append(f"ragopt_optimizer_queue_depth {queued}")
            family("ragopt_optimizer_queue_limit", "gauge", "Most optimizations that may wait for a worker.")
            out.append(f"ragopt_optimizer_queue_limit {queue_limit}")
            family("ragopt_optimizer_workers_busy", "gauge", "Workers running an optimization (timed-out ones too).")
            out.append(f"ragopt_optimizer_workers_busy {busy}")
            family("ragopt_optimizer_workers", "gauge", "Optimizer worker threads (--max-concurrency).")
            out.append(f"ragopt_optimizer_workers {workers}")
            family("ragopt_optimizer_state", "gauge", "1 for the proxy model's current state (failed: pass-through).")
            for st in OPTIMIZER_STATES:
                out.append(f'ragopt_optimizer_state{{state="{st}"}} {int(st == state)}')
            family("ragopt_upstream_errors_total", "counter", "Upstream failures by kind.")
            for k in UPSTREAM_ERRORS:
                out.append(f'ragopt_upstream_errors_total{{kind="{k}"}} {self.upstream_errors[k]}')
            family("ragopt_upstream_responses_total", "counter", "Upstream responses relayed, by status code.")
            for code in sorted(self.upstream_responses):
                out.append(f'ragopt_upstream_responses_total{{code="{code}"}} {self.upstream_responses[code]}')
            return "\n".join(out) + "\n"
