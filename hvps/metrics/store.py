"""``hvps_store_*{rank,table}``: the sharded parameter store's counters, read at scrape time.

The tables count on their own (cache hits, misses, evictions, bytes moved between tiers and
sent to other ranks); this collector only reads them when Prometheus scrapes, so the store's
hot path pays nothing for metrics. It never imports the store (nor torch): with no table
built, it yields nothing.
"""

from __future__ import annotations

import sys
from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

#: (metric, counter key, help) of the per-table counters
COUNTERS = (
    ("hvps_store_cache_hits", "hits", "Rows a lookup found in the table's cache"),
    ("hvps_store_cache_misses", "misses", "Rows a lookup had to read from the table's storage tier"),
    ("hvps_store_cache_evictions", "evictions", "Cache lines the table freed for other rows"),
    ("hvps_store_sent_bytes", "bytes_sent", "Ids, rows and gradients this rank sent to other ranks for the table"),
)
#: direction label -> counter key of bytes moved between the cache and the tier
TRAFFIC = (("to_cache", "bytes_to_cache"), ("to_tier", "bytes_to_tier"), ("bypass", "bytes_bypass"))


class StoreCollector:
    """One sample per live table of ``hvps.store`` on this rank."""

    def __init__(self, rank: str) -> None:
        self.rank = rank

    def collect(self) -> Iterator[Any]:
        module = sys.modules.get("hvps.store.module")
        tables = module.live_tables() if module is not None else []
        if not tables:
            return
        readings = [(table.name, table.counters()) for table in tables]
        for metric, key, doc in COUNTERS:
            family = CounterMetricFamily(metric, doc, labels=["rank", "table"])
            for name, counts in readings:
                family.add_metric([self.rank, name], counts.get(key, 0))
            yield family
        moved = CounterMetricFamily("hvps_store_tier_bytes", "Record bytes moved between the cache and the tier",
                                    labels=["rank", "table", "direction"])
        memory = GaugeMetricFamily("hvps_store_memory_bytes", "Bytes the table's shard holds, by tier",
                                   labels=["rank", "table", "tier"])
        for name, counts in readings:
            for direction, key in TRAFFIC:
                moved.add_metric([self.rank, name, direction], counts.get(key, 0))
            memory.add_metric([self.rank, name, counts["tier"]], counts["tier_bytes"])
            memory.add_metric([self.rank, name, "cache"], counts["cache_bytes"])
        yield moved
        yield memory
