"""The encoding cache's Prometheus metrics (``ragopt_encoding_cache_*``): a custom collector that reads the cache's
:meth:`~rag_opt.models.encoding_cache.EncodingCache.stats` at each scrape. The cache counts; these only show what
it counted.

* the whole cache (all 0 when there is no cache): lookups answered and not (``hits``, ``misses``; ``memory_hits``,
  ``disk_hits`` and ``shared_hits`` by the tier that answered), the disk tier's writes and corrupt entries, the
  memory tier's evictions, entries, bytes and bound, and the decoded copies of compact entries kept for question
  passes: reads they answered, entries, bytes and bound (:data:`ENCODING_CACHE_COUNTERS`,
  :data:`ENCODING_CACHE_GAUGES`);
* each store tier, labelled ``tier`` (``disk``, ``shared``; only the tiers the cache has):
  ``ragopt_encoding_cache_tier_*`` (:data:`ENCODING_CACHE_TIER_COUNTERS`, :data:`ENCODING_CACHE_TIER_GAUGES`):
  hits, misses, writes, errors (failed reads and writes, each answered as a miss or as nothing kept), corrupt
  entries, skipped writes, evictions, bytes read and written, seconds spent reading and writing, and the bytes,
  entries and bound it holds and whether its last operation succeeded (``up``);
* the format entries are stored in (``--cache-format``): ``ragopt_encoding_cache_format_info{format="..."} 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.models.encoding_cache import CacheStats, EncodingCache

__all__ = [
    "ENCODING_CACHE_COUNTERS",
    "ENCODING_CACHE_FORMAT",
    "ENCODING_CACHE_GAUGES",
    "ENCODING_CACHE_TIER_COUNTERS",
    "ENCODING_CACHE_TIER_GAUGES",
    "EncodingCacheCollector",
]

# the encoding cache (parallel encoding): CacheStats field -> (metric family, help); counters get "_total"
ENCODING_CACHE_COUNTERS = {
    "hits": (
        "ragopt_encoding_cache_hits",
        "Encoding cache lookups answered (a document block's or the prefix's encoding, not recomputed), by any tier.",
    ),
    "misses": ("ragopt_encoding_cache_misses", "Encoding cache lookups no tier answered (the proxy encoded them)."),
    "memory_hits": ("ragopt_encoding_cache_memory_hits", "Encoding cache hits answered by its memory tier."),
    "disk_hits": ("ragopt_encoding_cache_disk_hits", "Encoding cache hits read from its disk tier."),
    "shared_hits": ("ragopt_encoding_cache_shared_hits", "Encoding cache hits read from its shared tier (Redis)."),
    "disk_writes": ("ragopt_encoding_cache_disk_writes", "Encodings written to the encoding cache's disk tier."),
    "disk_corrupt": (
        "ragopt_encoding_cache_disk_corrupt",
        "Corrupt, truncated or foreign encoding cache entries found (dropped and recomputed, never trusted).",
    ),
    "evictions": ("ragopt_encoding_cache_evictions", "Encodings evicted from the memory tier (least recently used)."),
    "decoded_hits": (
        "ragopt_encoding_cache_decoded_hits",
        "Compact entries a question pass copied from their kept decoded states instead of decoding them.",
    ),
}
ENCODING_CACHE_GAUGES = {
    "entries": ("ragopt_encoding_cache_entries", "Encodings held in the encoding cache's memory tier."),
    "bytes": ("ragopt_encoding_cache_bytes", "Bytes held in the encoding cache's memory tier."),
    "max_bytes": (
        "ragopt_encoding_cache_max_bytes",
        "Bound of the encoding cache's memory tier in bytes (--cache-bytes).",
    ),
    "decoded_entries": ("ragopt_encoding_cache_decoded_entries", "Compact entries whose decoded states are kept."),
    "decoded_bytes": ("ragopt_encoding_cache_decoded_bytes", "Bytes of the kept decoded states of compact entries."),
    "decoded_max_bytes": (
        "ragopt_encoding_cache_decoded_max_bytes",
        "Bound of the kept decoded states of compact entries in bytes (--cache-decoded-bytes).",
    ),
}
# each store tier (label tier: disk, shared): TierStats field -> (metric family, help); counters get "_total"
ENCODING_CACHE_TIER_COUNTERS = {
    "hits": ("ragopt_encoding_cache_tier_hits", "Lookups a store tier of the encoding cache answered."),
    "misses": (
        "ragopt_encoding_cache_tier_misses",
        "Lookups a store tier of the encoding cache did not answer (absent, unreadable, or the tier failed).",
    ),
    "writes": ("ragopt_encoding_cache_tier_writes", "Entries written to a store tier of the encoding cache."),
    "errors": (
        "ragopt_encoding_cache_tier_errors",
        "Failed reads and writes of a store tier of the encoding cache (each answered as a miss or nothing kept).",
    ),
    "corrupt": (
        "ragopt_encoding_cache_tier_corrupt",
        "Unreadable entries a store tier of the encoding cache found and dropped.",
    ),
    "skipped": (
        "ragopt_encoding_cache_tier_skipped",
        "Writes a store tier of the encoding cache did not make on purpose (queue full, entry over the bound, tier "
        "down).",
    ),
    "evictions": (
        "ragopt_encoding_cache_tier_evictions",
        "Entries a store tier of the encoding cache removed to keep its bound.",
    ),
    "bytes_read": ("ragopt_encoding_cache_tier_read_bytes", "Bytes read from a store tier of the encoding cache."),
    "bytes_written": (
        "ragopt_encoding_cache_tier_written_bytes",
        "Bytes written to a store tier of the encoding cache.",
    ),
    "read_seconds": (
        "ragopt_encoding_cache_tier_read_seconds",
        "Seconds spent reading a store tier of the encoding cache (hits and misses).",
    ),
    "write_seconds": (
        "ragopt_encoding_cache_tier_write_seconds",
        "Seconds spent writing to a store tier of the encoding cache (in its background writer).",
    ),
}
ENCODING_CACHE_TIER_GAUGES = {
    "bytes": (
        "ragopt_encoding_cache_tier_bytes",
        "Bytes a store tier of the encoding cache holds, where it knows (the shared tier: 0, the store evicts).",
    ),
    "entries": (
        "ragopt_encoding_cache_tier_entries",
        "Entries a store tier of the encoding cache holds, where it knows (the shared tier: 0).",
    ),
    "max_bytes": (
        "ragopt_encoding_cache_tier_max_bytes",
        "Bound of a store tier of the encoding cache in bytes (--cache-disk-bytes; 0: none it enforces).",
    ),
    "up": (
        "ragopt_encoding_cache_tier_up",
        "1 when a store tier of the encoding cache's last operation succeeded, else 0.",
    ),
}
ENCODING_CACHE_FORMAT = (
    "ragopt_encoding_cache_format",
    "The format the encoding cache stores entries in (--cache-format).",
)


class EncodingCacheCollector(Collector):
    """The encoding cache's metrics, read from ``cache()``'s stats at each scrape (zeros when it is None)."""

    def __init__(self, cache: Callable[[], EncodingCache | None]) -> None:
        self.cache = cache

    def describe(self) -> Iterator[Metric]:
        return self._families(None, describe=True)

    def collect(self) -> Iterator[Metric]:
        cache = self.cache()
        return self._families(cache.stats() if cache is not None else None)

    @staticmethod
    def _families(stats: CacheStats | None, *, describe: bool = False) -> Iterator[Metric]:
        values = stats.to_dict() if stats is not None else {}
        for field, (name, doc) in ENCODING_CACHE_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=None if describe else values.get(field, 0))
        for field, (name, doc) in ENCODING_CACHE_GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=None if describe else values.get(field, 0))
        tiers = stats.tiers if stats is not None else ()
        for field, (name, doc) in ENCODING_CACHE_TIER_COUNTERS.items():
            counter = CounterMetricFamily(name, doc, labels=["tier"])
            for tier in tiers:
                counter.add_metric([tier.tier], float(getattr(tier, field)))
            yield counter
        for field, (name, doc) in ENCODING_CACHE_TIER_GAUGES.items():
            gauge = GaugeMetricFamily(name, doc, labels=["tier"])
            for tier in tiers:
                gauge.add_metric([tier.tier], float(getattr(tier, field)))
            yield gauge
        info = InfoMetricFamily(*ENCODING_CACHE_FORMAT)
        if stats is not None:
            info.add_metric([], {"format": stats.format})
        yield info
