"""Micro-batching: optimizations submitted close together share the proxy's forward passes.

Callers in several threads or coroutines (the HTTP server, LlamaIndex's async path) each submit one
question; a worker thread waits at most ``max_wait_ms`` after the first one for others with the same settings
and runs them through one :meth:`~rag_opt.ContextOptimizer.optimize_batch` call. A batch that fails is retried
one question at a time, so one bad input never fails its neighbours.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rag_opt.errors import InvalidInputError

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.types import DocumentLike, OptimizeResult

__all__ = ["Batchable", "MicroBatcher"]


class Batchable(Protocol):
    """What a :class:`MicroBatcher` drives: :class:`~rag_opt.ContextOptimizer` (this module does not import it, so
    the pipeline and the batcher do not depend on each other)."""

    @property
    def optimize(self) -> Callable[..., OptimizeResult]: ...

    @property
    def optimize_batch(self) -> Callable[..., list[OptimizeResult]]: ...


logger = logging.getLogger(__name__)


@dataclass
class _Request:
    query: str
    documents: Sequence[DocumentLike]
    settings: tuple[tuple[str, Any], ...]
    future: Future[OptimizeResult] = field(default_factory=Future)


# the server batches on its own pool instead (rag_opt.server.pool.OptimizerPool.run_batched: budgets, admission)
class MicroBatcher:
    """Coalesces optimizations of one :class:`~rag_opt.ContextOptimizer` into batched calls.

    Args:
        optimizer: the optimizer whose ``optimize_batch`` runs the batches.
        max_wait_ms: how long the first request of a batch waits for company (0: only what is already queued).
        max_batch: the most questions in one batch.
    """

    def __init__(self, optimizer: Batchable, *, max_wait_ms: float = 5.0, max_batch: int = 16) -> None:
        if max_wait_ms < 0 or max_batch < 1:
            raise InvalidInputError("max_wait_ms must be >= 0 and max_batch >= 1")
        self.optimizer = optimizer
        self.max_wait_ms = max_wait_ms
        self.max_batch = max_batch
        self.batches: list[int] = []  # sizes of the batches run so far (for tests and metrics)
        self._queue: queue.Queue[_Request] = queue.Queue()
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None

    def submit(self, query: str, documents: Sequence[DocumentLike], **settings: Any) -> Future[OptimizeResult]:
        """Queue one optimization (``settings``: the keyword arguments of ``optimize``); returns its future."""
        request = _Request(query, documents, tuple(sorted(settings.items())))
        self._ensure_worker()
        self._queue.put(request)
        return request.future

    async def optimize(self, query: str, documents: Sequence[DocumentLike], **settings: Any) -> OptimizeResult:
        """Awaitable :meth:`submit`."""
        return await asyncio.wrap_future(self.submit(query, documents, **settings))

    def _ensure_worker(self) -> None:
        with self._lock:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._run, name="rag-opt-batcher", daemon=True)
                self._worker.start()

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            batch = [first]
            deadline = time.monotonic() + self.max_wait_ms / 1e3
            later: list[_Request] = []
            while len(batch) < self.max_batch:
                try:
                    nxt = self._queue.get(timeout=max(deadline - time.monotonic(), 0))
                except queue.Empty:
                    break
                (batch if nxt.settings == first.settings else later).append(nxt)
            for request in later:  # other settings: their own batch next
                self._queue.put(request)
            self._execute(batch)

    def _execute(self, batch: list[_Request]) -> None:
        live = [r for r in batch if r.future.set_running_or_notify_cancel()]
        if not live:
            return
        self.batches.append(len(live))
        settings = dict(live[0].settings)
        try:
            results = self.optimizer.optimize_batch([r.query for r in live], [r.documents for r in live], **settings)
        except Exception as exc:  # one bad input fails the batch: run them one by one so each gets its own outcome
            if len(live) == 1:
                live[0].future.set_exception(exc)
                return
            logger.debug("a batch of %d failed; retrying its questions one by one", len(live))
            for r in live:
                try:
                    r.future.set_result(self.optimizer.optimize(r.query, r.documents, **settings))
                except Exception as exc:
                    r.future.set_exception(exc)
            return
        for r, result in zip(live, results, strict=True):
            r.future.set_result(result)
