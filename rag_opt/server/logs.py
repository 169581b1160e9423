"""Keeping repeated log lines from flooding the log: :class:`RepeatLimiter`.

Under attack or when a dependency is down, one warning can repeat thousands of times a second (a refused
upstream, ``Too many open files`` tracebacks from the accept loop, malformed requests). The limiter lets at most
``burst`` records of one message — the same logger, level and format string, whatever its arguments — through
per ``window_s`` seconds and drops the rest; the first record let through after a window that dropped some says
how many ("... (N similar messages suppressed)"). Records below WARNING always pass (the access log is INFO).

:func:`limit_repeats` puts one limiter on the loggers that can repeat per request or per connection
(:data:`LIMITED_LOGGERS`), for as long as an app runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["LIMITED_LOGGERS", "RepeatLimiter", "limit_repeats"]

LIMITED_LOGGERS = (
    "asyncio",
    "uvicorn.error",
    "rag_opt.server.app",
    "rag_opt.server.engine",
    "rag_opt.server.flow",
    "rag_opt.server.http",
    "rag_opt.server.pool",
    "rag_opt.server.state",
    "rag_opt.server.upstream",
    "rag_opt.models.extract",
    "rag_opt.text.segment",
)
_MAX_KEYS = 1024


@dataclass
class _Window:
    start: float
    passed: int = 1
    dropped: int = 0


class RepeatLimiter(logging.Filter):
    """A logging filter: at most ``burst`` records of one message per ``window_s`` seconds (see the module
    docstring); ``clock`` is for tests."""

    def __init__(self, burst: int = 20, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.burst = burst
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, int, str], _Window] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.levelno, str(record.msg))
        with self._lock:
            now = self._clock()
            window = self._windows.get(key)
            if window is None or now - window.start >= self.window_s:
                if len(self._windows) >= _MAX_KEYS:
                    self._forget(now)
                self._windows[key] = _Window(now)
                if window is not None and window.dropped:
                    record.msg = f"{record.msg} ({window.dropped} similar messages suppressed)"
                return True
            if window.passed < self.burst:
                window.passed += 1
                return True
            window.dropped += 1
            return False

    def _forget(self, now: float) -> None:
        """Drop the finished windows (all of them if that is not enough): the keys stay bounded."""
        for key in [k for k, w in self._windows.items() if now - w.start >= self.window_s]:
            del self._windows[key]
        if len(self._windows) >= _MAX_KEYS:
            self._windows.clear()


@contextmanager
def limit_repeats(limiter: RepeatLimiter, loggers: tuple[str, ...] = LIMITED_LOGGERS) -> Iterator[None]:
    """Put ``limiter`` on ``loggers`` for the duration of the block."""
    targets = [logging.getLogger(name) for name in loggers]
    for logger in targets:
        logger.addFilter(limiter)
    try:
        yield
    finally:
        for logger in targets:
            logger.removeFilter(limiter)
