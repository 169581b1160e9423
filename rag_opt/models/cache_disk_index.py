"""The disk tier's index of its entries and its bound: what it knows of each entry, scans, and eviction.

The index holds each entry's size and last use: learned from the tier's own reads and writes, and from scans of the
folder (in a background thread, on first use and every ten minutes: the entries other processes wrote, used or
removed). A write that takes the total past ``max_bytes`` evicts the least recently used entries, each one's
modification time checked first (an entry another process read meanwhile is kept). See
:mod:`rag_opt.models.cache_disk`.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator

from rag_opt.models.cache_disk_base import DiskFolder, KnownEntry
from rag_opt.models.cache_disk_files import (
    CLAIM_NAME,
    DIR_FLAGS,
    ENTRY_NAME,
    ENTRY_SUFFIX,
    LEGACY_LOCK_SUFFIX,
    SHARD_NAME,
    TMP_NAME,
)

__all__ = ["DiskIndex"]

_MTIME_SLACK = 1.0  # seconds: an entry whose modification time is newer than its last use by more was used elsewhere
_RESCAN_EVERY = 600.0  # seconds between scans of the folder (the entries other processes wrote or removed)
_STALE_TMP = 3600.0  # seconds: prune removes interrupted writes and left claims older than this


class DiskIndex(DiskFolder):
    """The disk tier's index of its entries, its scans of the folder and its eviction past the bound."""

    # -- the index and the bound ---------------------------------------------------------------------------------
    def _learn(self, key: str, size: int, used: float) -> None:
        """``key``'s entry is on disk (``size`` bytes) and was used at ``used``: the most recently used."""
        with self._lock:
            old = self._known.pop(key, None)
            if old is not None:
                self._total -= old.size
            self._known[key] = KnownEntry(size, used)
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

    def _evict_one(self, key: str, known: KnownEntry) -> None:
        """Remove ``key``'s entry (forgotten already), unless another process used it since ``known.last_use`` (its
        modification time says so: it is then known again, as recently used) or removed it already."""
        try:
            dfd = self._open_shard(key[:2], create=False)
        except OSError as exc:
            self._fail("evict", exc, key)
            return
        if dfd is None:
            return
        name = key + ENTRY_SUFFIX
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_mtime > known.last_use + _MTIME_SLACK:
                with self._lock:
                    if key not in self._known:
                        self._known[key] = KnownEntry(st.st_size, st.st_mtime)
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
            os.unlink(key + ENTRY_SUFFIX, dir_fd=dfd)
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

    def _scan(self, *, clean: bool) -> dict[str, KnownEntry] | None:
        """The entries in the folder (size, modification time), merged into the index: an entry not known is added,
        a known one's last use moves up to its modification time, and a known one gone (and not used since the scan
        began) is forgotten. ``clean``: remove old versions' lock files and interrupted writes too. None if the
        folder cannot be read."""
        began = time.time()
        found: dict[str, KnownEntry] = {}
        try:
            with os.scandir(self._root) as shards:
                for shard in shards:
                    if SHARD_NAME.fullmatch(shard.name) and shard.is_dir(follow_symlinks=False):
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

    def _scan_shard(self, shard: str, clean: bool, now: float) -> Iterator[tuple[str, KnownEntry]]:
        try:
            dfd = os.open(os.path.join(self._root, shard), DIR_FLAGS)
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
                entry = ENTRY_NAME.fullmatch(name)
                if entry is not None and entry.group(1).startswith(shard) and stat.S_ISREG(st.st_mode):
                    yield entry.group(1), KnownEntry(st.st_size, st.st_mtime)
                elif (
                    clean
                    and stat.S_ISREG(st.st_mode)
                    and (
                        name.endswith(LEGACY_LOCK_SUFFIX)
                        or (
                            bool(TMP_NAME.fullmatch(name) or CLAIM_NAME.fullmatch(name))
                            and now - st.st_mtime > _STALE_TMP
                        )
                    )
                ):
                    self._remove(dfd, name)
        except OSError as exc:
            self._fail("scan", exc, os.path.join(self._root, shard))
        finally:
            os.close(dfd)
