"""The encoding cache's Prometheus metrics (``ragopt_encoding_cache_*``): a custom collector that reads the cache's
:meth:`~rag_opt.models.encoding_cache.EncodingCache.stats` at each scrape (all 0 when there is no cache). The cache
counts; these only show what it counted."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.models.encoding_cache import EncodingCache

__all__ = ["ENCODING_CACHE_COUNTERS", "ENCODING_CACHE_GAUGES", "EncodingCacheCollector"]

# the encoding cache (parallel encoding): CacheStats field -> (metric family, help); counters get "_total"
ENCODING_CACHE_COUNTERS = {
    "hits": (
        "ragopt_encoding_cache_hits",
        "Encoding cache lookups answered (a document block's or the prefix's encoding, not recomputed).",
    ),
    "misses": ("ragopt_encoding_cache_misses", "Encoding cache lookups not answered (the proxy encoded them)."),
    "disk_hits": ("ragopt_encoding_cache_disk_hits", "Encoding cache hits read from its disk tier."),
    "disk_writes": ("ragopt_encoding_cache_disk_writes", "Encodings written to the encoding cache's disk tier."),
    "disk_corrupt": (
        "ragopt_encoding_cache_disk_corrupt",
        "Corrupt, truncated or foreign encoding cache files found (removed and recomputed, never trusted).",
    ),
    "evictions": ("ragopt_encoding_cache_evictions", "Encodings evicted from the memory tier (least recently used)."),
}
ENCODING_CACHE_GAUGES = {
    "entries": ("ragopt_encoding_cache_entries", "Encodings held in the encoding cache's memory tier."),
    "bytes": ("ragopt_encoding_cache_bytes", "Bytes held in the encoding cache's memory tier."),
    "max_bytes": (
        "ragopt_encoding_cache_max_bytes",
        "Bound of the encoding cache's memory tier in bytes (--cache-bytes).",
    ),
}


class EncodingCacheCollector(Collector):
    """The encoding cache's metrics, read from ``cache()``'s stats at each scrape (zeros when it is None)."""

    def __init__(self, cache: Callable[[], EncodingCache | None]) -> None:
        self.cache = cache

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        cache = self.cache()
        return self._families(cache.stats().to_dict() if cache is not None else {})

    @staticmethod
    def _families(values: dict[str, int] | None) -> Iterator[Metric]:
        for field, (name, doc) in ENCODING_CACHE_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=None if values is None else values.get(field, 0))
        for field, (name, doc) in ENCODING_CACHE_GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=None if values is None else values.get(field, 0))
