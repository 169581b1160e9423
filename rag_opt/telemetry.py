"""OpenTelemetry: one span per optimization, ``rag_opt.optimize``, with what it did as attributes.

Off unless asked for: ``rag-opt serve --otel`` (``RAG_OPT_OTEL=1``) records one span per request that reaches an
outcome on an optimized route or ``/v1/compress``, a child of the request's W3C ``traceparent`` (which the proxy
forwards upstream unchanged); in the library, :func:`enable` records one per optimized context, a child of the
caller's current span. opentelemetry is imported only then: rag-opt works without it (``--otel`` without it is a
:class:`~rag_opt.errors.ConfigurationError` naming the ``otel`` extra).

Where the spans go is OpenTelemetry's standard configuration: a tracer provider the application (or
``opentelemetry-instrument``) set is used as it is; without one, rag-opt sets one from the ``OTEL_*`` variables:
``OTEL_TRACES_EXPORTER`` (``otlp``, the default; ``console``; ``none``; a comma-separated list),
``OTEL_EXPORTER_OTLP_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (``http/protobuf``, the default, or
``grpc``), ``OTEL_EXPORTER_OTLP_ENDPOINT`` and the exporter's other variables, ``OTEL_SERVICE_NAME`` (default
``rag-opt``), ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``, ``OTEL_SDK_DISABLED``.

The span's attributes (:func:`span_attributes`): ``rag_opt.status`` (as ``x-ragopt-status``), ``rag_opt.reason``,
``rag_opt.tier``, ``rag_opt.tokens_before``, ``rag_opt.tokens_after``, ``rag_opt.ratio``, ``rag_opt.cache_hits``,
``rag_opt.cache_misses``, ``rag_opt.encoding``, ``rag_opt.scorer``, ``rag_opt.ordering``,
``rag_opt.documents_before``, ``rag_opt.documents_after``, ``rag_opt.over_budget`` and the stage timings
``rag_opt.segment_ms``, ``rag_opt.load_ms``, ``rag_opt.score_ms``, ``rag_opt.select_ms``, ``rag_opt.order_ms``,
``rag_opt.total_ms`` (which includes ``load_ms``: the scorer's loading, on the first call);
on the server also ``rag_opt.route`` (the request's path; and ``rag_opt.contexts`` for a request with several
contexts: its values are their sums). Without a result (fail-open, no context) only the status, reason and tier
``none``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from rag_opt.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.types import OptimizeResult

__all__ = [
    "SPAN_NAME",
    "SpanRecorder",
    "enable",
    "enabled",
    "record_result",
    "span_attributes",
    "untraced",
]

logger = logging.getLogger(__name__)

SPAN_NAME = "rag_opt.optimize"
_SCOPE = "rag_opt"
_STAGES = ("segment_ms", "load_ms", "score_ms", "select_ms", "order_ms", "total_ms")
_state = {"library": False}
_lock = threading.Lock()
_untraced: ContextVar[bool] = ContextVar("rag_opt_untraced", default=False)


def enable(on: bool = True) -> None:
    """Record a ``rag_opt.optimize`` span for each context the library optimizes (``on=False``: stop). Checks
    that opentelemetry is installed (else :class:`~rag_opt.errors.ConfigurationError`)."""
    if on:
        _tracer()
    _state["library"] = bool(on)


def enabled() -> bool:
    """Whether the library records spans (:func:`enable`)."""
    return _state["library"]


@contextmanager
def untraced() -> Iterator[None]:
    """No library span inside (the server records its own, one per request, with the request's outcome)."""
    token = _untraced.set(True)
    try:
        yield
    finally:
        _untraced.reset(token)


def _status(result: OptimizeResult) -> str:
    if result.tier == "none":
        return "unchanged"
    return "optimized_lexical" if result.tier == "lexical" else "optimized"


def span_attributes(
    status: str,
    reason: str | None = None,
    results: Sequence[OptimizeResult] = (),
    **extra: str | int | float | None,
) -> dict[str, str | int | float]:
    """The span's attributes (see the module docstring) for the optimized contexts ``results`` of one request
    (usually one; several, e.g. a messages body with several contexts: summed, ``rag_opt.tier`` ``mixed`` when
    their tiers differ); ``extra``: more ``rag_opt.<name>`` attributes (None: left out)."""
    out: dict[str, Any] = {"rag_opt.status": status, "rag_opt.reason": reason, "rag_opt.tier": "none"}
    if results:
        before = sum(r.tokens_before for r in results)
        after = sum(r.tokens_after for r in results)
        tiers = {r.tier for r in results}
        first = results[0]
        out.update(
            {
                "rag_opt.tier": first.tier if len(tiers) == 1 else "mixed",
                "rag_opt.tokens_before": before,
                "rag_opt.tokens_after": after,
                "rag_opt.ratio": after / before if before else 1.0,
                "rag_opt.cache_hits": sum(r.cache_hits for r in results),
                "rag_opt.cache_misses": sum(r.cache_misses for r in results),
                "rag_opt.encoding": first.encoding,
                "rag_opt.scorer": first.scorer,
                "rag_opt.ordering": first.ordering,
                "rag_opt.documents_before": sum(len(r.documents) + len(r.dropped) for r in results),
                "rag_opt.documents_after": sum(len(r.documents) for r in results),
                "rag_opt.over_budget": sum(r.over_budget for r in results),
                **{f"rag_opt.{k}": sum(getattr(r.timings, k) for r in results) for k in _STAGES},
            }
        )
        if len(results) > 1:
            out["rag_opt.contexts"] = len(results)
    out.update({f"rag_opt.{k}": v for k, v in extra.items()})
    return {k: v for k, v in out.items() if v is not None}


def record_result(result: OptimizeResult) -> None:
    """The library's span for one optimized context (when :func:`enable` d, outside :func:`untraced`): a child of
    the current span, over the optimization's ``total_ms``. Never raises: a tracing failure is logged."""
    if not _state["library"] or _untraced.get():
        return
    try:
        start = time.time_ns() - int(result.timings.total_ms * 1e6)
        _record(_tracer(), None, span_attributes(_status(result), results=[result]), start)
    except Exception as exc:  # tracing must never fail an optimization
        logger.warning("recording the OpenTelemetry span failed (%s)", type(exc).__name__)


class SpanRecorder:
    """The server's spans (``--otel``): :meth:`record` one per request outcome; nothing when off."""

    def __init__(self, on: bool) -> None:
        self._tracer = _tracer() if on else None

    @property
    def on(self) -> bool:
        return self._tracer is not None

    def record(
        self,
        headers: Mapping[str, str],
        status: str,
        reason: str | None,
        results: OptimizeResult | Sequence[OptimizeResult] | None,
        t0: float,
        route: str | None = None,
    ) -> None:
        """One ``rag_opt.optimize`` span from ``t0`` (``time.perf_counter()`` when the request began) to now, a
        child of the W3C ``traceparent`` in ``headers`` (a root span without one), for a request whose optimized
        contexts are ``results`` (one, several, or None). Never raises: a failure is logged."""
        if self._tracer is None:
            return
        try:
            from opentelemetry.propagate import extract

            parent = extract(headers)
            done = [] if results is None else [results] if not isinstance(results, Sequence) else list(results)
            start_ns = time.time_ns() - int((time.perf_counter() - t0) * 1e9)
            _record(self._tracer, parent, span_attributes(status, reason, done, route=route), start_ns)
        except Exception as exc:  # tracing must never fail a request
            logger.warning("recording the OpenTelemetry span failed (%s)", type(exc).__name__)

    def flush(self, timeout_ms: int = 2000) -> None:
        """Export what is buffered (at shutdown), when rag-opt set the tracer provider up."""
        if self._tracer is None:
            return
        from opentelemetry import trace

        flush = getattr(trace.get_tracer_provider(), "force_flush", None)
        if callable(flush):
            try:
                flush(timeout_ms)
            except Exception as exc:  # pragma: no cover - an exporter's failure at shutdown
                logger.warning("flushing the OpenTelemetry spans failed (%s)", type(exc).__name__)


def _record(tracer: Any, parent: Any, attributes: Mapping[str, str | int | float], start_ns: int) -> None:
    span = tracer.start_span(SPAN_NAME, context=parent, attributes=dict(attributes), start_time=start_ns)
    span.end()


def _tracer() -> Any:
    """rag-opt's tracer, from the global tracer provider (set up from the ``OTEL_*`` variables when nobody did)."""
    try:
        from opentelemetry import trace
    except ImportError:
        from rag_opt.install import install_hint

        raise ConfigurationError(
            f"OpenTelemetry spans need opentelemetry-sdk and its OTLP exporter: {install_hint('otel')}"
        ) from None
    with _lock:
        if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):  # nobody set one: from OTEL_*
            trace.set_tracer_provider(_provider_from_environment())
    return trace.get_tracer(_SCOPE)


def _provider_from_environment() -> Any:
    """A tracer provider with the exporters the ``OTEL_*`` variables name (see the module docstring)."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        from rag_opt.install import install_hint

        raise ConfigurationError(f"OpenTelemetry spans need opentelemetry-sdk: {install_hint('otel')}") from None
    named = "OTEL_SERVICE_NAME" in os.environ or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    provider = TracerProvider(resource=Resource.create({} if named else {"service.name": "rag-opt"}))
    names = [n.strip().lower() for n in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if n.strip()]
    for name in names:
        if name == "none":
            continue
        if name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(out=sys.stdout)))
        elif name == "otlp":
            provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
        else:
            raise ConfigurationError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} (use otlp, console or none)")
    return provider


def _otlp_exporter() -> Any:
    """The OTLP span exporter of the protocol the variables name (``http/protobuf`` by default, or ``grpc``)."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    try:
        if protocol.strip().lower() == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol.strip().lower() in ("http/protobuf", "http"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
        else:
            raise ConfigurationError(f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not grpc or http/protobuf")
    except ImportError:
        from rag_opt.install import install_hint

        raise ConfigurationError(
            f"the OTLP exporter (OTEL_TRACES_EXPORTER=otlp) needs opentelemetry-exporter-otlp: {install_hint('otel')}"
        ) from None
    return OTLPSpanExporter()
