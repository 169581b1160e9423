"""What one proxy app holds: settings, the optimizer and its state, metrics, the worker pool and the upstream."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from rag_opt.models.encoding_cache import EncodingCache
from rag_opt.server.metrics import Metrics
from rag_opt.server.pool import OptimizerPool
from rag_opt.server.security import redact
from rag_opt.server.settings import ProxySettings
from rag_opt.server.targets import AllowedTargets
from rag_opt.server.upstream import Upstream
from rag_opt.telemetry import SpanRecorder
from rag_opt.wire.offload import off_loop

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.pipeline import ContextOptimizer
    from rag_opt.types import OptimizeResult

__all__ = ["Optimizer", "ProxyState", "build_encoding_cache", "build_optimizer"]

logger = logging.getLogger(__name__)


class Optimizer(Protocol):
    """What the proxy calls: :meth:`rag_opt.ContextOptimizer.optimize`. A ``ContextOptimizer`` also has
    ``optimize_batch`` (micro-batching) and the ``tier`` argument (the lexical tier): the proxy uses them when the
    optimizer has them (``optimize_batch``, ``lexical_scorer``)."""

    def optimize(
        self,
        query: str,
        documents: Sequence[Any],
        *,
        ratio: float | None = None,
        target_tokens: int | None = None,
        threshold: float | None = None,
        ordering: str | None = None,
    ) -> OptimizeResult: ...


def build_encoding_cache(settings: ProxySettings) -> EncodingCache | None:
    """The process's one encoding cache from the settings: None when the encoding is not parallel, with
    ``--no-cache``, or with ``--cache-bytes 0`` and no ``--cache-dir`` (nothing could be kept)."""
    if settings.options.encoding != "parallel" or not settings.encoding_cache:
        return None
    if settings.encoding_cache_bytes == 0 and settings.encoding_cache_dir is None and not settings.encoding_cache_url:
        return None
    shared = None
    if settings.encoding_cache_url:
        from rag_opt.models.cache_redis import RedisTier

        timeout = settings.encoding_cache_timeout_ms / 1e3
        shared = RedisTier(
            settings.encoding_cache_url,
            ttl=settings.encoding_cache_ttl,
            timeout=timeout,
            connect_timeout=max(timeout, 0.2),
        )
    return EncodingCache(
        settings.encoding_cache_bytes,
        disk=settings.encoding_cache_dir,
        disk_bytes=settings.encoding_cache_disk_bytes,
        shared=shared,
        format=settings.encoding_cache_format,
        decoded_bytes=settings.encoding_cache_decoded_bytes,
    )


def build_optimizer(settings: ProxySettings) -> ContextOptimizer:
    """The server's :class:`~rag_opt.ContextOptimizer`: the options of the settings (:attr:`ProxySettings.options`),
    with the server's own thread policy (its workers share the cores) and the one encoding cache of the process
    (every request and worker shares it)."""
    from rag_opt.models.threads import ThreadPolicy
    from rag_opt.pipeline import ContextOptimizer

    threads: int | str = int(settings.threads) if settings.threads.isdigit() else settings.threads
    return ContextOptimizer(
        settings.options,
        threads=ThreadPolicy(threads, workers=settings.max_concurrency),
        cache=build_encoding_cache(settings),
    )


def _describe(cache: EncodingCache | None) -> str:
    if cache is None:
        return "no encoding cache"
    disk = f", disk tier {cache.disk}" if cache.disk is not None else ""
    shared = f", shared tier {getattr(cache.shared_tier, 'url', 'custom')}" if cache.shared_tier is not None else ""
    return f"encoding cache ({cache.format.name}): {cache.max_bytes / 2**20:g} MiB in memory{disk}{shared}"


class ProxyState:
    """Everything one proxy app holds (``app.state.ragopt``).

    ``optimizer_state`` is ``cold`` (not loaded), ``loading``, ``ready`` or ``failed`` (the proxy model did not
    load: the proxy serves in pass-through mode). ``pool`` runs the proxy model's optimizations and
    :attr:`lexical_pool` the lexical tier's. ``cache`` is the encoding cache every request and worker shares
    (the optimizer's; built from the settings for the optimizer the app builds), or None; ``encoding`` the
    optimizer's encoding (None: an optimizer that does not say).
    """

    def __init__(self, settings: ProxySettings, optimizer: Optimizer | None) -> None:
        self.settings = settings
        if optimizer is None:
            optimizer = build_optimizer(settings)
        self.optimizer: Optimizer = optimizer
        cache = getattr(optimizer, "cache", None)
        self.cache: EncodingCache | None = cache if isinstance(cache, EncodingCache) else None
        encoding = getattr(optimizer, "encoding", None)
        self.encoding: str | None = encoding if isinstance(encoding, str) else None
        if self.encoding is not None:
            logger.info("encoding: %s; %s", self.encoding, _describe(self.cache))
        self.optimizer_state = "cold"
        keys = (settings.api_key, settings.upstream_api_key, settings.gemini_upstream_api_key)
        self.secrets = tuple(k.get_secret_value() for k in keys if k is not None)
        self.metrics = Metrics()
        self.pool = OptimizerPool(
            settings.max_concurrency,
            settings.queue_bound,
            self.metrics,
            settings.optimizer_nice,
            batch_wait_ms=settings.batch_wait_ms,
            max_batch=settings.batch_bound,
        )
        # the lexical tier needs an optimizer that has one (a ContextOptimizer; not an arbitrary ``optimize``)
        self.lexical_tier = settings.lexical_tier and callable(getattr(optimizer, "lexical_scorer", None))
        # batches need ``optimize_batch``; other optimizers run one job at a time
        self.batching = settings.batch_bound > 1 and callable(getattr(optimizer, "optimize_batch", None))
        self.metrics.pool_gauges = self.pool.gauges
        self.metrics.optimizer_state = lambda: self.optimizer_state
        self.metrics.encoding_cache = lambda: self.cache
        self.metrics.encoding = lambda: self.encoding
        self.upstream = Upstream(settings, self.metrics, self.secrets)
        self.tracing = SpanRecorder(settings.otel)  # --otel: a span per request outcome (nothing when off)
        # the target tokenizers a request may name (/v1/compress): only these ever load
        self.targets = AllowedTargets(settings.allowed_targets, settings.options.target)
        self._lexical_pool: OptimizerPool | None = None

    @property
    def lexical_pool(self) -> OptimizerPool:
        """The lexical tier's worker pool, started on first use: a worker per core (few threads, little memory),
        ``--max-lexical-queue`` more waiting, at the optimizer's lower CPU priority; no micro-batching (a lexical
        run takes milliseconds)."""
        if self._lexical_pool is None:
            from rag_opt.models.threads import available_cores

            s = self.settings
            self._lexical_pool = OptimizerPool(available_cores(), s.max_lexical_queue, self.metrics, s.optimizer_nice)
        return self._lexical_pool

    @property
    def ready(self) -> bool:
        """Ready to serve as configured: the proxy model has loaded, or failed to (pass-through mode is settled),
        or is loaded on first use (``--no-warmup``)."""
        return self.optimizer_state in ("ready", "failed") or (
            self.optimizer_state == "cold" and not self.settings.warmup
        )

    @property
    def mode(self) -> str:
        """``pass-through`` when the proxy model failed to load, else ``optimizing``."""
        return "pass-through" if self.optimizer_state == "failed" else "optimizing"

    def why(self, exc: BaseException) -> str:
        """An exception for a log line: its type, and its message (which may quote request content) only with
        ``--log-bodies``, redacted; the traceback then at debug level."""
        if not self.settings.log_bodies:
            return type(exc).__name__
        logger.debug("traceback", exc_info=exc)
        return f"{type(exc).__name__}: {redact(str(exc), self.secrets)}"

    async def aclose(self) -> None:
        """Close the upstream client and stop the worker pools."""
        await self.upstream.aclose()
        if self.tracing.on:  # the spans still buffered, exported (with a bound)
            await off_loop(1 << 20, self.tracing.flush)
        self.pool.shutdown()
        if self._lexical_pool is not None:
            self._lexical_pool.shutdown()
        if self.cache is not None:  # its store tiers' background writes: finished (with a bound), then released
            cache = self.cache
            await off_loop(1 << 20, cache.close)
