"""Prometheus export of the pools' own counters, read at scrape time.

Nothing here registers itself: the application builds `PoolCollector({...})` and registers it
with the registry it serves (`registry.register(collector)`). The pools keep plain integers
(`DevicePool.counters`, sizes, the request table's free count); a scrape only reads them.

Families (label `pool` = the name given to the collector; an SWAKVPool named "x" appears as
"x.full" and "x.swa", its two sub-pools):

    kvstrata_pool_capacity_tokens{pool}             usable token slots of a KV pool
    kvstrata_pool_capacity_slots{pool}              usable state slots of a Mamba pool
    kvstrata_pool_size_bytes{pool}                  device bytes held (dummy page included)
    kvstrata_pool_page_size_bytes{pool}             bytes of one flat page
    kvstrata_pool_page_io_pages_total{pool,direction}   pages moved by read_pages / write_pages
    kvstrata_pool_page_io_bytes_total{pool,direction}   bytes moved by them
    kvstrata_pool_request_rows{pool,state}          request table rows, state = used | free
    kvstrata_pool_native_page_copies{pool}          1 when page I/O runs the compiled copies

`direction` is "read" (pool -> caller buffer) or "write" (caller buffer -> pool).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstrata.pool.base import DevicePool
from kvstrata.pool.mamba import MambaPool
from kvstrata.pool.req_to_token import ReqToTokenPool
from kvstrata.pool.swa import SWAKVPool

PoolLike = DevicePool | SWAKVPool | ReqToTokenPool


def _gauge(name: str, doc: str, *labels: str) -> GaugeMetricFamily:
    """An empty `kvstrata_pool_<name>` gauge family labelled by pool, then `labels`."""
    return GaugeMetricFamily(f"kvstrata_pool_{name}", doc, labels=["pool", *labels])


def _counter(name: str, doc: str, *labels: str) -> CounterMetricFamily:
    """The counter counterpart of `_gauge`."""
    return CounterMetricFamily(f"kvstrata_pool_{name}", doc, labels=["pool", *labels])


class _Families(NamedTuple):
    tokens: GaugeMetricFamily
    slots: GaugeMetricFamily
    size: GaugeMetricFamily
    page: GaugeMetricFamily
    pages_moved: CounterMetricFamily
    bytes_moved: CounterMetricFamily
    rows: GaugeMetricFamily
    native: GaugeMetricFamily


class PoolCollector(Collector):
    """Collects the metrics above for `pools` (name -> pool). The mapping is copied: pools
    added to the caller's dict later are not scraped. Reading a pool never changes it."""

    def __init__(self, pools: Mapping[str, PoolLike]) -> None:
        self._pools = dict(pools)

    def _device_pools(self) -> Iterator[tuple[str, DevicePool]]:
        for name, pool in self._pools.items():
            if isinstance(pool, SWAKVPool):
                yield f"{name}.full", pool.full_pool
                yield f"{name}.swa", pool.swa_pool
            elif isinstance(pool, DevicePool):
                yield name, pool

    @staticmethod
    def _families() -> _Families:
        """Empty families, filled by collect and yielded bare by describe."""
        tokens = _gauge(
            "capacity_tokens", "Usable token slots of a KV pool (the dummy page excluded)."
        )
        slots = _gauge("capacity_slots", "Usable state slots of a Mamba pool (slot 0 excluded).")
        size = _gauge(
            "size_bytes", "Device bytes held by the pool's buffers (dummy page included)."
        )
        page = _gauge("page_size_bytes", "Bytes of one flat page (all layers).")
        pages_moved = _counter(
            "page_io_pages",
            "Pages moved by read_pages (read) and write_pages (write).",
            "direction",
        )
        bytes_moved = _counter(
            "page_io_bytes",
            "Bytes moved by read_pages (read) and write_pages (write).",
            "direction",
        )
        rows = _gauge(
            "request_rows", "Rows of a request-to-token table by state (used, free).", "state"
        )
        native = _gauge(
            "native_page_copies",
            "1 when the pool's page I/O runs the compiled copies, 0 on the NumPy / torch path "
            "(no C compiler, KVSTRATA_NATIVE=0, or a GPU pool).",
        )
        return _Families(tokens, slots, size, page, pages_moved, bytes_moved, rows, native)

    def collect(self) -> Iterator[Metric]:
        f = self._families()
        tokens, slots, size, page = f.tokens, f.slots, f.size, f.page
        pages_moved, bytes_moved, rows = f.pages_moved, f.bytes_moved, f.rows
        for name, pool in self._device_pools():
            capacity = slots if isinstance(pool, MambaPool) else tokens
            capacity.add_metric([name], pool.size)
            size.add_metric([name], pool.size_bytes)
            page.add_metric([name], pool.page_size_bytes)
            f.native.add_metric([name], int(pool.native_page_copies))
            c = pool.counters
            pages_moved.add_metric([name, "read"], c.pages_read)
            pages_moved.add_metric([name, "write"], c.pages_written)
            bytes_moved.add_metric([name, "read"], c.bytes_read)
            bytes_moved.add_metric([name, "write"], c.bytes_written)
        for name, pool in self._pools.items():
            if isinstance(pool, ReqToTokenPool):
                size.add_metric([name], pool.size_bytes)
                rows.add_metric([name, "used"], pool.num_used)
                rows.add_metric([name, "free"], pool.available_size())
        yield from f

    def describe(self) -> Iterator[Metric]:
        """The families without samples: lets a registry detect name clashes at register time
        without reading any pool."""
        yield from self._families()
