"""A bounded worker pool with a bounded queue for the proxy's optimizations, driven from the event loop.

The proxy model is CPU/GPU-bound, so optimizations run on ``workers`` threads, never on the event loop. At most
``max_queue`` more may wait for a worker. :meth:`OptimizerPool.run` admits a job only when it can plausibly
finish within its time budget:

- a free worker: admitted (a free worker costs nothing, and it keeps the latency estimate fresh);
- otherwise, when ``max_queue`` jobs already wait: not admitted (:class:`Overloaded` ``"queue_full"``);
- otherwise, when the estimated wait for a worker plus one typical run (an exponential moving average of recent
  run times) exceeds the budget: not admitted (:class:`Overloaded` ``"estimate"``). The wait counts the age of the
  runs now going: one past the average is expected to run about as long again, so a request that holds the worker
  sends later ones to the lexical tier at once instead of letting them wait out their budget.

An admitted job that is still waiting when its budget runs out is cancelled (it never runs: no wasted work).
One that is running cannot be interrupted from outside its thread: it is told to stop (its cancel event, see
:mod:`rag_opt.work`), which the optimizer checks between its stages and between forward passes; until then it
keeps its worker busy, which the admission estimate accounts for, and its result is discarded.
:class:`BudgetExceeded` says which. The budget is measured by :attr:`OptimizerPool.sleep` (``asyncio.sleep``;
tests replace it with a clock they control).

Micro-batching (:meth:`OptimizerPool.run_batched`): a worker that takes a job also takes the queued jobs with
the same key (the same settings), waiting up to ``batch_wait_ms`` for more, at most ``max_batch`` in all, and
runs them as one call. Each job keeps its own budget: one that runs out while queued leaves the queue; one that
runs out while its batch runs is answered :class:`BudgetExceeded` ``running`` and its result discarded, while
the batch goes on for the others (its cancel event is set only once every job of the batch gave up). A batch
that raises is retried one job at a time, so each gets its own outcome. The run-time average is per run (one job
or one batch), and the admission estimate counts up to ``max_batch`` queued jobs per run.

Worker threads run at a lower CPU priority (``nice``, Linux) than the event loop: on a busy CPU, requests
without context keep being served at full speed and optimizations take the time left over.

Lighter work that must not stall the event loop either (parsing and rewriting large request bodies, checking
large responses) goes through :func:`rag_opt.wire.offload.off_loop`: inline when small, else on one of anyio's
worker threads.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from rag_opt.errors import Cancelled, ConfigurationError
from rag_opt.server.errors import BudgetExceeded, Overloaded
from rag_opt.server.metrics import Metrics
from rag_opt.work import scope

__all__ = ["EWMA_ALPHA", "OptimizerPool", "retry_after_s"]

T = TypeVar("T")
EWMA_ALPHA = 0.3


@dataclass
class _Job(Generic[T]):
    """One optimization: ``fn`` maps the items of a batch (this job's ``item`` and those of jobs with the same
    ``key``) to their results, in order. ``key`` None: never batched."""

    fn: Callable[[list[Any]], list[T]]
    record: bool
    key: Hashable | None = None
    item: Any = None
    enqueued: float = field(default_factory=time.monotonic)
    started: bool = False
    abandoned: bool = False
    future: Future[T] = field(default_factory=Future)
    cancel: threading.Event = field(default_factory=threading.Event)  # set when its waiter gives up
    batch: list[_Job[T]] | None = None  # the batch it runs in, once started
    batch_cancel: threading.Event | None = None  # set once every job of that batch gave up


class OptimizerPool:
    """``workers`` threads and at most ``max_queue`` waiting jobs; see the module docstring.

    ``batch_wait_ms`` / ``max_batch``: micro-batching of jobs submitted with :meth:`run_batched` (0 / 1: off).
    """

    def __init__(
        self,
        workers: int,
        max_queue: int,
        metrics: Metrics | None = None,
        nice: int = 0,
        *,
        batch_wait_ms: float = 0.0,
        max_batch: int = 1,
    ) -> None:
        if workers < 1 or max_queue < 0:
            raise ConfigurationError("workers must be >= 1 and max_queue >= 0")
        if batch_wait_ms < 0 or max_batch < 1:
            raise ConfigurationError("batch_wait_ms must be >= 0 and max_batch >= 1")
        self.workers = workers
        self.max_queue = max_queue
        self.batch_wait_s = batch_wait_ms / 1e3
        self.max_batch = max_batch
        self.metrics = metrics or Metrics()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pending: deque[_Job[Any]] = deque()  # admitted, not started, in arrival order
        self._closed = False
        self._queued = 0  # admitted, not started (and not cancelled)
        self._busy = 0  # workers running a job or a batch, timed-out ones included
        self._avg_s: float | None = None  # moving average of recorded run times (of one job or one batch)
        self._running: dict[int, float] = {}  # when each run now going started (by worker), for admission
        self.clock: Callable[[], float] = time.monotonic  # the ages of running jobs
        self.sleep: Callable[[float], Awaitable[object]] = asyncio.sleep  # measures the time budgets
        self._threads = [
            threading.Thread(target=self._worker, args=(nice,), name=f"rag-opt-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    # -- state ----------------------------------------------------------------------------------------------
    def gauges(self) -> tuple[int, int, int, int]:
        """(queued, busy, workers, max_queue), for the metrics."""
        with self._lock:
            return self._queued, self._busy, self.workers, self.max_queue

    @property
    def average_run_s(self) -> float | None:
        return self._avg_s

    def _estimate_locked(self) -> float | None:
        """Estimated seconds until a job admitted now would finish (None: no run time known yet). With
        micro-batching, up to ``max_batch`` waiting jobs go in one run (one run time each round)."""
        ahead = self._busy + self._queued
        if self._avg_s is None:
            return None
        avg = self._avg_s
        if ahead < self.workers:
            return avg
        # the first worker frees up when its run ends: a run younger than the average has the rest of it to go, an
        # older one is expected to run about as long again (its age is all that is known of it: a request that
        # holds the worker for minutes must not make every later one wait out its budget)
        now = self.clock()
        left = [avg - age if age < avg else age for age in (now - t for t in self._running.values())]
        free_in = min(left) if left else avg
        per_round = self.workers * self.max_batch
        rounds = (ahead - self.workers) // per_round  # runs of queued jobs to wait for after that
        return free_in + (rounds + 1) * avg

    def estimate_s(self) -> float | None:
        with self._lock:
            return self._estimate_locked()

    # -- admission ------------------------------------------------------------------------------------------
    def _admit(self, job: _Job[T], budget_s: float | None) -> Future[T]:
        with self._lock:
            ahead = self._busy + self._queued
            if ahead >= self.workers:  # it would wait for a worker
                if ahead - self.workers >= self.max_queue:
                    raise Overloaded("queue_full")
                est = self._estimate_locked()
                if budget_s is not None and est is not None and est > budget_s:
                    raise Overloaded("estimate", est)
            if self._closed:
                raise Overloaded("queue_full")
            self._queued += 1
            self._pending.append(job)
            self._cond.notify_all()
            return job.future

    # -- the workers ----------------------------------------------------------------------------------------
    def _worker(self, nice: int) -> None:
        _lower_priority(nice)
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                first = self._pending.popleft()
                batch = [first]
                self._start_locked(first)
                self._busy += 1
                self._running[threading.get_ident()] = self.clock()
                if first.key is not None and self.max_batch > 1:
                    deadline = time.monotonic() + self.batch_wait_s
                    while len(batch) < self.max_batch:
                        for job in [j for j in self._pending if j.key == first.key][: self.max_batch - len(batch)]:
                            self._pending.remove(job)
                            self._start_locked(job)
                            batch.append(job)
                        left = deadline - time.monotonic()
                        if len(batch) >= self.max_batch or left <= 0 or self._closed:
                            break
                        self._cond.wait(left)
                if len(batch) > 1:
                    cancel = threading.Event()
                    for job in batch:
                        job.batch, job.batch_cancel = batch, cancel
                    if all(j.abandoned for j in batch):  # (gave up while the batch was collected)
                        cancel.set()
            self._execute(batch)

    def _start_locked(self, job: _Job[Any]) -> None:
        self._queued -= 1
        job.started = True
        self.metrics.queue_wait(time.monotonic() - job.enqueued)

    def _execute(self, batch: list[_Job[Any]]) -> None:
        t0 = time.monotonic()
        ok = False
        try:
            if len(batch) == 1:
                ok = self._run_one(batch[0])
            else:
                ok = self._run_batch(batch)
        finally:
            elapsed = time.monotonic() - t0
            with self._lock:
                self._busy -= 1
                self._running.pop(threading.get_ident(), None)
                if ok and any(j.record for j in batch):
                    prev = self._avg_s
                    self._avg_s = elapsed if prev is None else (1 - EWMA_ALPHA) * prev + EWMA_ALPHA * elapsed
                abandoned = sum(j.abandoned for j in batch)
            for _ in range(abandoned):
                self.metrics.abandoned_done()

    def _run_one(self, job: _Job[Any]) -> bool:
        """Run one job alone; returns whether it succeeded."""
        if not job.future.set_running_or_notify_cancel():
            return False
        return self._call_one(job)

    def _call_one(self, job: _Job[Any]) -> bool:
        try:
            with scope(cancel=job.cancel):
                out = job.fn([job.item])
            job.future.set_result(out[0])
            return True
        except Cancelled as exc:
            self.metrics.cancelled()
            job.future.set_exception(exc)
        except BaseException as exc:  # noqa: BLE001 - handed to its waiter
            job.future.set_exception(exc)
        return False

    def _run_batch(self, batch: list[_Job[Any]]) -> bool:
        """Run jobs with the same key as one call; if it raises, each job again alone (its own outcome)."""
        live = [j for j in batch if j.future.set_running_or_notify_cancel()]
        if not live:
            return False
        self.metrics.batch(len(live))
        cancel = batch[0].batch_cancel
        try:
            with scope(cancel=cancel):
                results = live[0].fn([j.item for j in live])
        except Cancelled as exc:  # every job of the batch gave up
            self.metrics.cancelled()
            for j in live:
                j.future.set_exception(exc)
            return False
        except Exception:  # one bad input fails the batch: run each alone so each gets its own outcome
            ok = False
            for j in live:
                if j.abandoned:
                    j.future.set_exception(BudgetExceeded("running"))
                    continue
                ok = self._call_one(j) or ok
            return ok
        for j, out in zip(live, results, strict=True):
            j.future.set_result(out)
        return True

    # -- submitting -----------------------------------------------------------------------------------------
    def submit_background(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the pool without waiting (the model warm-up); it occupies a worker like any job."""
        self._admit(_Job(lambda _items: [fn()], record=False), None)

    def _abandon(self, job: _Job[T]) -> str:
        """The waiter gives up on ``job``: cancel it if it has not started. Returns the stage it was in."""
        with self._lock:
            job.abandoned = True
            job.cancel.set()  # a running job stops at its next checkpoint
            if job.started:
                if job.batch is not None and job.batch_cancel is not None and all(j.abandoned for j in job.batch):
                    job.batch_cancel.set()  # a batch stops only once all its jobs gave up
                return "running"
            try:
                self._pending.remove(job)  # never ran, never will
            except ValueError:  # pragma: no cover - taken by a worker meanwhile
                return "running"
            self._queued -= 1
            job.future.cancel()
            return "queued"

    async def run(self, fn: Callable[[], T], budget_s: float) -> T:
        """Run ``fn`` on a worker and return its result within ``budget_s`` seconds.

        Raises :class:`~rag_opt.server.errors.Overloaded` (not admitted),
        :class:`~rag_opt.server.errors.BudgetExceeded` (the budget ran out) or whatever
        ``fn`` raised. If the awaiting task is cancelled (the client left), the job is abandoned the same way.
        """
        return await self._wait(_Job(lambda _items: [fn()], record=True), budget_s)

    # the library's batcher is rag_opt.batching.MicroBatcher (no budgets, admission or cancellation: not this pool)
    async def run_batched(self, key: Hashable, item: Any, fn: Callable[[list[Any]], list[T]], budget_s: float) -> T:
        """:meth:`run` for a job that may share one call of ``fn`` with other queued jobs of the same ``key``:
        ``fn(items)`` returns one result per item, in order. A worker that takes such a job waits up to
        ``batch_wait_ms`` for more (at most ``max_batch`` in all). If the batch raises, each of its jobs runs
        again alone. A job whose budget runs out while its batch runs is told so (:class:`BudgetExceeded`
        ``running``) and its result discarded; the batch itself is stopped only once all its jobs gave up."""
        return await self._wait(_Job(fn, record=True, key=key, item=item), budget_s)

    async def _wait(self, job: _Job[T], budget_s: float) -> T:
        self._admit(job, budget_s)
        afut = asyncio.wrap_future(job.future)
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
        with self._cond:
            self._closed = True
            pending, self._pending = list(self._pending), deque()
            self._queued -= len(pending)
            self._cond.notify_all()
        for job in pending:
            job.future.cancel()


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
