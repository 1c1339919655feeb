"""One index shard's state and methods (`IndexShard`): the entries of the branches it owns
(a `PrefixIndex`), the instances it heard from, their nodes, leases and watched actors, and the
purges. In process it is a plain object (tests, a single-node router); `cluster.deploy_shards`
runs it as a Ray actor (`cluster._RayShard`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvstrata.prefix_index.errors import InvalidParameter
from kvstrata.prefix_index.index import PrefixIndex
from kvstrata.prefix_index.metrics import IndexCollector, ShardCounters
from kvstrata.unified_radix_cache import decode_events


class IndexShard:
    """One shard's state and methods. In-process it is a plain object (tests, a single-node
    router); `deploy_shards` runs it as a Ray actor (`_RayShard`), which fills `node_id` and
    `restarted` from the runtime context and watches `ray.nodes()` for dead nodes."""

    def __init__(
        self,
        page_size: int,
        *,
        node_id: str = "local",
        restarted: bool = False,
        max_entries: int | None = None,
        rebuild_grace_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lock = threading.Lock()
        self.index = PrefixIndex(page_size, max_entries=max_entries)
        self._nodes: dict[str, str] = {}
        self.node_id = node_id
        self.restarted = restarted
        self._clock = clock
        self._started = clock()
        self._grace = rebuild_grace_s
        self._heard: set[str] = set()
        self._leases: dict[str, tuple[float, float]] = {}  # instance -> (ttl, deadline)
        self._actors: dict[str, Any] = {}  # instance -> its Ray actor handle (watched)
        self.purged: list[str] = []
        self.counters = ShardCounters()

    def register(
        self, instance: str, node_id: str, *, ttl_s: float | None = None, actor: Any = None
    ) -> None:
        """Note `instance`'s node (purged with it). `ttl_s`: a lease, extended by each batch,
        dump or `renew` of the instance, that drops it when it runs out. `actor`: the
        instance's Ray actor handle, whose death drops it (`_RayShard` watches it).
        InvalidParameter for a lease that is not positive, before any change."""
        if ttl_s is not None and not ttl_s > 0:
            raise InvalidParameter(f"ttl_s must be > 0 or None, got {ttl_s}")
        with self._lock:
            self._nodes[instance] = node_id
            if ttl_s is None:
                self._leases.pop(instance, None)
            else:
                self._leases[instance] = (ttl_s, self._clock() + ttl_s)
            if actor is None:
                self._actors.pop(instance, None)
            else:
                self._actors[instance] = actor

    def register_instance(
        self, instance: str, node_id: str, ttl_s: float | None, actor: Any
    ) -> None:
        """`register` with every argument positional (for `ClusterIndex.call_many`)."""
        self.register(instance, node_id, ttl_s=ttl_s, actor=actor)

    def renew(self, instances: Sequence[str]) -> list[str]:
        """A heartbeat: extend the leases of `instances` (an idle instance's keep-alive).
        Returns those this shard does not know (purged, or a restarted shard): they must
        register again and send a dump."""
        with self._lock:
            for instance in instances:
                self._touch(instance)
            return [i for i in instances if i not in self._nodes]

    def purge_expired(self) -> list[str]:
        """Drop every instance whose lease ran out; returns them."""
        with self._lock:
            now = self._clock()
            dead = [i for i, (_, deadline) in self._leases.items() if now > deadline]
            for instance in dead:
                self._forget(instance)
            return dead

    def purge_instances(self, instances: Sequence[str]) -> list[str]:
        """Drop `instances` (known dead); returns those this shard knew."""
        with self._lock:
            known = [i for i in instances if i in self._nodes or i in self._heard]
            for instance in known:
                self._forget(instance)
            return known

    def watched_actors(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._actors)

    def _touch(self, instance: str) -> None:
        lease = self._leases.get(instance)
        if lease is not None:
            self._leases[instance] = (lease[0], self._clock() + lease[0])

    def _forget(self, instance: str, *, purged: bool = True) -> int:
        self._nodes.pop(instance, None)
        self._heard.discard(instance)
        self._leases.pop(instance, None)
        self._actors.pop(instance, None)
        if purged:
            self.purged.append(instance)
        return self.index.drop_instance(instance)

    def apply_batches(self, items: Sequence[tuple[str, int, bytes]]) -> list[bool]:
        """Apply (instance, seq, encoded kvstrata events) in order; False = needs a dump."""
        out: list[bool] = []
        with self._lock:
            for instance, seq, payload in items:
                self._heard.add(instance)
                self._touch(instance)
                events = decode_events(payload)
                if self.index.apply_sequenced(instance, seq, events):
                    self.counters.count_events(events)
                out.append(not self.index.needs_dump(instance))
        return out

    def load_dump(self, instance: str, payload: bytes, next_seq: int) -> None:
        with self._lock:
            self._heard.add(instance)
            self._touch(instance)
            events = decode_events(payload)
            self.index.load_dump(instance, events, next_seq)
            self.counters.count_events(events)

    def match_batch(self, queries: Sequence[Sequence[bytes]]) -> tuple[list[dict[str, int]], bool]:
        """Per query, pages matched per instance; and whether this shard is rebuilding."""
        with self._lock:
            start = time.perf_counter()
            out = [self.index.match_lengths(q) for q in queries]
            self.counters.lookup_batch(len(queries), time.perf_counter() - start)
            return out, self._rebuilding()

    def round(
        self, queries: Sequence[Sequence[bytes]], items: Sequence[tuple[str, int, bytes]]
    ) -> tuple[list[dict[str, int]], bool, list[bool]]:
        """One call for a round of requests: their lookups (`match_batch`), then their event
        batches (`apply_batches`). Returns the lookups' answers, whether this shard is
        rebuilding, and per batch whether it was applied (False: needs a dump)."""
        lengths, rebuilding = self.match_batch(queries)
        return lengths, rebuilding, self.apply_batches(items)

    def echo(self, value: Any) -> Any:
        """`value` back: a call that does nothing, for measuring a transport's round trip."""
        return value

    def collector(self) -> IndexCollector:
        """The shard's Prometheus collector (`kvstrata_prefix_index_*`), read at scrape time."""
        return IndexCollector(self.index, self.counters)

    def drop_instance(self, instance: str) -> int:
        with self._lock:
            return self._forget(instance, purged=False)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            s = self.index.stats()
            return {
                "node_id": self.node_id,
                "entries": s.num_entries,
                "instances": s.num_instances,
                "gaps": s.gaps,
                "restarted": self.restarted,
                "rebuilding": self._rebuilding(),
                "purged": list(self.purged),
                "cpu_s": time.process_time(),  # this process's CPU, all threads (bench)
            }

    def _rebuilding(self) -> bool:
        if not self.restarted:
            return False
        if self._clock() - self._started < self._grace:
            return True
        return any(self.index.needs_dump(i) for i in self._heard)

    def purge_dead(self, alive_nodes: set[str]) -> list[str]:
        """Drop every instance registered on a node not in `alive_nodes`; returns them."""
        with self._lock:
            dead = [i for i, node in self._nodes.items() if node not in alive_nodes]
            for instance in dead:
                self._forget(instance)
            return dead
