"""A bounded worker pool with a bounded queue for the proxy's optimizations, driven from the event loop.

The proxy model is CPU/GPU-bound, so optimizations run on ``workers`` threads, never on the event loop. At most
``max_queue`` more may wait for a worker. :meth:`OptimizerPool.run` admits a job only when it can plausibly
finish within its time budget:

- a free worker: admitted (a free worker costs nothing, and it keeps the latency estimate fresh);
- otherwise, when ``max_queue`` jobs already wait: not admitted (:class:`Overloaded` ``"queue_full"``);
- otherwise, when the estimated wait for a worker plus one typical run (an exponential moving average of recent
  run times) exceeds the budget: not admitted (:class:`Overloaded` ``"estimate"``).

An admitted job that is still waiting when its budget runs out is cancelled (it never runs: no wasted work).
One that is running cannot be interrupted from outside its thread: it is told to stop (its cancel event, see
:mod:`rag_opt.work`), which the optimizer checks between its stages and between forward passes; until then it
keeps its worker busy, which the admission estimate accounts for, and its result is discarded.
:class:`BudgetExceeded` says which. The budget is measured by :attr:`OptimizerPool.sleep` (``asyncio.sleep``;
tests replace it with a clock they control).

Worker threads run at a lower CPU priority (``nice``, Linux) than the event loop: on a busy CPU, requests
without context keep being served at full speed and optimizations take the time left over.

Lighter work that must not stall the event loop either (parsing and rewriting large request bodies, checking
large responses) goes through :func:`off_loop`: inline when small, else on one of anyio's worker threads.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio.to_thread

from rag_opt.errors import Cancelled, ConfigurationError
from rag_opt.server.errors import BudgetExceeded, Overloaded
from rag_opt.server.metrics import Metrics
from rag_opt.work import scope

__all__ = ["EWMA_ALPHA", "INLINE_BYTES", "OptimizerPool", "off_loop", "retry_after_s"]

T = TypeVar("T")
EWMA_ALPHA = 0.3
INLINE_BYTES = 64 * 1024  # inputs larger than this are handled on a worker thread by off_loop


@dataclass
class _Job(Generic[T]):
    fn: Callable[[], T]
    record: bool
    enqueued: float = field(default_factory=time.monotonic)
    started: bool = False
    abandoned: bool = False
    future: Future[T] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)  # set when its waiter gives up


class OptimizerPool:
    """``workers`` threads and at most ``max_queue`` waiting jobs; see the module docstring."""

    def __init__(self, workers: int, max_queue: int, metrics: Metrics | None = None, nice: int = 0) -> None:
        if workers < 1 or max_queue < 0:
            raise ConfigurationError("workers must be >= 1 and max_queue >= 0")
        self.workers = workers
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self._executor = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="rag-opt", initializer=_lower_priority, initargs=(nice,)
        )
        self._lock = threading.Lock()
        self._queued = 0  # admitted, not started (and not cancelled)
        self._busy = 0  # running on a worker, timed-out ones included
        self._avg_s: float | None = None  # moving average of recorded run times
        self.sleep: Callable[[float], Awaitable[object]] = asyncio.sleep  # measures the time budgets

    # -- state ----------------------------------------------------------------------------------------------
    def gauges(self) -> tuple[int, int, int, int]:
        """(queued, busy, workers, max_queue), for the metrics."""
        with self._lock:
            return self._queued, self._busy, self.workers, self.max_queue

    @property
    def average_run_s(self) -> float | None:
        return self._avg_s

    def _estimate_locked(self) -> float | None:
        """Estimated seconds until a job admitted now would finish (None: no run time known yet)."""
        ahead = self._busy + self._queued
        if self._avg_s is None:
            return None
        if ahead < self.workers:
            return self._avg_s
        rounds = (ahead - self.workers) // self.workers + 1  # runs to wait for before a worker frees up
        return (rounds + 1) * self._avg_s

    def estimate_s(self) -> float | None:
        with self._lock:
            return self._estimate_locked()

    # -- running jobs ---------------------------------------------------------------------------------------
    def _admit(self, job: _Job[T], budget_s: float | None) -> Future[T]:
        with self._lock:
            ahead = self._busy + self._queued
            if ahead >= self.workers:  # it would wait for a worker
                if ahead - self.workers >= self.max_queue:
                    raise Overloaded("queue_full")
                est = self._estimate_locked()
                if budget_s is not None and est is not None and est > budget_s:
                    raise Overloaded("estimate", est)
            self._queued += 1
            fut = self._executor.submit(self._work, job)
            job.future = fut
            return fut

    def _work(self, job: _Job[T]) -> T:
        with self._lock:
            self._queued -= 1
            if job.abandoned:  # gave up between the future starting and here: skip
                raise BudgetExceeded("queued")
            job.started = True
            self._busy += 1
        self.metrics.queue_wait(time.monotonic() - job.enqueued)
        t0 = time.monotonic()
        ok = False
        try:
            with scope(cancel=job.cancel):
                out = job.fn()
            ok = True
            return out
        except Cancelled:
            self.metrics.cancelled()
            raise
        finally:
            elapsed = time.monotonic() - t0
            with self._lock:
                self._busy -= 1
                if ok and job.record:
                    prev = self._avg_s
                    self._avg_s = elapsed if prev is None else (1 - EWMA_ALPHA) * prev + EWMA_ALPHA * elapsed
                abandoned = job.abandoned
            if abandoned:
                self.metrics.abandoned_done()

    def submit_background(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the pool without waiting (the model warm-up); it occupies a worker like any job."""
        self._admit(_Job(fn, record=False), None)

    def _abandon(self, job: _Job[T]) -> str:
        """The waiter gives up on ``job``: cancel it if it has not started. Returns the stage it was in."""
        with self._lock:
            job.abandoned = True
            job.cancel.set()  # a running job stops at its next checkpoint
            if job.started:
                return "running"
            if job.future is not None and job.future.cancel():  # never ran, never will
                self._queued -= 1
            return "queued"

    async def run(self, fn: Callable[[], T], budget_s: float) -> T:
        """Run ``fn`` on a worker and return its result within ``budget_s`` seconds.

        Raises :class:`~rag_opt.server.errors.Overloaded` (not admitted),
        :class:`~rag_opt.server.errors.BudgetExceeded` (the budget ran out) or whatever
        ``fn`` raised. If the awaiting task is cancelled (the client left), the job is abandoned the same way.
        """
        job: _Job[T] = _Job(fn, record=True)
        cfut = self._admit(job, budget_s)
        afut = asyncio.wrap_future(cfut)
        timer: asyncio.Future[Any] = asyncio.ensure_future(self.sleep(budget_s))
        finished = False
        try:
            await asyncio.wait([afut, timer], return_when=asyncio.FIRST_COMPLETED)
            if afut.done():
                finished = True
                return afut.result()
        finally:
            timer.cancel()
            timer.add_done_callback(_consume)
            if not finished:
                stage = self._abandon(job)
                afut.add_done_callback(_consume)
        raise BudgetExceeded(stage)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _lower_priority(nice: int) -> None:
    """Raise this worker thread's nice value by ``nice`` (Linux schedules threads on their own): under CPU
    contention the kernel then runs the event loop first, so requests keep flowing while optimizations run.
    Threads the worker starts (torch's intra-op pool) inherit it. Elsewhere, or if refused, nothing changes."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except (OSError, AttributeError):  # pragma: no cover
        pass


def _consume(fut: asyncio.Future[Any]) -> None:
    """Retrieve an abandoned job's outcome so asyncio does not log 'exception was never retrieved'."""
    if not fut.cancelled():
        fut.exception()


def retry_after_s(estimate_s: float | None, budget_s: float) -> int:
    """A Retry-After value (whole seconds, at least 1) for an overloaded answer."""
    return max(1, math.ceil(estimate_s if estimate_s is not None else budget_s))


async def off_loop(size: int, fn: Callable[[], T]) -> T:
    """Run ``fn`` inline for small inputs (``size`` up to :data:`INLINE_BYTES`), on a worker thread for large
    ones (the event loop never stalls)."""
    if size <= INLINE_BYTES:
        return fn()
    return await anyio.to_thread.run_sync(fn)
