"""Serving a replay's metrics: every layer's collector for one run, and an HTTP `/metrics`.

`replay_collectors` lists the collectors of one replay (the engine's, then those
`kvstrata.build.collectors` gives for the memory system and its tiers); `ConfigCollector`
re-exports them with a constant `config` label, so the several configurations of one
`kvstrata replay` run share one registry without clashing series; and `MetricsServer` serves
a registry on `http://ADDR:PORT/metrics` (loopback by default) until closed. Nothing is
registered at import.
"""

from __future__ import annotations

import ipaddress
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvstrata.build.metrics import collectors
from kvstrata.replay.errors import ReplayOptionError
from kvstrata.replay.metrics import ReplayCollector

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from kvstrata.build import MemorySystem
    from kvstrata.build.tiers import TieredSystem
    from kvstrata.replay.engine import ReplayEngine

__all__ = ["ConfigCollector", "MetricsServer", "replay_collectors"]


def replay_collectors(
    engine: ReplayEngine, system: MemorySystem, tiers: TieredSystem | None
) -> list[Collector]:
    """The collectors of every layer one replay drives: the engine's `ReplayCollector`, then
    `kvstrata.build.collectors(system, tiers)` (device pools, allocators, tree, and with tiers
    the host mirrors, controller, storage and tiered cache, named as that function names them)."""
    return [ReplayCollector(engine), *collectors(system, tiers)]


class ConfigCollector(Collector):
    """Yields the families of `collectors` with constant labels added to every sample (e.g.
    `{"config": "device+host"}`). Defines no `describe`, so registering it scrapes nothing."""

    def __init__(self, collectors: Sequence[Collector], labels: Mapping[str, str]) -> None:
        self._collectors = list(collectors)
        self._labels = dict(labels)

    def collect(self) -> Iterator[Metric]:
        for collector in self._collectors:
            for family in collector.collect():
                labelled = Metric(family.name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    labelled.add_sample(
                        sample.name,
                        {**sample.labels, **self._labels},
                        sample.value,
                        sample.timestamp,
                        sample.exemplar,
                    )
                yield labelled


class MetricsServer:
    """`/metrics` of `registry` on `addr:port` from a daemon thread, until `close()`.

    Port 0 takes a free port (`port` then tells which). Raises ReplayOptionError for a port out
    of range or an address that is not an IP address, and OSError when the port is taken."""

    def __init__(self, registry: CollectorRegistry, *, port: int, addr: str = "127.0.0.1") -> None:
        if not 0 <= port <= 65535:
            raise ReplayOptionError(f"--metrics-port must be in 0..65535, got {port}")
        try:
            ipaddress.ip_address(addr)
        except ValueError as exc:
            raise ReplayOptionError(f"--metrics-addr must be an IP address, got {addr!r}") from exc
        server, thread = start_http_server(port, addr=addr, registry=registry)
        self._server: WSGIServer = server
        self._thread: threading.Thread = thread
        self.addr = addr
        self.port: int = server.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port. Idempotent."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()
