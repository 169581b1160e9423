"""The disk tier's state and its folder: the settings it checks, the records it keeps, and its access to the folder.

:class:`DiskFolder` holds what every part of the tier shares (its settings, its index, its write queue, its claims,
its counters and its lock), opens a shard folder (never through a symbolic link, never re-creating the root), removes
a name inside one, and counts and logs the tier's errors. The parts built on it (:mod:`rag_opt.models.cache_disk_index`,
:mod:`rag_opt.models.cache_disk_claims`, :mod:`rag_opt.models.cache_disk_read`) make up
:class:`~rag_opt.models.cache_disk.DiskTier`; the layout and the failures are described in
:mod:`rag_opt.models.cache_disk`.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import threading
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path

from rag_opt.errors import InvalidInputError
from rag_opt.models.cache_disk_files import DIR_FD_SUPPORTED, DIR_FLAGS, ENTRY_SUFFIX, HEX_KEY
from rag_opt.models.cache_disk_size import DEFAULT_DISK_BYTES
from rag_opt.models.cache_store import RateLimitedLog, StoreTier, TierCounters

__all__ = ["OPEN_TIERS", "DiskFolder", "HeldClaim", "KnownEntry", "logger"]

logger = logging.getLogger("rag_opt.models.cache_disk")  # the tier's one logger, named after its public module


@dataclass
class KnownEntry:
    """What the tier knows of one entry on disk."""

    size: int
    last_use: float  # time.time() of its last use here, or its modification time when learned from the folder


@dataclass
class HeldClaim:
    """A claim this tier holds: the claim file's identity (another process may replace a stale one)."""

    inode: int
    device: int


class DiskFolder(StoreTier):
    """The disk tier's state and its access to the folder: the base of
    :class:`~rag_opt.models.cache_disk.DiskTier` (whose arguments these are)."""

    def __init__(
        self,
        root: str | Path,
        *,
        max_bytes: int = DEFAULT_DISK_BYTES,
        write_behind: bool = True,
        queue_bytes: int = 256 << 20,
        lock_wait: float = 0.05,
    ) -> None:
        for label, value, low in (("max_bytes", max_bytes, 1), ("queue_bytes", queue_bytes, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidInputError(f"disk tier {label} must be an integer >= {low}, got {value!r}")
        if isinstance(lock_wait, bool) or not isinstance(lock_wait, (int, float)) or not lock_wait >= 0:
            raise InvalidInputError(f"disk tier lock_wait must be a number of seconds >= 0, got {lock_wait!r}")
        self.root = Path(root).expanduser()
        self._root = os.fspath(self.root)
        self.max_bytes = max_bytes
        self.write_behind = write_behind
        self.queue_bytes = queue_bytes
        self.lock_wait = float(lock_wait)
        self._counters = TierCounters("disk", max_bytes=max_bytes)
        self._log = RateLimitedLog(logger)
        self._lock = threading.Lock()  # the index, the queue, the claims
        self._known: OrderedDict[str, KnownEntry] = OrderedDict()  # least recently used first
        self._total = 0
        self._queue: deque[tuple[str, bytes]] = deque()
        self._queued: dict[str, bytes] = {}  # the queue's entries by key (a read of a queued entry is a hit)
        self._queued_bytes = 0
        self._writing: str | None = None  # the key the writer thread is writing
        self._release_after: set[str] = set()  # claims to release once their entry's queued write is done
        self._claims: dict[str, HeldClaim] = {}
        self._wake = threading.Condition(self._lock)  # the writer waits for work; flush() for an empty queue
        self._writer: threading.Thread | None = None
        self._scanner: threading.Thread | None = None
        self._scanned_at: float | None = None  # time.monotonic() of the last scan's end (None: never scanned)
        self._evicting = threading.Lock()
        self._closed = False
        self._host = socket.gethostname()
        if not DIR_FD_SUPPORTED:
            self._counters.up = False
            logger.warning("the disk tier needs POSIX dir_fd support, which this platform lacks: it keeps nothing")
            return
        try:
            os.makedirs(self._root, exist_ok=True)
        except OSError as exc:
            self._fail("open", exc, self._root)
        OPEN_TIERS.add(self)

    def contains(self, key: str) -> bool:
        """Whether ``key``'s entry is on disk (or queued to be): a cheap ``lstat``, no read."""
        if not isinstance(key, str) or not HEX_KEY.fullmatch(key):
            return False
        with self._lock:
            if key in self._queued:
                return True
        shard = os.path.join(self._root, key[:2])
        try:
            if not stat.S_ISDIR(os.lstat(shard).st_mode):
                return False
            st = os.lstat(os.path.join(shard, key + ENTRY_SUFFIX))
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size > 0

    # -- helpers -------------------------------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        return os.path.join(self._root, key[:2], key + ENTRY_SUFFIX)

    def _open_shard(self, shard: str, *, create: bool) -> int | None:
        """An open file descriptor of the shard folder (never through a link), or None if it does not exist and
        ``create`` is False. Raises OSError: the folder is a link (ELOOP/ENOTDIR), the root is gone or not a
        folder, the disk refuses a new folder."""
        path = os.path.join(self._root, shard)
        try:
            return os.open(path, DIR_FLAGS)
        except FileNotFoundError:
            if not os.path.isdir(self._root):
                raise FileNotFoundError(errno.ENOENT, "the cache folder is gone", self._root) from None
            if not create:
                return None
        try:
            os.mkdir(path)  # the root itself is never re-created (see :mod:`rag_opt.models.cache_disk`)
        except FileExistsError:
            pass
        return os.open(path, DIR_FLAGS)

    def _remove(self, dfd: int, name: str) -> None:
        """Remove ``name`` in the shard open as ``dfd`` (a link itself; a folder only if empty); best-effort."""
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                os.rmdir(name, dir_fd=dfd)
            else:
                os.unlink(name, dir_fd=dfd)
        except OSError:
            pass

    def _fail(self, op: str, exc: BaseException, where: str) -> None:
        """Count an error and log it (once a minute per kind)."""
        self._counters.add(errors=1)
        self._counters.up = False
        code = errno.errorcode.get(exc.errno, str(exc.errno)) if isinstance(exc, OSError) and exc.errno else None
        kind = f"{op}:{code or type(exc).__name__}"
        hint = " (symbolic links are not followed)" if code == "ELOOP" else ""
        self._log.warning(kind, "disk tier %s failed at %s: %s%s (a miss; nothing kept)", op, where, exc, hint)

    def __repr__(self) -> str:
        return f"DiskTier({self._root!r}, max_bytes={self.max_bytes})"


OPEN_TIERS: weakref.WeakSet[DiskFolder] = (
    weakref.WeakSet()
)  # tiers to close at exit (their queued writes, their claims)
