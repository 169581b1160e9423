"""The shared tier of the encoding cache: a Redis (or Valkey) store that workers, processes and machines share.

A :class:`RedisTier` is a :class:`~rag_opt.models.cache_store.StoreTier`: hex keys → serialized entries (bytes the
cache verifies itself), kept under ``namespace + key`` with a TTL (``SET key value PX ttl``); the store's own
``maxmemory`` policy evicts (``allkeys-lru`` is the one to set). Like every store tier it **never raises and never
blocks a request for long**:

* every call runs under a short socket timeout (``timeout``; ``connect_timeout`` to connect) with no retries;
* a store that is down or slow is counted, logged at most once a minute and answered as a miss (``get``) or as
  nothing kept (``put``), and the tier is marked down: while down, calls are skipped (no request pays the timeout
  again and again) for ``retry_after`` seconds, then one call probes the store again (a circuit breaker);
* writes are *write-behind* by default: ``put`` queues the entry for a daemon thread (the queue bounded in bytes;
  over the bound the entry is skipped and counted), so no request waits on the store for a write. Reads are
  synchronous, under the short timeout. :meth:`RedisTier.flush` waits for the queue to drain, :meth:`RedisTier.close`
  drains it with a bound and releases the connections.

The client is the maintained ``redis`` package (redis-py), imported when a tier is made: ``pip install
'ragsieve[redis]'``. Accepted URLs: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://`` (TLS),
``unix:///path/to/redis.sock[?db=N]``, and ``valkey://`` / ``valkeys://`` (read as ``redis://`` / ``rediss://``).
Query options of the URL are passed to the client (``?ssl_cert_reqs=none``, ``?max_connections=50``), except the
timeouts, retries and response decoding, which the tier sets itself. Log lines show the URL through
:func:`redacted_url`, never a password.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from rag_opt.errors import ConfigurationError
from rag_opt.models.cache_store import RateLimitedLog, StoreTier, TierCounters, TierStats

__all__ = ["ACCEPTED_URLS", "RedisTier", "redacted_url"]

logger = logging.getLogger(__name__)

ACCEPTED_URLS = (
    "redis://[[user]:password@]host[:port][/db]",
    "rediss://... (TLS)",
    "unix:///path/to/redis.sock[?db=N]",
    "valkey://... and valkeys://... (the same as redis:// and rediss://)",
)
_SCHEMES = {"redis": "redis", "rediss": "rediss", "unix": "unix", "valkey": "redis", "valkeys": "rediss"}
# a query option whose name says it is a secret (``?password=...``): its value is hidden
_SECRET_QUERY = re.compile(r"([?&][^=&#]*(?:pass|secret|token)[^=&#]*=)[^&#]*", re.IGNORECASE)


def redacted_url(url: str) -> str:
    """``url`` with any password (in its user info or its query) replaced by ``***``, for logs and messages.

    Read leniently (never raises): the user info is what precedes the last ``@`` before the query, so a password
    with an unescaped ``/`` or ``@`` is hidden whole."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    cut = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    head, tail = rest[:cut], rest[cut:]
    if "@" in head:
        userinfo, host = head.rsplit("@", 1)
        if ":" in userinfo:
            head = userinfo.split(":", 1)[0] + ":***@" + host
    tail = _SECRET_QUERY.sub(r"\1***", tail)
    return scheme + sep + head + tail


def _bad_url(url: str, why: str) -> ConfigurationError:
    return ConfigurationError(
        f"shared cache URL {redacted_url(url)!r} cannot be used ({why}); accepted forms: " + ", ".join(ACCEPTED_URLS)
    )


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigurationError(f"RedisTier {name} must be a number > 0, got {value!r}")
    return float(value)


def _size(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"RedisTier {name} must be an integer >= 1, got {value!r}")
    return value


class RedisTier(StoreTier):
    """The shared store tier: entries in a Redis or Valkey server, under a TTL, with a circuit breaker.

    Args:
        url: where the store is (see the module doc for the accepted forms). Nothing connects until the first call.
        ttl: how long an entry lives in the store, in seconds (default 7 days).
        timeout: the socket timeout of every read, in seconds (default 50 ms).
        connect_timeout: the timeout of a connection attempt, in seconds (default 200 ms).
        namespace: the prefix of every key in the store (two namespaces never see each other's entries).
        write_behind: write from a background thread (default) rather than in the calling request.
        queue_bytes: the bound of the write-behind queue in bytes (default 128 MiB); a write over it is skipped.
        retry_after: how long the tier stays down after a failure before one call probes the store again, in seconds.
        max_entry_bytes: entries larger than this are never written (default 64 MiB).
        write_timeout: the socket timeout of a write, in seconds (default: 1 s, or ``timeout`` if larger); a write
            sends the whole entry under it, so it is longer than a read's, and it is paid by the background thread.
    """

    name = "shared"

    def __init__(
        self,
        url: str,
        *,
        ttl: float = 7 * 86400,
        timeout: float = 0.05,
        connect_timeout: float = 0.2,
        namespace: str = "ragopt:enc:",
        write_behind: bool = True,
        queue_bytes: int = 128 << 20,
        retry_after: float = 5.0,
        max_entry_bytes: int = 64 << 20,
        write_timeout: float | None = None,
    ) -> None:
        if not isinstance(url, str):
            raise ConfigurationError(f"the shared cache URL must be a string, got {type(url).__name__}")
        if not isinstance(namespace, str):
            raise ConfigurationError(f"RedisTier namespace must be a string, got {type(namespace).__name__}")
        self.ttl = _positive("ttl", ttl)
        self.timeout = _positive("timeout", timeout)
        self.connect_timeout = _positive("connect_timeout", connect_timeout)
        self.retry_after = _positive("retry_after", retry_after)
        self.write_timeout = _positive("write_timeout", write_timeout) if write_timeout is not None else None
        self.queue_bytes = _size("queue_bytes", queue_bytes)
        self.max_entry_bytes = _size("max_entry_bytes", max_entry_bytes)
        self.namespace = namespace
        self.write_behind = bool(write_behind)
        self.url = redacted_url(url)  # what logs and reprs show; the password stays in the connection pools only
        self._ttl_ms = max(1, round(self.ttl * 1000))
        self._connect(url)
        self._counters = TierCounters(tier=self.name)
        self._log = RateLimitedLog(logger)
        self._clock: Callable[[], float] = time.monotonic
        self._breaker = threading.Lock()
        self._down_until = 0.0  # 0: up; else the clock time from which one call may probe the store
        self._probing = False

        self._cv = threading.Condition()
        self._queue: deque[tuple[str, str, bytes]] = deque()  # (op: "set" | "del", store key, blob)
        self._queued = 0  # bytes queued or being written
        self._busy = False  # the writer holds an item
        self._stopping = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def _connect(self, url: str) -> None:
        """The connection pools and clients for ``url`` (reads and writes have their own socket timeouts); nothing
        connects yet. Raises :class:`ConfigurationError` for a URL of another scheme or without the redis client."""
        scheme, sep, rest = url.partition("://")
        real = _SCHEMES.get(scheme.lower()) if sep else None
        if real is None:
            raise _bad_url(url, f"the scheme {scheme + sep!r} is not one of them" if sep else "it has no scheme")
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise ConfigurationError(
                f"the shared cache tier ({self.url}) needs the redis client: pip install 'ragsieve[redis]'"
            ) from exc

        def pool(socket_timeout: float) -> Any:
            forced = {
                "socket_timeout": socket_timeout,
                "socket_connect_timeout": self.connect_timeout,
                "retry": Retry(NoBackoff(), 0),  # one try: the breaker, not the client, decides when to try again
                "retry_on_timeout": False,
                "decode_responses": False,  # entries are bytes
            }
            try:
                made = redis.ConnectionPool.from_url(f"{real}://{rest}", **forced)
            except (ValueError, TypeError) as exc:
                raise _bad_url(url, str(exc)) from None
            made.connection_kwargs.update(forced)  # the URL's query must not lift the timeouts or decode entries
            return made

        self._pool = pool(self.timeout)
        self._write_pool = pool(self.write_timeout or max(1.0, self.timeout))
        self._client = redis.Redis(connection_pool=self._pool)
        self._writer_client = redis.Redis(connection_pool=self._write_pool)
        self._down_errors: tuple[type[BaseException], ...] = (
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
            OSError,
        )

    def __repr__(self) -> str:
        return f"RedisTier({self.url!r}, namespace={self.namespace!r})"

    def __enter__(self) -> RedisTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the protocol ----------------------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        """The entry under ``key``, or None (absent, expired, evicted, empty, or the store down, slow or closed)."""
        if self._closed or not self._admit():
            self._counters.add(misses=1)
            return None
        start = time.perf_counter()
        try:
            value = self._client.get(self.namespace + key)
        except Exception as exc:
            self._failed("read", exc)
            self._counters.add(misses=1, read_seconds=time.perf_counter() - start)
            return None
        self._succeeded()
        elapsed = time.perf_counter() - start
        if value is None:
            self._counters.add(misses=1, read_seconds=elapsed)
            return None
        if not isinstance(value, (bytes, bytearray, memoryview)) or len(value) == 0:
            self._counters.add(corrupt=1, misses=1, read_seconds=elapsed)
            self._log.warning(
                "corrupt", "shared cache %s: an empty entry under %s was dropped", self.url, self.namespace + key
            )
            self._delete(self.namespace + key)
            return None
        self._counters.add(hits=1, bytes_read=len(value), read_seconds=elapsed)
        return bytes(value)

    def put(self, key: str, blob: bytes) -> None:
        """Keep ``blob`` under ``key`` with the TTL: queued for the background writer (write-behind) or written now.

        Skipped (and counted) when the entry is empty or over ``max_entry_bytes``, the queue is over its bound, the
        store is down, or the tier is closed."""
        size = len(blob)
        if size == 0 or size > self.max_entry_bytes:
            self._counters.add(skipped=1)
            if size:
                logger.debug("shared cache: an entry of %d bytes is over max_entry_bytes, not written", size)
            return
        if self._closed or self._is_down():
            self._counters.add(skipped=1)
            return
        if not self.write_behind:
            self._write("set", self.namespace + key, bytes(blob))
            return
        with self._cv:
            if self._closed:
                self._counters.add(skipped=1)
                return
            if self._queued + size > self.queue_bytes:
                self._counters.add(skipped=1)
                self._log.warning(
                    "queue",
                    "shared cache %s: the write-behind queue is full (%d bytes queued, bound %d): entries are "
                    "skipped until it drains",
                    self.url,
                    self._queued,
                    self.queue_bytes,
                )
                return
            self._queue.append(("set", self.namespace + key, bytes(blob)))
            self._queued += size
            self._ensure_writer()
            self._cv.notify_all()

    def stats(self) -> TierStats:
        """The counters since the tier was made (``bytes`` and ``entries`` are 0: the store evicts on its own)."""
        return self._counters.snapshot()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued write is done (written, failed or skipped), at most ``timeout`` seconds; True if
        the queue drained."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout=max(0.0, timeout))

    def close(self, timeout: float = 2.0) -> None:
        """Drain the queued writes for at most ``timeout`` seconds, drop the rest (counted as skipped), stop the writer
        thread and close the connections. Idempotent; afterwards ``get`` answers misses and ``put`` keeps nothing."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
        drained = self.flush(timeout)
        with self._cv:
            dropped = len(self._queue)
            for _, _, blob in self._queue:
                self._queued -= len(blob)
            self._queue.clear()
            self._stopping = True
            self._cv.notify_all()
            thread = self._thread
        if dropped:
            self._counters.add(skipped=dropped)
        if not drained:
            logger.warning("shared cache %s closed with writes pending: %d queued writes dropped", self.url, dropped)
        if thread is not None:
            thread.join(timeout=max(timeout, self.write_timeout or max(1.0, self.timeout)) + self.connect_timeout)
        for pool in (self._pool, self._write_pool):
            try:
                pool.disconnect()
            except Exception as exc:  # closing must not raise either
                logger.debug("shared cache %s: closing a connection pool failed: %s", self.url, exc)

    # -- the circuit breaker ---------------------------------------------------------------------------------
    def _is_down(self) -> bool:
        """Down and not yet due for a probe (a cheap check, before queueing a write)."""
        with self._breaker:
            return self._down_until > 0.0 and self._clock() < self._down_until

    def _admit(self) -> bool:
        """Whether a call may go to the store: always while up; while down, only the one probe after
        ``retry_after``."""
        with self._breaker:
            if self._down_until == 0.0:
                return True
            if self._probing or self._clock() < self._down_until:
                return False
            self._probing = True
            return True

    def _succeeded(self) -> None:
        with self._breaker:
            was_down = self._down_until > 0.0
            self._down_until = 0.0
            self._probing = False
            self._counters.up = True
        if was_down:
            logger.info("shared cache %s is reachable again", self.url)

    def _failed(self, what: str, exc: BaseException) -> None:
        """Count and log a failed call; mark the tier down when the store is unreachable or slow (a refused
        command, such as an out-of-memory answer, leaves it up)."""
        self._counters.add(errors=1)
        down = isinstance(exc, self._down_errors)
        with self._breaker:
            self._probing = False
            if down:
                self._down_until = self._clock() + self.retry_after
                self._counters.up = False
            else:  # the store answered: it is up, whatever it said
                self._down_until = 0.0
                self._counters.up = True
        if down:
            self._log.warning(
                "down",
                "shared cache %s is unreachable or slow (%s failed: %s: %s): answering misses, next try in %.3gs",
                self.url,
                what,
                type(exc).__name__,
                exc,
                self.retry_after,
            )
        else:
            self._log.warning("error", "shared cache %s: a %s failed (%s: %s)", self.url, what, type(exc).__name__, exc)

    # -- writes ----------------------------------------------------------------------------------------------
    def _store(self, op: str, name: str, blob: bytes) -> None:
        """One command to the store (raises; the callers count)."""
        if op == "set":
            self._writer_client.set(name, blob, px=self._ttl_ms)
        else:
            self._writer_client.delete(name)

    def _write(self, op: str, name: str, blob: bytes) -> None:
        """Run one queued or synchronous command under the breaker; never raises."""
        if not self._admit():
            if op == "set":
                self._counters.add(skipped=1)
            return
        start = time.perf_counter()
        try:
            self._store(op, name, blob)
        except Exception as exc:
            self._failed("write" if op == "set" else "delete", exc)
            self._counters.add(write_seconds=time.perf_counter() - start)
            return
        self._succeeded()
        if op == "set":
            self._counters.add(writes=1, bytes_written=len(blob), write_seconds=time.perf_counter() - start)

    def _delete(self, name: str) -> None:
        """Remove an entry found unusable: through the writer when write-behind, else now."""
        if not self.write_behind:
            self._write("del", name, b"")
            return
        with self._cv:
            if self._closed:
                return
            self._queue.append(("del", name, b""))
            self._ensure_writer()
            self._cv.notify_all()

    def _ensure_writer(self) -> None:
        """Start the writer thread on the first queued write (called under ``self._cv``)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run_writer, name="rag-opt-shared-cache-writer", daemon=True)
            self._thread.start()

    def _run_writer(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._queue) or self._stopping)
                if not self._queue:
                    return
                op, name, blob = self._queue.popleft()
                self._busy = True
            try:
                self._write(op, name, blob)
            except Exception:  # _write never raises; the thread must outlive a bug all the same
                logger.exception("shared cache %s: the background writer failed on one entry", self.url)
            finally:
                with self._cv:
                    self._queued -= len(blob)
                    self._busy = False
                    self._cv.notify_all()
