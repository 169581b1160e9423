"""The content-addressed cache of document encodings (parallel encoding's per-block key/value states).

A block's encoding depends only on its token ids and on how it was computed, so the key is a SHA-256 of the
block's token ids, the proxy model, its dtype, the depth (layers computed) and the prompt template
(:func:`encoding_key`). Two tiers:

* **memory**: an LRU bounded in bytes (``max_bytes``; an entry larger than the bound is never kept). At 16
  layers in bf16 the embedded SmolLM2-135M takes 12,288 bytes per token (2 × 16 layers × 3 key/value heads ×
  64 dims × 2 bytes), so the default 512 MiB holds ~43,700 tokens: ~300 HotpotQA paragraphs;
* **disk** (optional, ``disk=PATH``): one safetensors file per entry (plain tensors, never pickle), written under
  a temporary name and renamed into place (atomic), under a per-entry file lock so that workers and processes
  sharing the folder compute and write an entry once. Each file records its key, shape and a SHA-256 of its
  bytes; a file that is corrupt, truncated or for another key is detected on read, removed and recomputed,
  never trusted. The disk tier is not bounded (``rag-opt cache clear`` empties it).

Thread-safe: one lock guards the memory tier and the counters; disk reads and writes run outside it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rag_opt.errors import InvalidInputError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["DEFAULT_CACHE_BYTES", "CacheStats", "EncodingCache", "encoding_key", "resolve_cache", "sources_kind"]

logger = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 512 * 2**20
_FORMAT = "rag-opt-encoding/1"


def encoding_key(ids: Sequence[int], *, model: str, dtype: str, depth: int, template: str, kind: str = "block") -> str:
    """The content address of one block's encoding: changes with the tokens, model, dtype, depth and template
    (``kind``: ``"block"``, or ``"prefix"`` for the shared prefix's own states)."""
    import numpy as np

    h = hashlib.sha256()
    h.update(f"{_FORMAT}\0{kind}\0{model}\0{dtype}\0{depth}\0{template}\0".encode())
    h.update(np.asarray(ids, dtype="<u4").tobytes())
    return h.hexdigest()


def sources_kind(ends: Sequence[int]) -> str:
    """The :func:`encoding_key` kind of a block's *source queries* (the cross-document reading's): they are read at
    each unit's last token (``ends``), so the same tokens cut into other units (a title line read as a heading, another
    language's sentences) are another entry."""
    import numpy as np

    return "sources:" + hashlib.sha256(np.asarray(ends, dtype="<u4").tobytes()).hexdigest()[:24]


@dataclass(frozen=True)
class CacheStats:
    """Counters of an :class:`EncodingCache` since it was made."""

    hits: int
    misses: int
    disk_hits: int
    disk_writes: int
    disk_corrupt: int
    evictions: int
    entries: int
    bytes: int
    max_bytes: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel() * t.element_size())


class EncodingCache:
    """Document encodings by content address: a memory LRU bounded in bytes, optionally backed by a disk folder.

    Args:
        max_bytes: the memory tier's bound (default 512 MiB); 0 keeps nothing in memory (disk only).
        disk: a folder shared by workers and processes, or None (memory only).
    """

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES, *, disk: str | Path | None = None) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise InvalidInputError(f"cache max_bytes must be an integer >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.disk = Path(disk) if disk is not None else None
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._counts = dict.fromkeys(("hits", "misses", "disk_hits", "disk_writes", "disk_corrupt", "evictions"), 0)

    # -- lookups ---------------------------------------------------------------------------------------------
    def get(self, key: str) -> torch.Tensor | None:
        """The encoding under ``key`` (memory, then disk), or None; counts a hit or a miss."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self._counts["hits"] += 1
                return hit
        found = self._read_disk(key) if self.disk is not None else None
        with self._lock:
            if found is None:
                self._counts["misses"] += 1
                return None
            self._counts["hits"] += 1
            self._counts["disk_hits"] += 1
            self._insert(key, found)
        return found

    def put(self, key: str, value: torch.Tensor) -> None:
        """Keep ``value`` under ``key`` in memory (evicting the least recently used) and on disk, if any."""
        with self._lock:
            self._insert(key, value)
        if self.disk is not None:
            self._write_disk(key, value)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            if key in self._entries:
                return True
        return self.disk is not None and self._path(key).is_file()

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(**self._counts, entries=len(self._entries), bytes=self._bytes, max_bytes=self.max_bytes)

    def clear(self) -> None:
        """Empty the memory tier (the disk tier stays: remove its folder to empty it)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def _insert(self, key: str, value: torch.Tensor) -> None:
        size = _nbytes(value)
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= _nbytes(old)
        self._entries[key] = value
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= _nbytes(evicted)
            self._counts["evictions"] += 1

    # -- the disk tier ---------------------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        assert self.disk is not None
        return self.disk / key[:2] / f"{key}.safetensors"

    def _read_disk(self, key: str) -> torch.Tensor | None:
        path = self._path(key)
        if not path.is_file():
            return None
        try:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as fh:
                meta = fh.metadata() or {}
                tensor = fh.get_tensor("states")
            if meta.get("format") != _FORMAT or meta.get("key") != key:
                raise ValueError("the file is for another key or format")
            if meta.get("shape") != "x".join(str(n) for n in tensor.shape):
                raise ValueError("its shape does not match the recorded one")
            if meta.get("sha256") != _digest(tensor):
                raise ValueError("its checksum does not match")
            return tensor
        except Exception as exc:  # a corrupt, truncated or foreign file: never trusted
            logger.warning("encoding cache file %s is unreadable (%s): removed, it will be recomputed", path, exc)
            with self._lock:
                self._counts["disk_corrupt"] += 1
            path.unlink(missing_ok=True)
            return None

    def _write_disk(self, key: str, value: torch.Tensor) -> None:
        from filelock import FileLock
        from safetensors.torch import save_file

        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock", timeout=60):
            if path.is_file():
                return  # another worker wrote it
            tmp = path.with_name(f".{key}.{uuid.uuid4().hex}.tmp")
            try:
                tensor = value.contiguous()
                meta = {
                    "format": _FORMAT,
                    "key": key,
                    "shape": "x".join(str(n) for n in tensor.shape),
                    "sha256": _digest(tensor),
                }
                save_file({"states": tensor}, str(tmp), metadata=meta)
                with open(tmp, "rb+") as fh:
                    os.fsync(fh.fileno())
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
        with self._lock:
            self._counts["disk_writes"] += 1


def _digest(t: torch.Tensor) -> str:
    import torch

    data = t.contiguous().view(torch.uint8) if t.dtype != torch.uint8 else t.contiguous()
    return hashlib.sha256(data.reshape(-1).numpy().tobytes()).hexdigest()


def resolve_cache(spec: EncodingCache | int | str | Path | None | bool) -> EncodingCache | None:
    """An :class:`EncodingCache` from the ``cache=`` option: ``"auto"``/True (memory, the default size), a size
    in bytes, a folder (memory of the default size + that disk tier), a cache, or None/False (no cache)."""
    if spec is None or spec is False:
        return None
    if isinstance(spec, EncodingCache):
        return spec
    if spec is True or spec == "auto":
        return EncodingCache()
    if isinstance(spec, int):
        return EncodingCache(spec)
    if isinstance(spec, (str, Path)):
        return EncodingCache(disk=spec)
    raise InvalidInputError(
        f"cache must be 'auto', a size in bytes, a folder, an EncodingCache or None, got {type(spec).__name__}"
    )
