"""The proxy's counters, rendered in the Prometheus text exposition format (version 0.0.4).

Updated from the event loop and read by ``GET /metrics``; a lock keeps a scrape consistent anyway.
"""

from __future__ import annotations

import threading
from collections import Counter

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# outcomes of a chat completion request (also the x-ragopt-status response header)
OUTCOMES = ("optimized", "no_context", "no_query", "disabled", "fail_open", "rejected")
FAIL_OPEN_REASONS = ("error", "timeout")
UPSTREAM_ERRORS = ("connect", "timeout", "stream")
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Counters of one proxy app."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # by route: chat_completions, passthrough
        self.outcomes: Counter[str] = Counter()
        self.fail_open: Counter[str] = Counter()
        self.upstream_errors: Counter[str] = Counter()
        self.upstream_responses: Counter[str] = Counter()  # by status code
        self.tokens_before = 0
        self.tokens_after = 0
        self.documents_before = 0
        self.documents_after = 0
        self.in_flight = 0
        self._latency_buckets = [0] * len(LATENCY_BUCKETS)
        self._latency_sum = 0.0
        self._latency_count = 0

    def request(self, route: str) -> None:
        with self._lock:
            self.requests[route] += 1

    def outcome(self, outcome: str) -> None:
        with self._lock:
            self.outcomes[outcome] += 1

    def failed_open(self, reason: str) -> None:
        with self._lock:
            self.fail_open[reason] += 1

    def upstream_error(self, kind: str) -> None:
        with self._lock:
            self.upstream_errors[kind] += 1

    def upstream_response(self, status: int) -> None:
        with self._lock:
            self.upstream_responses[str(status)] += 1

    def optimization(
        self, seconds: float, tokens_before: int, tokens_after: int, docs_before: int, docs_after: int
    ) -> None:
        """Record one finished optimization."""
        with self._lock:
            self.tokens_before += tokens_before
            self.tokens_after += tokens_after
            self.documents_before += docs_before
            self.documents_after += docs_after
            self._observe(seconds)

    def _observe(self, seconds: float) -> None:
        for i, le in enumerate(LATENCY_BUCKETS):
            if seconds <= le:
                self._latency_buckets[i] += 1
        self._latency_sum += seconds
        self._latency_count += 1

    def render(self) -> str:
        """All metrics in the Prometheus text format."""
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
            family("ragopt_fail_open_total", "counter", "Requests forwarded unchanged because optimization failed.")
            for r in FAIL_OPEN_REASONS:
                out.append(f'ragopt_fail_open_total{{reason="{r}"}} {self.fail_open[r]}')
            family("ragopt_tokens_before_total", "counter", "Context tokens before optimization (target tokenizer).")
            out.append(f"ragopt_tokens_before_total {self.tokens_before}")
            family("ragopt_tokens_after_total", "counter", "Context tokens after optimization (target tokenizer).")
            out.append(f"ragopt_tokens_after_total {self.tokens_after}")
            family("ragopt_documents_before_total", "counter", "Context documents found in requests.")
            out.append(f"ragopt_documents_before_total {self.documents_before}")
            family("ragopt_documents_after_total", "counter", "Context documents kept (not dropped).")
            out.append(f"ragopt_documents_after_total {self.documents_after}")
            family("ragopt_optimizer_latency_seconds", "histogram", "Optimizer latency of finished optimizations.")
            for le, n in zip(LATENCY_BUCKETS, self._latency_buckets, strict=True):
                out.append(f'ragopt_optimizer_latency_seconds_bucket{{le="{le}"}} {n}')
            out.append(f'ragopt_optimizer_latency_seconds_bucket{{le="+Inf"}} {self._latency_count}')
            out.append(f"ragopt_optimizer_latency_seconds_sum {self._latency_sum:.6f}")
            out.append(f"ragopt_optimizer_latency_seconds_count {self._latency_count}")
            family("ragopt_optimizations_in_flight", "gauge", "Optimizations waiting or running now.")
            out.append(f"ragopt_optimizations_in_flight {self.in_flight}")
            family("ragopt_upstream_errors_total", "counter", "Upstream failures: connect, timeout, broken stream.")
            for k in UPSTREAM_ERRORS:
                out.append(f'ragopt_upstream_errors_total{{kind="{k}"}} {self.upstream_errors[k]}')
            family("ragopt_upstream_responses_total", "counter", "Upstream responses relayed, by status code.")
            for code in sorted(self.upstream_responses):
                out.append(f'ragopt_upstream_responses_total{{code="{code}"}} {self.upstream_responses[code]}')
            return "\n".join(out) + "\n"
