"""The encoding cache's disk tier: a folder of entries bounded in bytes, least recently used evicted first.

A :class:`~rag_opt.models.cache_store.StoreTier` (it maps hex keys to bytes and never raises, see
:mod:`rag_opt.models.cache_store`). The layout, which ``rag-opt cache`` (:mod:`rag_opt.cli.cache`) reads:

* ``<root>/<key[:2]>/<key>.safetensors``: one entry (the bytes the encoding cache serialized and verifies itself);
* ``<root>/<key[:2]>/.<key>.<uuid>.tmp``: an entry being written (written, fsynced, then renamed into place with
  ``os.replace``: a reader sees a whole entry or none, and two writers of one content-addressed entry are harmless);
* ``<root>/<key[:2]>/.<key>.claim``: a *claim* (:meth:`DiskTier.claim`): a process computing that entry (``rag-opt
  index``), so that another one sharing the folder does not compute it too. Removed on release and on close.

There are no lock files (the ``<key>.safetensors.lock`` files older versions left are removed by
:meth:`DiskTier.prune` and ``rag-opt cache clear``).

**The bound.** ``max_bytes`` (default :data:`DEFAULT_DISK_BYTES`, 8 GiB: at 12,288 bytes per token, the embedded
SmolLM2-135M's 16 layers in bf16, ~700,000 tokens, ~4,800 HotpotQA paragraphs; set it to your corpus's size for
``rag-opt index``). The tier keeps an index of the entries it knows (size, last use): the folder's entries, scanned
in a background thread when the tier is first used and again every ten minutes (to learn the other processes'
entries), the ones it writes and the ones it reads. A read refreshes its entry's modification time (at most once a
minute per entry), which is how processes sharing the folder tell each other what they use. A write that takes the
total past the bound evicts the least recently used entries, checking each one's modification time first (an entry
another process read meanwhile is kept); an entry some other process removed already is simply forgotten.

**Failures.** Every OS error (a full or read-only disk, a file or a folder where a folder or an entry should be, a
folder that disappeared) is counted in ``errors``, logged at most once a minute per kind, and answered as a miss or
as nothing kept. Symbolic links are never followed: a shard folder or an entry that is one is neither read nor
written through (shard folders are opened with ``O_NOFOLLOW | O_DIRECTORY``, entries with ``O_NOFOLLOW``, and every
name inside a shard is used relative to that open folder). The root folder itself may be a link (a mount elsewhere),
and is created when the tier opens but never re-created afterwards (a folder that disappears may be a volume that
was unmounted: its mount point is not written to).

**Writes never block a request** (``write_behind=True``, the default): :meth:`DiskTier.put` queues the bytes
(at most ``queue_bytes``; beyond, the write is skipped) and a daemon thread writes them. :meth:`DiskTier.flush` waits
for the queue to drain; :meth:`DiskTier.close` drains it for a few seconds at most. Tiers still open at exit are
closed then.

POSIX only (it needs ``dir_fd`` support: Linux, macOS); elsewhere the tier keeps nothing and logs why.
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import re
import socket
import stat
import threading
import time
import uuid
import weakref
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rag_opt.errors import InvalidInputError
from rag_opt.models.cache_store import RateLimitedLog, StoreTier, TierCounters, TierStats

__all__ = ["DEFAULT_DISK_BYTES", "DiskTier", "parse_size"]

logger = logging.getLogger(__name__)

DEFAULT_DISK_BYTES = 8 * 2**30  # 8 GiB (see the module docstring)

_ENTRY = ".safetensors"
_CLAIM = ".claim"
_LEGACY_LOCK = ".safetensors.lock"
_KEY = re.compile(r"[0-9a-f]{2,128}")
_SHARD = re.compile(r"[0-9a-f]{2}")
_ENTRY_NAME = re.compile(r"([0-9a-f]{2,128})\.safetensors")
_TMP_NAME = re.compile(r"\.[0-9a-f]{2,128}\.[0-9a-f]+\.tmp")
_CLAIM_NAME = re.compile(r"\.[0-9a-f]{2,128}\.claim")

_TOUCH_EVERY = 60.0  # seconds: a read refreshes its entry's modification time at most this often
_MTIME_SLACK = 1.0  # seconds: an entry whose modification time is newer than its last use by more was used elsewhere
_RESCAN_EVERY = 600.0  # seconds between scans of the folder (the entries other processes wrote or removed)
_CLOSE_DRAIN = 5.0  # seconds close() waits for queued writes
_STALE_TMP = 3600.0  # seconds: prune removes interrupted writes and left claims older than this
_UNREADABLE_CLAIM = 10.0  # seconds: an unreadable claim (its writer died creating it) older than this is stale
_CLAIM_POLL = 0.01  # seconds between looks at another process's claim (within lock_wait)

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # an entry that is a FIFO must not block its reader
_DIR_FLAGS = os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC
_SUPPORTED = (
    bool(_O_NOFOLLOW and _O_DIRECTORY)
    and {os.open, os.stat, os.unlink, os.rename, os.link, os.rmdir} <= os.supports_dir_fd
)

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?)(b?)\s*", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str | int) -> int:
    """A byte count from ``text``: plain bytes (``"1048576"``), or a size with a unit: ``KiB``, ``MiB``, ``GiB``,
    ``TiB`` (powers of 1024), ``kB``, ``MB``, ``GB``, ``TB`` (powers of 1000), ``K``, ``M``, ``G``, ``T`` alone
    (powers of 1024); case-insensitive, decimals allowed (``1.5GiB``). Raises :class:`InvalidInputError`."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise InvalidInputError(f"a size must be >= 0, got {text}")
        return text
    match = _SIZE.fullmatch(str(text))
    if match is None:
        raise InvalidInputError(f"expected a size in bytes (e.g. 1048576, 500MB, 8GiB), got {text!r}")
    number, prefix, binary, unit_b = match.groups()
    if binary and not prefix:
        raise InvalidInputError(f"expected a size in bytes (e.g. 1048576, 500MB, 8GiB), got {text!r}")
    decimal = bool(prefix) and bool(unit_b) and not binary  # kB, MB, GB: powers of 1000; K, KiB: of 1024
    scale = (1000 if decimal else 1024) ** _POWERS[prefix.lower()]
    return int(number) * scale if number.isdigit() else int(float(number) * scale)


@dataclass
class _Known:
    """What the tier knows of one entry on disk."""

    size: int
    last_use: float  # time.time() of its last use here, or its modification time when learned from the folder


@dataclass
class _Claim:
    """A claim this tier holds: the claim file's identity (another process may replace a stale one)."""

    inode: int
    device: int


class DiskTier(StoreTier):
    """The disk tier: entries in ``root`` bounded by ``max_bytes`` (see the module docstring).

    Args:
        root: the folder (created if absent; may be shared by threads and processes).
        max_bytes: the bound on the entries' bytes (default :data:`DEFAULT_DISK_BYTES`); an entry larger than it is
            never written.
        write_behind: write in a background thread (the default); False writes in :meth:`put` itself.
        queue_bytes: the bytes queued for the background thread at most; a write beyond is skipped.
        lock_wait: the longest, in seconds, anything waits on another process (another's claim, in :meth:`claim`).
    """

    name = "disk"

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
        self._known: OrderedDict[str, _Known] = OrderedDict()  # least recently used first
        self._total = 0
        self._queue: deque[tuple[str, bytes]] = deque()
        self._queued: dict[str, bytes] = {}  # the queue's entries by key (a read of a queued entry is a hit)
        self._queued_bytes = 0
        self._writing: str | None = None  # the key the writer thread is writing
        self._release_after: set[str] = set()  # claims to release once their entry's queued write is done
        self._claims: dict[str, _Claim] = {}
        self._wake = threading.Condition(self._lock)  # the writer waits for work; flush() for an empty queue
        self._writer: threading.Thread | None = None
        self._scanner: threading.Thread | None = None
        self._scanned_at: float | None = None  # time.monotonic() of the last scan's end (None: never scanned)
        self._evicting = threading.Lock()
        self._closed = False
        self._host = socket.gethostname()
        if not _SUPPORTED:
            self._counters.up = False
            logger.warning("the disk tier needs POSIX dir_fd support, which this platform lacks: it keeps nothing")
            return
        try:
            os.makedirs(self._root, exist_ok=True)
        except OSError as exc:
            self._fail("open", exc, self._root)
        _OPEN.add(self)

    # -- the StoreTier protocol ----------------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        """The bytes under ``key``, or None (absent, unreadable or not an entry: see the module docstring)."""
        t0 = time.perf_counter()
        try:
            blob = self._get(key)
        except Exception as exc:  # pragma: no cover - a bug must not fail a request either
            self._fail("read", exc, key)
            blob = None
        self._counters.add(read_seconds=time.perf_counter() - t0)
        if blob is None:
            self._counters.add(misses=1)
        else:
            self._counters.add(hits=1, bytes_read=len(blob))
        return blob

    def put(self, key: str, blob: bytes) -> None:
        """Keep ``blob`` under ``key``: queued for the writer thread (``write_behind``) or written now. Skipped
        (counted) when the tier is closed, the blob is larger than the bound, or the queue is full."""
        try:
            self._put(key, blob)
        except Exception as exc:  # pragma: no cover - a bug must not fail a request either
            self._fail("write", exc, key)

    def stats(self) -> TierStats:
        self._start_scan_if_due()  # a tier never used yet learns the folder's entries
        with self._lock:
            self._counters.set(bytes=self._total, entries=len(self._known))
        return self._counters.snapshot()

    def close(self) -> None:
        """Write the queued entries (for a few seconds at most; the rest are dropped, counted ``skipped``), stop the
        writer thread and release this tier's claims. Idempotent; reads still work afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify_all()
        if not self.flush(_CLOSE_DRAIN):
            with self._lock:
                dropped = len(self._queue)
                self._queue.clear()
                self._queued.clear()
                self._queued_bytes = 0
                self._wake.notify_all()
            if dropped:
                self._counters.add(skipped=dropped)
                logger.warning(
                    "disk tier %s: %d queued writes dropped at close (the disk is too slow)", self._root, dropped
                )
        writer = self._writer
        if writer is not None and writer is not threading.current_thread():
            writer.join(timeout=1.0)
        for key in list(self._claims):
            self._release_now(key)
        _OPEN.discard(self)

    # -- what the cache and the command line need besides --------------------------------------------------------
    def flush(self, timeout: float) -> bool:
        """Wait until every queued write is done (and a scan under way is over), ``timeout`` seconds at most;
        whether it all was."""
        deadline = time.monotonic() + max(0.0, timeout)
        orphaned = False
        with self._lock:
            while self._queue or self._writing is not None:
                writer = self._writer
                if writer is None or not writer.is_alive():  # a forked child, or a writer that died: write here
                    orphaned = True
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(left)
        if orphaned:
            self._drain_here(deadline)
        scanner = self._scanner
        if scanner is not None and scanner is not threading.current_thread():
            scanner.join(max(0.0, deadline - time.monotonic()))
            if scanner.is_alive():
                return False
        with self._lock:
            return not self._queue and self._writing is None

    def contains(self, key: str) -> bool:
        """Whether ``key``'s entry is on disk (or queued to be): a cheap ``lstat``, no read."""
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            return False
        with self._lock:
            if key in self._queued:
                return True
        shard = os.path.join(self._root, key[:2])
        try:
            if not stat.S_ISDIR(os.lstat(shard).st_mode):
                return False
            st = os.lstat(os.path.join(shard, key + _ENTRY))
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size > 0

    def discard(self, key: str) -> None:
        """Remove ``key``'s entry: the cache found its bytes corrupt (counted ``corrupt``). Never raises."""
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            return
        self._counters.add(corrupt=1)
        self._forget(key)
        try:
            fd = self._open_shard(key[:2], create=False)
        except OSError as exc:
            self._fail("remove", exc, key)
            return
        if fd is not None:
            try:
                self._remove(fd, key + _ENTRY)
            finally:
                os.close(fd)

    def claim(self, key: str, ttl: float = 300.0) -> bool:
        """Claim ``key``'s entry for this process to compute (``rag-opt index``): True if it may (its claim file is
        made: :meth:`release` it once the entry is put), False if the entry exists or another process's live claim
        holds it (waited on ``lock_wait`` seconds at most, then counted ``skipped``). A claim older than ``ttl``
        seconds, or whose process is gone (same host), is stale and taken over (a computation longer than ``ttl``
        may thus be made twice: harmless, the entry is the same). When the tier cannot keep the entry anyway (the
        folder is unusable, the tier is closed), True: the caller computes it and goes on."""
        if not isinstance(key, str) or not _KEY.fullmatch(key) or self._closed or not _SUPPORTED:
            return True  # (closed: nothing would release the claim, nor write the entry)
        if self.contains(key):
            return False
        with self._lock:
            if key in self._claims:  # this tier holds it already (claims are per process, not per caller)
                return True
        deadline = time.monotonic() + self.lock_wait
        try:
            fd = self._open_shard(key[:2], create=True)
        except OSError as exc:
            self._fail("claim", exc, key)
            return True
        assert fd is not None
        try:
            while True:
                made = self._make_claim(fd, key)
                if made is not None:
                    with self._lock:
                        self._claims[key] = made
                    return True
                if self.contains(key):
                    return False
                holder = self._claim_holder(fd, key, ttl)
                if holder is None:  # stale: taken over (or gone meanwhile): try again at once
                    if self._take_over(fd, key, ttl):
                        continue
                left = deadline - time.monotonic()
                if left <= 0:
                    self._counters.add(skipped=1)
                    return False
                time.sleep(min(_CLAIM_POLL, left))
        except OSError as exc:
            self._fail("claim", exc, key)
            return True
        finally:
            os.close(fd)

    def release(self, key: str) -> None:
        """Release this tier's claim on ``key`` (its claim file removed); when the entry's write is still queued,
        once it is written. Never raises; a key this tier does not hold is ignored."""
        with self._lock:
            if key not in self._claims:
                return
            if key in self._queued or self._writing == key:
                self._release_after.add(key)
                return
        self._release_now(key)

    def prune(self, max_bytes: int | None = None) -> tuple[int, int]:
        """Scan the folder and remove the least recently used entries (by modification time) until their bytes are
        at most ``max_bytes`` (default: the tier's bound); also the lock files older versions left and writes
        interrupted, and claims left, over an hour ago. Returns (entries removed, their bytes). Raises only for a
        bad bound."""
        bound = self.max_bytes if max_bytes is None else max_bytes
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
            raise InvalidInputError(f"prune max_bytes must be an integer >= 0, got {bound!r}")
        self.flush(_CLOSE_DRAIN)
        found = self._scan(clean=True)
        if found is None:
            return 0, 0
        removed = freed = 0
        order = sorted(found.items(), key=lambda kv: kv[1].last_use)
        total = sum(k.size for _, k in order)
        for key, known in order:
            if total <= bound:
                break
            total -= known.size
            self._forget(key)
            if self._unlink_entry(key):
                removed += 1
                freed += known.size
        self._counters.add(evictions=removed)
        return removed, freed

    # -- reading -------------------------------------------------------------------------------------------------
    def _get(self, key: str) -> bytes | None:
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            self._fail("read", ValueError(f"not a hex key: {key!r}"), repr(key))
            return None
        with self._lock:
            queued = self._queued.get(key)
        if queued is not None:
            return queued
        if not _SUPPORTED:
            return None
        self._start_scan_if_due()
        try:
            dfd = self._open_shard(key[:2], create=False)
        except OSError as exc:
            self._fail("read", exc, os.path.join(self._root, key[:2]))
            return None
        if dfd is None:
            self._forget(key)
            self._counters.up = True
            return None
        try:
            read = self._read_entry(dfd, key)
        except OSError as exc:
            self._fail("read", exc, self._path(key))
            return None
        finally:
            os.close(dfd)
        if read is None:
            return None
        blob, now = read
        self._counters.up = True
        self._learn(key, len(blob), now)
        return blob

    def _read_entry(self, dfd: int, key: str) -> tuple[bytes, float] | None:
        """The bytes of ``key``'s entry in its shard folder ``dfd`` and when they were read, or None: no entry, or
        something that is not one (counted, logged, removed as fits). Raises OSError for a failed read."""
        name = key + _ENTRY
        try:
            fd = os.open(name, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC | _O_NONBLOCK, dir_fd=dfd)
        except FileNotFoundError:
            self._forget(key)
            self._counters.up = True
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symbolic link: not an entry, never followed
                self._not_an_entry(dfd, key, "a symbolic link")
            else:
                self._fail("read", exc, self._path(key))
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file"
                os.close(fd)
                fd = -1
                self._not_an_entry(dfd, key, kind)
                return None
            blob = _read_all(fd, st.st_size)
            if not blob:
                self._log.warning("read:empty", "disk tier entry %s is empty: removed", self._path(key))
                self._counters.add(corrupt=1)
                self._forget(key)
                self._remove(dfd, name)
                return None
            now = time.time()
            if now - st.st_mtime > _TOUCH_EVERY:  # tell the processes sharing the folder it is in use
                try:
                    os.utime(fd)
                except OSError:
                    pass
        finally:
            if fd >= 0:
                os.close(fd)
        return blob, now

    def _not_an_entry(self, dfd: int, key: str, kind: str) -> None:
        """An entry path that holds something else (a folder, a link, a FIFO): counted (corrupt and an error) and
        removed if it can be (a link itself, never its target; a folder only if empty)."""
        self._counters.add(corrupt=1, errors=1)
        self._counters.up = False
        self._log.warning(
            f"read:{kind}", "disk tier entry %s is %s, not an entry: removed if it can be", self._path(key), kind
        )
        self._forget(key)
        self._remove(dfd, key + _ENTRY)

    # -- writing -------------------------------------------------------------------------------------------------
    def _put(self, key: str, blob: bytes) -> None:
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            self._fail("write", ValueError(f"not a hex key: {key!r}"), repr(key))
            return
        size = len(blob)
        if self._closed or not _SUPPORTED or size == 0 or size > self.max_bytes:
            self._counters.add(skipped=1)
            return
        if not self.write_behind:
            self._write(key, blob)
            self._evict()
            return
        with self._lock:
            if key in self._queued or self._writing == key:
                return  # being written already
            if self._queued_bytes + size > self.queue_bytes:
                full = True
            else:
                full = False
                self._queue.append((key, blob))
                self._queued[key] = blob
                self._queued_bytes += size
                self._ensure_writer()
                self._wake.notify_all()
        if full:
            self._counters.add(skipped=1)
            self._log.warning(
                "queue", "disk tier %s: write queue full (%d bytes): writes skipped", self._root, self.queue_bytes
            )

    def _ensure_writer(self) -> None:
        """Start the writer thread if it is not running (first write, or in a forked child). Holds ``_lock``."""
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._write_loop, name="rag-opt-disk-tier", daemon=True)
            self._writer.start()

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if not self._queue:
                    self._wake.notify_all()
                    return
                key, blob = self._next_queued()
            self._write_queued(key, blob)

    def _drain_here(self, deadline: float) -> None:
        """Write the queue in this thread (its writer thread is gone), until ``deadline``."""
        with self._lock:
            self._writing = None  # a write the gone thread began (in the parent of a forked child) is not coming
        while time.monotonic() < deadline:
            with self._lock:
                if not self._queue:
                    return
                key, blob = self._next_queued()
            self._write_queued(key, blob)

    def _next_queued(self) -> tuple[str, bytes]:
        """Pop the queue's oldest entry and mark it being written. Holds ``_lock``."""
        key, blob = self._queue.popleft()
        self._writing = key
        return key, blob

    def _write_queued(self, key: str, blob: bytes) -> None:
        try:
            self._write(key, blob)
            self._evict()
        except Exception as exc:  # pragma: no cover - the writer thread must go on
            self._fail("write", exc, key)
        while True:  # its claim released (release() called meanwhile too) before flush() can see it done
            with self._lock:
                release = key in self._release_after
                self._release_after.discard(key)
                if not release:
                    self._queued.pop(key, None)
                    self._queued_bytes -= len(blob)
                    self._writing = None
                    self._wake.notify_all()
                    return
            self._release_now(key)

    def _write(self, key: str, blob: bytes) -> None:
        """Write one entry: a temporary file in its shard, fsynced, renamed into place. Never raises."""
        t0 = time.perf_counter()
        self._start_scan_if_due()
        try:
            dfd = self._open_shard(key[:2], create=True)
        except OSError as exc:
            self._fail("write", exc, os.path.join(self._root, key[:2]))
            return
        assert dfd is not None
        name, tmp = key + _ENTRY, f".{key}.{uuid.uuid4().hex}.tmp"
        written = False
        try:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                exists = stat.S_ISREG(st.st_mode) and st.st_size > 0
            except FileNotFoundError:
                exists = False
            if exists:  # another process wrote it (the same bytes: the key is their content's address)
                self._learn(key, st.st_size, time.time())
                self._counters.up = True
                return
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o644, dir_fd=dfd)
            try:
                _write_all(fd, blob)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)  # replaces a link at ``name``, never follows it
            written = True
        except OSError as exc:
            self._fail("write", exc, self._path(key))
        finally:
            if not written:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except OSError:
                    pass
            os.close(dfd)
            self._counters.add(write_seconds=time.perf_counter() - t0)
        if written:
            self._counters.up = True
            self._counters.add(writes=1, bytes_written=len(blob))
            self._learn(key, len(blob), time.time())

    # -- the index and the bound ---------------------------------------------------------------------------------
    def _learn(self, key: str, size: int, used: float) -> None:
        """``key``'s entry is on disk (``size`` bytes) and was used at ``used``: the most recently used."""
        with self._lock:
            old = self._known.pop(key, None)
            if old is not None:
                self._total -= old.size
            self._known[key] = _Known(size, used)
            self._total += size

    def _forget(self, key: str) -> None:
        with self._lock:
            old = self._known.pop(key, None)
            if old is not None:
                self._total -= old.size

    def _evict(self) -> None:
        """Remove least recently used entries until the known total is within the bound (one thread at a time)."""
        while True:
            if not self._evicting.acquire(blocking=False):
                return  # another thread is evicting; it looks at the total again once it is done
            try:
                self._evict_held()
            finally:
                self._evicting.release()
            with self._lock:  # bytes another thread added while this one held the eviction
                if self._total <= self.max_bytes or not self._known:
                    return

    def _evict_held(self) -> None:
        while True:
            with self._lock:
                if self._total <= self.max_bytes or not self._known:
                    return
                key, known = self._known.popitem(last=False)
                self._total -= known.size
            self._evict_one(key, known)

    def _evict_one(self, key: str, known: _Known) -> None:
        """Remove ``key``'s entry (forgotten already), unless another process used it since ``known.last_use`` (its
        modification time says so: it is then known again, as recently used) or removed it already."""
        try:
            dfd = self._open_shard(key[:2], create=False)
        except OSError as exc:
            self._fail("evict", exc, key)
            return
        if dfd is None:
            return
        name = key + _ENTRY
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_mtime > known.last_use + _MTIME_SLACK:
                with self._lock:
                    if key not in self._known:
                        self._known[key] = _Known(st.st_size, st.st_mtime)
                        self._total += st.st_size
                return
            os.unlink(name, dir_fd=dfd)
            self._counters.add(evictions=1)
        except FileNotFoundError:
            pass  # removed by another process already
        except OSError as exc:
            self._fail("evict", exc, self._path(key))
        finally:
            os.close(dfd)

    def _unlink_entry(self, key: str) -> bool:
        """Remove ``key``'s entry file; whether this call removed it (False: gone already, or it failed)."""
        try:
            dfd = self._open_shard(key[:2], create=False)
        except OSError as exc:
            self._fail("evict", exc, key)
            return False
        if dfd is None:
            return False
        try:
            os.unlink(key + _ENTRY, dir_fd=dfd)
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._fail("evict", exc, self._path(key))
            return False
        finally:
            os.close(dfd)

    # -- scanning ------------------------------------------------------------------------------------------------
    def _start_scan_if_due(self) -> None:
        """Scan the folder in the background: on first use, then every ten minutes."""
        now = time.monotonic()
        with self._lock:
            if self._scanned_at is not None and now - self._scanned_at < _RESCAN_EVERY:
                return
            if self._scanner is not None and self._scanner.is_alive():
                return
            self._scanned_at = now  # not again before this one is over and ten minutes have passed
            self._scanner = threading.Thread(target=self._scan_and_evict, name="rag-opt-disk-scan", daemon=True)
            self._scanner.start()

    def _scan_and_evict(self) -> None:
        try:
            self._scan(clean=False)
            self._evict()
        except Exception as exc:  # pragma: no cover - a background thread must not die loudly
            self._fail("scan", exc, self._root)

    def _scan(self, *, clean: bool) -> dict[str, _Known] | None:
        """The entries in the folder (size, modification time), merged into the index: an entry not known is added,
        a known one's last use moves up to its modification time, and a known one gone (and not used since the scan
        began) is forgotten. ``clean``: remove old versions' lock files and interrupted writes too. None if the
        folder cannot be read."""
        began = time.time()
        found: dict[str, _Known] = {}
        try:
            with os.scandir(self._root) as shards:
                for shard in shards:
                    if _SHARD.fullmatch(shard.name) and shard.is_dir(follow_symlinks=False):
                        for key, known in self._scan_shard(shard.name, clean, began):
                            found[key] = known
        except OSError as exc:
            self._fail("scan", exc, self._root)
            return None
        with self._lock:
            for key, known in found.items():
                mine = self._known.get(key)
                if mine is None:
                    self._known[key] = known
                    self._total += known.size
                else:
                    mine.last_use = max(mine.last_use, known.last_use)
            for key in [k for k, v in self._known.items() if k not in found and v.last_use < began]:
                self._total -= self._known.pop(key).size
            self._known = OrderedDict(sorted(self._known.items(), key=lambda kv: kv[1].last_use))
            self._scanned_at = time.monotonic()
        return found

    def _scan_shard(self, shard: str, clean: bool, now: float) -> Iterator[tuple[str, _Known]]:
        try:
            dfd = os.open(os.path.join(self._root, shard), _DIR_FLAGS)
        except OSError as exc:
            self._fail("scan", exc, os.path.join(self._root, shard))
            return
        try:
            for name in os.listdir(dfd):
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    self._fail("scan", exc, os.path.join(self._root, shard, name))
                    continue
                entry = _ENTRY_NAME.fullmatch(name)
                if entry is not None and entry.group(1).startswith(shard) and stat.S_ISREG(st.st_mode):
                    yield entry.group(1), _Known(st.st_size, st.st_mtime)
                elif (
                    clean
                    and stat.S_ISREG(st.st_mode)
                    and (
                        name.endswith(_LEGACY_LOCK)
                        or (
                            bool(_TMP_NAME.fullmatch(name) or _CLAIM_NAME.fullmatch(name))
                            and now - st.st_mtime > _STALE_TMP
                        )
                    )
                ):
                    self._remove(dfd, name)
        except OSError as exc:
            self._fail("scan", exc, os.path.join(self._root, shard))
        finally:
            os.close(dfd)

    # -- claims --------------------------------------------------------------------------------------------------
    def _make_claim(self, dfd: int, key: str) -> _Claim | None:
        """Create ``key``'s claim file (exclusively); None if one exists. Raises OSError."""
        name = f".{key}{_CLAIM}"
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o644, dir_fd=dfd)
        except FileExistsError:
            return None
        try:
            body = json.dumps({"pid": os.getpid(), "host": self._host, "time": time.time()}).encode()
            _write_all(fd, body)
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            self._remove(dfd, name)
            raise
        os.close(fd)
        return _Claim(st.st_ino, st.st_dev)

    def _claim_holder(self, dfd: int, key: str, ttl: float) -> str | None:
        """Who holds ``key``'s claim (a description), or None if the claim is stale or gone."""
        name = f".{key}{_CLAIM}"
        try:
            fd = os.open(name, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC | _O_NONBLOCK, dir_fd=dfd)
        except FileNotFoundError:
            return None
        except OSError:  # a link or worse: not a claim anyone made
            return None
        try:
            st = os.fstat(fd)
            body = _read_all(fd, min(st.st_size, 4096)) if stat.S_ISREG(st.st_mode) else b""
        finally:
            os.close(fd)
        now = time.time()
        try:
            info = json.loads(body)
            pid, host, made = int(info["pid"]), str(info["host"]), float(info["time"])
        except (ValueError, TypeError, KeyError):  # being written, or its writer died: stale after a while
            return None if now - st.st_mtime > min(ttl, _UNREADABLE_CLAIM) else "a claim being made"
        if now - made > ttl:
            return None
        if host == self._host and not _alive(pid):
            return None
        return f"process {pid} on {host}"

    def _take_over(self, dfd: int, key: str, ttl: float) -> bool:
        """Remove ``key``'s stale claim so that a new one can be made: renamed aside first, and put back if what was
        renamed turns out to be a fresh claim another process made meanwhile. Whether the claim is gone."""
        name, aside = f".{key}{_CLAIM}", f".{key}.{uuid.uuid4().hex}.tmp"
        try:
            before = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return True
        try:
            os.rename(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd)
        except FileNotFoundError:
            return True  # another process took it over first
        after = os.stat(aside, dir_fd=dfd, follow_symlinks=False)
        if (after.st_ino, after.st_dev) != (before.st_ino, before.st_dev):  # a fresh claim: put it back
            try:
                os.link(aside, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except OSError:
                pass
            self._remove(dfd, aside)
            return False
        self._remove(dfd, aside)
        logger.info("disk tier %s: a stale claim on %s taken over", self._root, key)
        return True

    def _release_now(self, key: str) -> None:
        with self._lock:
            mine = self._claims.pop(key, None)
        if mine is None:
            return
        name = f".{key}{_CLAIM}"
        try:
            dfd = self._open_shard(key[:2], create=False)
        except OSError as exc:
            self._fail("claim", exc, key)
            return
        if dfd is None:
            return
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if (st.st_ino, st.st_dev) == (mine.inode, mine.device):  # not one that took over ours (stale) since
                os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._fail("claim", exc, key)
        finally:
            os.close(dfd)

    # -- helpers -------------------------------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        return os.path.join(self._root, key[:2], key + _ENTRY)

    def _open_shard(self, shard: str, *, create: bool) -> int | None:
        """An open file descriptor of the shard folder (never through a link), or None if it does not exist and
        ``create`` is False. Raises OSError: the folder is a link (ELOOP/ENOTDIR), the root is gone or not a
        folder, the disk refuses a new folder."""
        path = os.path.join(self._root, shard)
        try:
            return os.open(path, _DIR_FLAGS)
        except FileNotFoundError:
            if not os.path.isdir(self._root):
                raise FileNotFoundError(errno.ENOENT, "the cache folder is gone", self._root) from None
            if not create:
                return None
        try:
            os.mkdir(path)  # the root itself is never re-created (see the module docstring)
        except FileExistsError:
            pass
        return os.open(path, _DIR_FLAGS)

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


def _read_all(fd: int, size: int) -> bytes:
    """Up to ``size`` bytes from ``fd`` (fewer if the file is shorter)."""
    parts: list[bytes] = []
    left = size
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 24))
        if not chunk:
            break
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (raises OSError: a full or read-only disk)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, another user's
        return True
    return True


_OPEN: weakref.WeakSet[DiskTier] = weakref.WeakSet()  # tiers to close at exit (their queued writes, their claims)


@atexit.register
def _close_open_tiers() -> None:
    for tier in list(_OPEN):
        tier.close()
