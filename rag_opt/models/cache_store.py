"""What every byte tier of the encoding cache is: the protocol of the disk and shared (Redis) tiers, and their counters.

The encoding cache (:mod:`rag_opt.models.encoding_cache`) keeps decoded-ready entries in its memory tier and
serialized entries (bytes, :mod:`rag_opt.models.kv_codec`) in its *store tiers*: a local folder
(:mod:`rag_opt.models.cache_disk`) and a shared store (:mod:`rag_opt.models.cache_redis`). A store tier is a
plain key → bytes map with one promise: **it never raises and never blocks a request for long.** A failure (a full
or read-only disk, a store that is down or slow, a held lock) is counted, logged at most once a minute, and answered
as a miss (``get``) or as nothing kept (``put``); the request recomputes the entry and goes on.

Keys are hex strings (the cache's *store keys*: content address, format and namespace hashed together), safe as
file names and Redis keys alike.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

__all__ = ["RateLimitedLog", "StoreTier", "TierCounters", "TierStats"]


@dataclass(frozen=True)
class TierStats:
    """One store tier's counters since it was made (a snapshot)."""

    tier: str  # "disk" or "shared"
    hits: int = 0
    misses: int = 0
    writes: int = 0  # entries written
    errors: int = 0  # failed reads or writes (each answered as a miss / nothing kept)
    corrupt: int = 0  # entries found unreadable and dropped
    skipped: int = 0  # writes not made on purpose (queue full, entry over the bound, a held lock)
    evictions: int = 0  # entries removed to keep the byte bound (disk)
    bytes_read: int = 0
    bytes_written: int = 0
    bytes: int = 0  # bytes held, where the tier knows (disk: its bound's accounting; shared: 0, the store evicts)
    max_bytes: int = 0  # its bound (0: none it enforces)
    entries: int = 0  # entries held, where the tier knows
    read_seconds: float = 0.0  # total time spent in reads (hits and misses)
    write_seconds: float = 0.0  # total time spent in writes
    up: bool = True  # whether its last operation succeeded

    def to_dict(self) -> dict[str, object]:
        from dataclasses import asdict

        return asdict(self)


@dataclass
class TierCounters:
    """Mutable, thread-safe counters a tier keeps and snapshots as :class:`TierStats`."""

    tier: str
    max_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _n: dict[str, float] = field(default_factory=dict, repr=False)
    up: bool = True

    def add(self, **amounts: float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._n[name] = self._n.get(name, 0) + amount

    def set(self, **values: float) -> None:
        with self._lock:
            self._n.update(values)

    def snapshot(self) -> TierStats:
        with self._lock:
            n = dict(self._n)
        ints = {k: int(v) for k, v in n.items() if k not in ("read_seconds", "write_seconds")}
        return TierStats(
            tier=self.tier,
            max_bytes=self.max_bytes,
            read_seconds=float(n.get("read_seconds", 0.0)),
            write_seconds=float(n.get("write_seconds", 0.0)),
            up=self.up,
            **ints,
        )


@runtime_checkable
class StoreTier(Protocol):
    """A byte tier of the encoding cache. ``get`` and ``put`` never raise (see the module doc)."""

    name: str

    def get(self, key: str) -> bytes | None:
        """The bytes under ``key``, or None (absent, unreadable, or the tier failed or was too slow)."""
        ...

    def put(self, key: str, blob: bytes) -> None:
        """Keep ``blob`` under ``key`` if the tier can (it may write later, in the background, or not at all)."""
        ...

    def stats(self) -> TierStats: ...

    def close(self) -> None:
        """Finish or drop pending background writes and release connections (idempotent)."""
        ...


class RateLimitedLog:
    """A warning logged at most once per ``interval`` seconds per kind (a full disk must not flood the log)."""

    def __init__(self, logger: logging.Logger, interval: float = 60.0) -> None:
        self.logger = logger
        self.interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return
            self._last[kind] = now
            suppressed = self._suppressed.pop(kind, 0)
        more = f" ({suppressed} more like it since the last report)" if suppressed else ""
        self.logger.warning(msg + more, *args)
