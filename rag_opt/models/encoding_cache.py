"""The content-addressed cache of document encodings (parallel encoding's per-block key/value states).

A block's encoding depends only on its token ids and on how it was computed, so the *content key* is a SHA-256 of
the block's token ids, the proxy model, its dtype, the depth (layers computed) and the prompt template
(:func:`encoding_key`; a parallel-encoding entry's is made by :func:`block_key`, for the optimizer and the index
alike). What the cache stores under it is an :class:`~rag_opt.models.kv_codec.EncodedStates`: the
states in the cache's *format* (:mod:`rag_opt.models.kv_codec`: the model's dtype, or keys and values quantized).
The format and the cache's namespace (a tenant's, :func:`cache_namespace`) are hashed with the content key into the
*store key* (:meth:`EncodingCache.store_key`): entries of two formats or two tenants never mix.

Tiers, looked up in this order (a hit in a lower tier is copied into the ones above it):

* **memory**: an LRU bounded in bytes (``max_bytes``; an entry larger than the bound is never kept). The default
  512 MiB holds ~43,700 tokens in bf16 and about four times as many at ``k4v4`` (``rag-opt models`` and
  docs/operations.md give each format's bytes per token);
* **disk** (``disk=PATH``, :mod:`rag_opt.models.cache_disk`): one file per entry in a folder shared by workers
  and processes on one host, bounded in bytes (least recently used evicted), written in the background;
* **shared** (``shared="redis://host:port/db"``, :mod:`rag_opt.models.cache_redis`): Redis or Valkey, shared by
  every replica; entries carry a TTL and the store's own memory policy evicts.

Besides, the decoded states of the compact entries its question passes read last are kept (``decoded_bytes``,
:mod:`rag_opt.models.decoded_entries`): a document read again is copied, not decoded.

A store tier never takes optimization down: a full or read-only disk, a held lock, a store that is down or slow is
counted, logged at most once a minute, and answered as a miss (the block is encoded again) or as nothing kept
(:mod:`rag_opt.models.cache_store`). Every entry read from a store is checked (key, format, checksum) before use.

Thread-safe: one lock guards the memory tier and its counters; store tiers run outside it.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rag_opt.errors import InvalidInputError
from rag_opt.models.cache_store import RateLimitedLog, StoreTier, TierStats
from rag_opt.models.decoded_entries import DEFAULT_DECODED_BYTES, DecodedEntries
from rag_opt.models.kv_codec import DEFAULT_FORMAT, EncodedStates, KVFormat, encode_states, from_bytes, resolve_format
from rag_opt.models.prompt import PARALLEL_TEMPLATE_ID

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from rag_opt.models.loader import ProxyModel

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "CacheStats",
    "EncodingCache",
    "block_key",
    "cache_namespace",
    "current_namespace",
    "encoding_key",
    "resolve_cache",
    "sources_kind",
]

logger = logging.getLogger(__name__)
_warn = RateLimitedLog(logger)

DEFAULT_CACHE_BYTES = 512 * 2**20
_FORMAT = "rag-opt-encoding/1"  # the content key's version (what an encoding is computed from)

_STORE_SCHEMES = ("redis", "rediss", "unix", "valkey", "valkeys")
_NAMESPACE: contextvars.ContextVar[str] = contextvars.ContextVar("rag_opt_cache_namespace", default="")


@contextlib.contextmanager
def cache_namespace(namespace: str | None) -> Iterator[None]:
    """Within the block, every encoding cache keeps and finds entries in ``namespace`` (a tenant's: entries of
    two namespaces never meet; None or "" is the common one). The server sets it per request when the operator
    namespaces the cache (``--cache-namespace``)."""
    token = _NAMESPACE.set(namespace or "")
    try:
        yield
    finally:
        _NAMESPACE.reset(token)


def current_namespace() -> str:
    """The namespace in force (:func:`cache_namespace`), "" for the common one."""
    return _NAMESPACE.get()


def encoding_key(ids: Sequence[int], *, model: str, dtype: str, depth: int, template: str, kind: str = "block") -> str:
    """The content address of one block's encoding: changes with the tokens, model, dtype, depth and template
    (``kind``: ``"block"``, or ``"prefix"`` for the shared prefix's own states)."""
    import numpy as np

    h = hashlib.sha256()
    h.update(f"{_FORMAT}\0{kind}\0{model}\0{dtype}\0{depth}\0{template}\0".encode())
    h.update(np.asarray(ids, dtype="<u4").tobytes())
    return h.hexdigest()


def block_key(ids: Sequence[int], proxy: ProxyModel, *, depth: int, kind: str = "block") -> str:
    """The content key of one parallel-encoding entry, made here only: the optimizer reads and writes its blocks under
    it (:func:`rag_opt.models.parallel_features.extract_parallel`) and ``rag-opt index`` writes them
    (:meth:`rag_opt.cli.index.DocumentIndexer.key`), so what the index writes is what a request looks up.

    :func:`encoding_key` of ``ids`` with ``proxy``'s name and precision, ``depth`` and the parallel template; ``kind``:
    ``"block"`` (a block's states), ``"prefix"`` (the shared prefix's) or :func:`sources_kind` (a block's source
    queries)."""
    return encoding_key(
        ids, model=proxy.name, dtype=proxy.precision, depth=depth, template=PARALLEL_TEMPLATE_ID, kind=kind
    )


def sources_kind(ends: Sequence[int]) -> str:
    """The :func:`encoding_key` kind of a block's *source queries* (the cross-document reading's): they are read at
    each unit's last token (``ends``), so the same tokens cut into other units (a title line read as a heading, another
    language's sentences) are another entry."""
    import numpy as np

    return "sources:" + hashlib.sha256(np.asarray(ends, dtype="<u4").tobytes()).hexdigest()[:24]


@dataclass(frozen=True)
class CacheStats:
    """Counters of an :class:`EncodingCache` since it was made. ``hits`` and ``misses`` count lookups over all
    tiers; ``memory_hits``, ``disk_hits`` and ``shared_hits`` the usable entries each tier answered; ``corrupt`` the
    entries read from a store tier and refused (unreadable, another key's: removed, recomputed); ``tiers`` each store
    tier's own counters (a store tier counts a hit for every entry it returns, refused or not); ``decoded_*`` the
    decoded copies of compact entries kept for question passes (:mod:`rag_opt.models.decoded_entries`)."""

    hits: int
    misses: int
    memory_hits: int
    disk_hits: int
    disk_writes: int
    disk_corrupt: int
    shared_hits: int
    corrupt: int
    evictions: int
    entries: int
    bytes: int
    max_bytes: int
    format: str = DEFAULT_FORMAT
    decoded_hits: int = 0
    decoded_entries: int = 0
    decoded_bytes: int = 0
    decoded_max_bytes: int = 0
    tiers: tuple[TierStats, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["tiers"] = {t.tier: t.to_dict() for t in self.tiers}
        return out


class EncodingCache:
    """Document encodings by content address: a memory LRU bounded in bytes, optionally backed by a disk folder
    and a shared store.

    Args:
        max_bytes: the memory tier's bound (default 512 MiB); 0 keeps nothing in memory.
        disk: a folder shared by workers and processes on this host, or None.
        disk_bytes: the disk tier's bound (None: :data:`~rag_opt.models.cache_disk.DEFAULT_DISK_BYTES`).
        shared: a ``redis://`` (or ``rediss://``, ``unix://``, ``valkey://``) URL, a store tier, or None.
        format: how entries are stored (:data:`~rag_opt.models.kv_codec.FORMATS`; default
            :data:`~rag_opt.models.kv_codec.DEFAULT_FORMAT`).
        namespace: a namespace of this cache's own, under any per-request one (:func:`cache_namespace`).
        ttl: the shared tier's entry lifetime in seconds.
        decoded_bytes: the bound of the decoded copies of compact entries kept for question passes (default
            256 MiB, :mod:`rag_opt.models.decoded_entries`); 0 decodes every read. Unused with ``bf16`` and
            with no memory tier.
    """

    def __init__(
        self,
        max_bytes: int = DEFAULT_CACHE_BYTES,
        *,
        disk: str | Path | StoreTier | None = None,
        disk_bytes: int | None = None,
        shared: str | StoreTier | None = None,
        format: str | KVFormat | None = None,  # noqa: A002 - the option's public name
        namespace: str = "",
        ttl: float | None = None,
        decoded_bytes: int = DEFAULT_DECODED_BYTES,
    ) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise InvalidInputError(f"cache max_bytes must be an integer >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.format = resolve_format(format)
        self.decoded = DecodedEntries(decoded_bytes)
        if max_bytes == 0:  # keyed by the entries the memory tier hands out: without one, none is found again
            self.decoded.max_bytes = 0
        self.namespace = namespace
        self.disk: Path | None = None
        self.disk_tier: StoreTier | None = None
        if isinstance(disk, (str, Path)):
            from rag_opt.models.cache_disk import DiskTier

            self.disk = Path(disk).expanduser()
            self.disk_tier = DiskTier(self.disk) if disk_bytes is None else DiskTier(self.disk, max_bytes=disk_bytes)
        elif disk is not None:
            self.disk_tier = disk
            root = getattr(disk, "root", None)
            self.disk = Path(root) if root is not None else None
        self.shared_tier: StoreTier | None = None
        if isinstance(shared, str):
            from rag_opt.models.cache_redis import RedisTier

            self.shared_tier = RedisTier(shared) if ttl is None else RedisTier(shared, ttl=ttl)
        elif shared is not None:
            self.shared_tier = shared
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, EncodedStates] = OrderedDict()
        self._bytes = 0
        self._counts = dict.fromkeys(
            ("hits", "misses", "memory_hits", "disk_hits", "shared_hits", "corrupt", "evictions"), 0
        )

    @property
    def tiers(self) -> list[StoreTier]:
        """The store tiers, in lookup order (disk, then shared)."""
        return [t for t in (self.disk_tier, self.shared_tier) if t is not None]

    def store_key(self, key: str) -> str:
        """The key an entry is kept under in every tier: the content key, the format and the namespace (the
        cache's own and the request's, :func:`cache_namespace`) hashed together."""
        ns = self.namespace + "\0" + _NAMESPACE.get()
        return hashlib.sha256(f"{key}\0{self.format.name}\0{ns}".encode()).hexdigest()

    # -- lookups ---------------------------------------------------------------------------------------------
    def get(self, key: str) -> EncodedStates | None:
        """The entry under the content key ``key`` (memory, then disk, then shared), or None; counts a hit or a
        miss. Never raises for a store tier's failure."""
        sk = self.store_key(key)
        with self._lock:
            hit = self._entries.get(sk)
            if hit is not None:
                self._entries.move_to_end(sk)
                self._counts["hits"] += 1
                self._counts["memory_hits"] += 1
                return hit
        tiers = self.tiers
        for i, tier in enumerate(tiers):
            try:
                blob = tier.get(sk)
            except Exception as exc:  # a tier promises not to raise; a bug in one must not fail the request
                _warn.warning("tier", "the encoding cache's %s tier failed a read (%s)", tier.name, exc)
                continue
            if blob is None:
                continue
            try:
                entry = from_bytes(blob, sk)
            except Exception as exc:  # a corrupt, truncated or foreign entry: never trusted
                _warn.warning(
                    "corrupt",
                    "encoding cache entry %s from the %s tier is unreadable (%s): removed, it will be recomputed",
                    sk,
                    tier.name,
                    exc,
                )
                with self._lock:
                    self._counts["corrupt"] += 1
                _call(tier, "discard", sk)
                continue
            with self._lock:
                self._counts["hits"] += 1
                self._counts[f"{tier.name}_hits"] = self._counts.get(f"{tier.name}_hits", 0) + 1
                self._insert(sk, entry)
            for upper in tiers[:i]:  # promoted: the next lookup is answered closer
                _call(upper, "put", sk, blob)
            return entry
        with self._lock:
            self._counts["misses"] += 1
        return None

    def put(self, key: str, value: torch.Tensor | EncodedStates) -> EncodedStates:
        """Keep ``value`` (states, or an entry already in this cache's format) under the content key ``key`` in
        every tier; returns the entry as stored, which the caller should read (a quantized format changes the
        states: a request that computed them reads what later requests will)."""
        entry = value if isinstance(value, EncodedStates) else encode_states(value, self.format)
        if entry.format != self.format:
            entry = encode_states(entry.decode(), self.format)
        sk = self.store_key(key)
        with self._lock:
            self._insert(sk, entry)
        if self.tiers:
            try:
                blob = entry.to_bytes(sk)
            except Exception as exc:  # pragma: no cover - serializing a tensor we made
                _warn.warning("serialize", "encoding cache entry %s could not be serialized (%s)", sk, exc)
                return entry
            for tier in self.tiers:
                _call(tier, "put", sk, blob)
        return entry

    def __contains__(self, key: str) -> bool:
        sk = self.store_key(key)
        with self._lock:
            if sk in self._entries:
                return True
        return bool(_call(self.disk_tier, "contains", sk)) if self.disk_tier is not None else False

    def stats(self) -> CacheStats:
        tiers = tuple(t.stats() for t in self.tiers)
        by = {t.tier: t for t in tiers}
        disk = by.get("disk")
        with self._lock:
            c = dict(self._counts)
            entries, size = len(self._entries), self._bytes
        return CacheStats(
            hits=c["hits"],
            misses=c["misses"],
            memory_hits=c["memory_hits"],
            disk_hits=c["disk_hits"],
            disk_writes=disk.writes if disk else 0,
            disk_corrupt=disk.corrupt if disk else 0,
            shared_hits=c["shared_hits"],
            corrupt=c["corrupt"],
            evictions=c["evictions"],
            entries=entries,
            bytes=size,
            max_bytes=self.max_bytes,
            format=self.format.name,
            decoded_hits=self.decoded.hits,
            decoded_entries=len(self.decoded),
            decoded_bytes=self.decoded.bytes,
            decoded_max_bytes=self.decoded.max_bytes,
            tiers=tiers,
        )

    def clear(self) -> None:
        """Empty the memory tier and the decoded entries (the store tiers stay: ``rag-opt cache clear`` empties a
        disk folder)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0
        self.decoded.clear()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait up to ``timeout`` seconds for the store tiers' background writes; True when all were written."""
        return all([_call(tier, "flush", timeout) is not False for tier in self.tiers])

    def close(self) -> None:
        """Finish (with a bound) the store tiers' background writes and release them."""
        for tier in self.tiers:
            _call(tier, "close")

    def _insert(self, key: str, value: EncodedStates) -> None:
        size = value.nbytes
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes
        self._entries[key] = value
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.nbytes
            self._counts["evictions"] += 1


def _call(tier: object, method: str, *args: object) -> object:
    """``tier.method(*args)`` if the tier has it; an exception (a tier promises none) is logged, never raised."""
    fn = getattr(tier, method, None)
    if not callable(fn):
        return None
    try:
        return fn(*args)
    except Exception as exc:
        _warn.warning("tier", "the encoding cache's %s tier failed %s (%s)", getattr(tier, "name", "?"), method, exc)
        return False


def resolve_cache(spec: EncodingCache | int | str | Path | None | bool) -> EncodingCache | None:
    """An :class:`EncodingCache` from the ``cache=`` option: ``"auto"``/True (memory, the default size), a size
    in bytes, a ``redis://``/``rediss://``/``unix://``/``valkey://`` URL (memory + that shared tier), a folder
    (memory + that disk tier), a cache, or None/False (no cache)."""
    if spec is None or spec is False:
        return None
    if isinstance(spec, EncodingCache):
        return spec
    if spec is True or spec == "auto":
        return EncodingCache()
    if isinstance(spec, int):
        return EncodingCache(spec)
    if isinstance(spec, str) and spec.split("://", 1)[0] in _STORE_SCHEMES and "://" in spec:
        return EncodingCache(shared=spec)
    if isinstance(spec, (str, Path)):
        return EncodingCache(disk=spec)
    raise InvalidInputError(
        f"cache must be 'auto', a size in bytes, a folder, a redis:// URL, an EncodingCache or None, "
        f"got {type(spec).__name__}"
    )
