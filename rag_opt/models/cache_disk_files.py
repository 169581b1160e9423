"""The disk tier's on-disk names and its low-level file helpers.

The names an entry, a write under way, a claim and an older version's lock file have in a shard folder (the layout is
described in :mod:`rag_opt.models.cache_disk`), the flags a shard folder and a file are opened with (never through a
symbolic link), whether this platform supports opening names relative to an open folder at all, and whole reads and
writes of an open file.
"""

from __future__ import annotations

import os
import re

__all__ = [
    "CLAIM_NAME",
    "CLAIM_SUFFIX",
    "DIR_FD_SUPPORTED",
    "DIR_FLAGS",
    "ENTRY_NAME",
    "ENTRY_SUFFIX",
    "HEX_KEY",
    "LEGACY_LOCK_SUFFIX",
    "OPEN_CLOEXEC",
    "OPEN_NOFOLLOW",
    "OPEN_NONBLOCK",
    "SHARD_NAME",
    "TMP_NAME",
    "read_all",
    "write_all",
]

ENTRY_SUFFIX = ".safetensors"
CLAIM_SUFFIX = ".claim"
LEGACY_LOCK_SUFFIX = ".safetensors.lock"
HEX_KEY = re.compile(r"[0-9a-f]{2,128}")
SHARD_NAME = re.compile(r"[0-9a-f]{2}")
ENTRY_NAME = re.compile(r"([0-9a-f]{2,128})\.safetensors")
TMP_NAME = re.compile(r"\.[0-9a-f]{2,128}\.[0-9a-f]+\.tmp")
CLAIM_NAME = re.compile(r"\.[0-9a-f]{2,128}\.claim")


OPEN_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
OPEN_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
OPEN_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # an entry that is a FIFO must not block its reader
DIR_FLAGS = os.O_RDONLY | _O_DIRECTORY | OPEN_NOFOLLOW | OPEN_CLOEXEC
DIR_FD_SUPPORTED = (
    bool(OPEN_NOFOLLOW and _O_DIRECTORY)
    and {os.open, os.stat, os.unlink, os.rename, os.link, os.rmdir} <= os.supports_dir_fd
)


def read_all(fd: int, size: int) -> bytes:
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


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (raises OSError: a full or read-only disk)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
