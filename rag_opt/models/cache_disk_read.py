"""The disk tier's reads: an entry's bytes, read through its shard folder and never through anything else.

An entry is opened relative to its open shard folder, never through a symbolic link and never blocking on a FIFO;
what is at an entry's path but is not one (a link, a folder, a FIFO, an empty file) is counted and removed if it can
be. A read refreshes its entry's modification time at most once a minute, which is how processes sharing the folder
tell each other what they use. See :mod:`rag_opt.models.cache_disk`.
"""

from __future__ import annotations

import errno
import os
import stat
import time

from rag_opt.models.cache_disk_files import (
    DIR_FD_SUPPORTED,
    ENTRY_SUFFIX,
    HEX_KEY,
    OPEN_CLOEXEC,
    OPEN_NOFOLLOW,
    OPEN_NONBLOCK,
    read_all,
)
from rag_opt.models.cache_disk_index import DiskIndex

__all__ = ["DiskReads"]

_TOUCH_EVERY = 60.0  # seconds: a read refreshes its entry's modification time at most this often


class DiskReads(DiskIndex):
    """The disk tier's reads of its entries."""

    # -- reading -------------------------------------------------------------------------------------------------
    def _get(self, key: str) -> bytes | None:
        if not isinstance(key, str) or not HEX_KEY.fullmatch(key):
            self._fail("read", ValueError(f"not a hex key: {key!r}"), repr(key))
            return None
        with self._lock:
            queued = self._queued.get(key)
        if queued is not None:
            return queued
        if not DIR_FD_SUPPORTED:
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
        name = key + ENTRY_SUFFIX
        try:
            fd = os.open(name, os.O_RDONLY | OPEN_NOFOLLOW | OPEN_CLOEXEC | OPEN_NONBLOCK, dir_fd=dfd)
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
            blob = read_all(fd, st.st_size)
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
        self._remove(dfd, key + ENTRY_SUFFIX)
