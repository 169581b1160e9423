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

**Its parts**, one job each: :mod:`rag_opt.models.cache_disk_files` (the names in a shard folder, the open flags, whole
reads and writes), :mod:`rag_opt.models.cache_disk_size` (:data:`DEFAULT_DISK_BYTES`, :func:`parse_size`),
:mod:`rag_opt.models.cache_disk_base` (the tier's state, its shard folders, its errors),
:mod:`rag_opt.models.cache_disk_index` (the index, the scans, the eviction), :mod:`rag_opt.models.cache_disk_claims`
(the claims), :mod:`rag_opt.models.cache_disk_read` (the reads); this module, the tier itself: the
:class:`~rag_opt.models.cache_store.StoreTier` protocol, the write-behind queue and the writes, and pruning.
"""

from __future__ import annotations

import atexit
import os
import stat
import threading
import time
import uuid

from rag_opt.errors import InvalidInputError
from rag_opt.models.cache_disk_base import OPEN_TIERS, logger
from rag_opt.models.cache_disk_claims import DiskClaims
from rag_opt.models.cache_disk_files import DIR_FD_SUPPORTED, ENTRY_SUFFIX, HEX_KEY, OPEN_CLOEXEC, OPEN_NOFOLLOW
from rag_opt.models.cache_disk_files import write_all as _write_all  # the name the writes call: tests replace it
from rag_opt.models.cache_disk_read import DiskReads
from rag_opt.models.cache_disk_size import DEFAULT_DISK_BYTES, parse_size
from rag_opt.models.cache_store import TierStats

__all__ = ["DEFAULT_DISK_BYTES", "DiskTier", "parse_size"]

_CLOSE_DRAIN = 5.0  # seconds close() waits for queued writes


class DiskTier(DiskReads, DiskClaims):
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
        OPEN_TIERS.discard(self)

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

    def discard(self, key: str) -> None:
        """Remove ``key``'s entry: the cache found its bytes corrupt (counted ``corrupt``). Never raises."""
        if not isinstance(key, str) or not HEX_KEY.fullmatch(key):
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
                self._remove(fd, key + ENTRY_SUFFIX)
            finally:
                os.close(fd)

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

    # -- writing -------------------------------------------------------------------------------------------------
    def _put(self, key: str, blob: bytes) -> None:
        if not isinstance(key, str) or not HEX_KEY.fullmatch(key):
            self._fail("write", ValueError(f"not a hex key: {key!r}"), repr(key))
            return
        size = len(blob)
        if self._closed or not DIR_FD_SUPPORTED or size == 0 or size > self.max_bytes:
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
        name, tmp = key + ENTRY_SUFFIX, f".{key}.{uuid.uuid4().hex}.tmp"
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
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | OPEN_NOFOLLOW | OPEN_CLOEXEC, 0o644, dir_fd=dfd)
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


@atexit.register
def _close_open_tiers() -> None:
    for tier in list(OPEN_TIERS):
        tier.close()
