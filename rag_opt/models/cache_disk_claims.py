"""The disk tier's claims: a process computing an entry tells the others sharing the folder, so they do not too.

A claim is a file, ``<root>/<key[:2]>/.<key>.claim``, made exclusively and holding its process's id, host and time
(``rag-opt index`` claims an entry before computing it, and releases it once the entry is put). A claim older than its
time to live, or whose process is gone (same host), is stale: it is taken over, carefully (renamed aside first, put
back if it turns out to be a fresh one). See :mod:`rag_opt.models.cache_disk`.
"""

from __future__ import annotations

import json
import os
import stat
import time
import uuid

from rag_opt.models.cache_disk_base import DiskFolder, HeldClaim, logger
from rag_opt.models.cache_disk_files import (
    CLAIM_SUFFIX,
    DIR_FD_SUPPORTED,
    HEX_KEY,
    OPEN_CLOEXEC,
    OPEN_NOFOLLOW,
    OPEN_NONBLOCK,
    read_all,
    write_all,
)

__all__ = ["DiskClaims"]

_UNREADABLE_CLAIM = 10.0  # seconds: an unreadable claim (its writer died creating it) older than this is stale
_CLAIM_POLL = 0.01  # seconds between looks at another process's claim (within lock_wait)


class DiskClaims(DiskFolder):
    """The disk tier's claims on entries, across the processes sharing its folder."""

    # -- claims --------------------------------------------------------------------------------------------------
    def claim(self, key: str, ttl: float = 300.0) -> bool:
        """Claim ``key``'s entry for this process to compute (``rag-opt index``): True if it may (its claim file is
        made: :meth:`release` it once the entry is put), False if the entry exists or another process's live claim
        holds it (waited on ``lock_wait`` seconds at most, then counted ``skipped``). A claim older than ``ttl``
        seconds, or whose process is gone (same host), is stale and taken over (a computation longer than ``ttl``
        may thus be made twice: harmless, the entry is the same). When the tier cannot keep the entry anyway (the
        folder is unusable, the tier is closed), True: the caller computes it and goes on."""
        if not isinstance(key, str) or not HEX_KEY.fullmatch(key) or self._closed or not DIR_FD_SUPPORTED:
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

    def _make_claim(self, dfd: int, key: str) -> HeldClaim | None:
        """Create ``key``'s claim file (exclusively); None if one exists. Raises OSError."""
        name = f".{key}{CLAIM_SUFFIX}"
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | OPEN_NOFOLLOW | OPEN_CLOEXEC, 0o644, dir_fd=dfd)
        except FileExistsError:
            return None
        try:
            body = json.dumps({"pid": os.getpid(), "host": self._host, "time": time.time()}).encode()
            write_all(fd, body)
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            self._remove(dfd, name)
            raise
        os.close(fd)
        return HeldClaim(st.st_ino, st.st_dev)

    def _claim_holder(self, dfd: int, key: str, ttl: float) -> str | None:
        """Who holds ``key``'s claim (a description), or None if the claim is stale or gone."""
        name = f".{key}{CLAIM_SUFFIX}"
        try:
            fd = os.open(name, os.O_RDONLY | OPEN_NOFOLLOW | OPEN_CLOEXEC | OPEN_NONBLOCK, dir_fd=dfd)
        except FileNotFoundError:
            return None
        except OSError:  # a link or worse: not a claim anyone made
            return None
        try:
            st = os.fstat(fd)
            body = read_all(fd, min(st.st_size, 4096)) if stat.S_ISREG(st.st_mode) else b""
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
        name, aside = f".{key}{CLAIM_SUFFIX}", f".{key}.{uuid.uuid4().hex}.tmp"
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
        name = f".{key}{CLAIM_SUFFIX}"
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
