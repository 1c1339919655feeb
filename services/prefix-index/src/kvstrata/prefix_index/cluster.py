"""The index on Ray: one shard actor per node, keys branch-sharded by rendezvous hashing.

    engine instance (tree)                       shard actors (named, detached, one per node)
      take_events() -> ShardedPublisher --+--> kvstrata-prefix-index-<node> : IndexShard
                       per shard: seq     +--> kvstrata-prefix-index-<node> : IndexShard
    router -> ClusterIndex.match_lengths(keys) -> the one shard owning keys[0]

Branch sharding: every key of a branch (a prefix and all its continuations) lives on the shard
that rendezvous hashing picks for the branch's key at depth `branch_depth` - 1 (the first page
by default); the shallower "trunk" pages are replicated on every shard. So one lookup goes to
one shard. The publisher knows each key's depth and branch (it saw the chain being stored) and
splits its events by shard, with its own sequence number per (instance, shard).

Failure:
- a lost batch or a restarted shard (which expects seq 0 again) shows as a gap: the shard drops
  the instance's entries and answers "needs dump"; the publisher sends a dump of its tree
  restricted to that shard's branches, and the entries are back;
- a restarted shard says `rebuilding` (answers are partial) until its grace period is over and
  no instance it has heard from still awaits a dump;
- each shard watches `ray.nodes()` every `purge_period_s` and drops the instances registered on
  a node that is no longer alive, so they are purged within about that period of Ray noticing;
- an instance dead on a live node: registered with its actor handle, the shard asks the actor
  (`__ray_ready__`) every period and drops the instance once Ray answers ActorDiedError;
  registered with a lease (`ttl_s`), every batch, dump or `renew` from the instance extends it,
  and the shard drops an instance whose lease ran out (engines outside Ray, hung engines).
Transport: Ray actor calls, or (`ClusterIndex(direct=True)`) each shard's direct TCP channel.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import ray
from prometheus_client import CollectorRegistry, start_http_server
from ray.exceptions import ActorDiedError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvstrata.prefix_index.channel import (
    METHODS,
    ChannelPool,
    ChannelServer,
    Pending,
    ShardChannel,
)
from kvstrata.prefix_index.dump import dump_tree
from kvstrata.prefix_index.errors import InvalidParameter, PrefixIndexError, ShardUnavailable
from kvstrata.prefix_index.shard import IndexShard
from kvstrata.unified_radix_cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    UnifiedRadixCache,
    encode_events,
)

__all__ = [
    "NAMESPACE",
    "NAME_PREFIX",
    "ClusterIndex",
    "ClusterMatch",
    "IndexShard",
    "ShardedPublisher",
    "deploy_shards",
    "owner",
    "remove_shards",
    "shard_name",
]

NAMESPACE = "kvstrata"
_OWNER_CACHE = 1 << 16  # branch keys whose owner is remembered (cleared when full)
_UNKNOWN = b""  # `_split`: a removed key this publisher never saw stored (no key is empty)
NAME_PREFIX = "kvstrata-prefix-index-"


def shard_name(node_id: str) -> str:
    return NAME_PREFIX + node_id[:16]


def owner(shards: Sequence[str], first_key: bytes) -> str:
    """Rendezvous (highest random weight) hashing: the shard with the highest hash of
    (shard, key). Adding or removing a shard moves only the branches it wins or held."""
    return max(
        shards,
        key=lambda s: hashlib.blake2b(s.encode() + first_key, digest_size=8).digest(),
    )


# `IndexShard` (shard.py) is the shard's state; `_RayShard` runs it as a Ray actor.
class _RayShard(IndexShard):
    """The Ray actor: node and restart from the runtime context, and a thread that, every
    `purge_period_s`, purges the instances of dead nodes (within about that period of Ray
    marking the node dead), of dead watched actors and of run-out leases. With `metrics_port`
    (0: any free port) it serves its `kvstrata_prefix_index_*` metrics with prometheus_client
    on `metrics_addr`."""

    def __init__(
        self,
        page_size: int,
        *,
        max_entries: int | None = None,
        rebuild_grace_s: float = 2.0,
        purge_period_s: float = 0.5,
        metrics_port: int | None = None,
        metrics_addr: str = "127.0.0.1",
        channel_addr: str | None = "127.0.0.1",
    ) -> None:
        ctx = ray.get_runtime_context()
        super().__init__(
            page_size,
            node_id=ctx.get_node_id(),
            restarted=bool(ctx.was_current_actor_reconstructed),
            max_entries=max_entries,
            rebuild_grace_s=rebuild_grace_s,
        )
        self._stop = threading.Event()
        self._monitor = threading.Thread(
            target=self._watch_nodes, args=(purge_period_s,), daemon=True
        )
        self._monitor.start()
        self._metrics_port: int | None = None
        if metrics_port is not None:
            registry = CollectorRegistry()
            registry.register(self.collector())
            server, _thread = start_http_server(metrics_port, addr=metrics_addr, registry=registry)
            self._metrics_port = server.server_port
        self._channel = None if channel_addr is None else ChannelServer(self, host=channel_addr)

    def channel_address(self) -> tuple[str, str] | None:
        """Where this shard's direct channel listens and its node's IP address (a loopback
        channel serves only clients on that host); None: no channel, Ray calls only."""
        if self._channel is None:
            return None
        return self._channel.address, ray.util.get_node_ip_address()

    def metrics_port(self) -> int | None:
        """The port serving /metrics (None: no endpoint)."""
        return self._metrics_port

    def _watch_nodes(self, period: float) -> None:
        while not self._stop.wait(period):
            self.purge_expired()
            self._purge_dead_actors(period)
            try:
                alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            except RayError:
                continue  # GCS briefly unreachable: try again next period
            self.purge_dead(alive)

    def _purge_dead_actors(self, period: float) -> None:
        """Ask every watched instance actor for `__ray_ready__`; one Ray reports dead
        (ActorDiedError: killed, exited, its restarts used up) is purged. A busy actor that
        does not answer within the period, or one restarting (ActorUnavailableError), stays."""
        actors = self.watched_actors()
        if not actors:
            return
        refs = {name: handle.__ray_ready__.remote() for name, handle in actors.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=period)
        done = set(ready)
        dead: list[str] = []
        for name, ref in refs.items():
            if ref not in done:
                continue
            try:
                ray.get(ref, timeout=0)
            except ActorDiedError:
                dead.append(name)
            except RayError:
                continue  # unavailable for now (restarting, network): ask again next period
        if dead:
            self.purge_instances(dead)


def deploy_shards(
    page_size: int,
    *,
    max_entries: int | None = None,
    rebuild_grace_s: float = 2.0,
    purge_period_s: float = 0.5,
    metrics_port: int | None = None,
    metrics_addr: str = "127.0.0.1",
    channel_addr: str | None = "127.0.0.1",
) -> dict[str, Any]:
    """One named, detached shard actor per alive node (existing ones are reused). Returns
    shard name -> actor handle. `metrics_port` (0: any free port; None: none) makes each new
    shard serve /metrics on its node at `metrics_addr`; `channel_addr` (None: none) is where
    its direct data channel (`channel.py`, for `ClusterIndex(direct=True)`) listens.
    InvalidParameter, before any actor is made, for a page size below 1 or a port outside
    0..65535."""
    if page_size < 1:
        raise InvalidParameter(f"page_size must be >= 1, got {page_size}")
    if metrics_port is not None and not 0 <= metrics_port <= 65535:
        raise InvalidParameter(f"metrics_port must be in 0..65535, got {metrics_port}")
    actor_cls = ray.remote(_RayShard)
    out: dict[str, Any] = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        node_id = node["NodeID"]
        name = shard_name(node_id)
        out[name] = actor_cls.options(
            name=name,
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=-1,
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(
            page_size,
            max_entries=max_entries,
            rebuild_grace_s=rebuild_grace_s,
            purge_period_s=purge_period_s,
            metrics_port=metrics_port,
            metrics_addr=metrics_addr,
            channel_addr=channel_addr,
        )
    return out


def remove_shards() -> int:
    """Kill every shard actor (`kvstrata services down`); returns how many went."""
    gone = 0
    # With all_namespaces=True Ray returns {"name", "namespace"} dicts (typed as names).
    named: list[dict[str, str]] = ray.util.list_named_actors(all_namespaces=True)  # pyright: ignore[reportAssignmentType]
    for actor in named:
        if actor["namespace"] == NAMESPACE and actor["name"].startswith(NAME_PREFIX):
            ray.kill(ray.get_actor(actor["name"], namespace=NAMESPACE))
            gone += 1
    return gone


@dataclass(frozen=True, kw_only=True)
class ClusterMatch:
    lengths: dict[str, int]
    shard: str
    partial: bool


class ClusterIndex:
    """Client side: routes each query to the shard owning its branch. `shards`: name -> Ray
    actor handle (from `deploy_shards`) or, in process, name -> `IndexShard`.
    `branch_depth` d: a branch is named by its page d-1; the "trunk" (pages 0..d-2) is
    replicated on every shard, so a query goes to `owner(keys[min(d, len) - 1])` and still sees
    its whole prefix there. d = 1 shards by the first page; on a trace where every request
    opens with the same page (the Mooncake trace), d = 1 puts everything on one shard.
    `timeout_s` bounds every Ray call; a shard that does not answer raises ShardUnavailable.
    `direct`: data-plane calls (`channel.METHODS`) go over each shard's TCP channel, found
    through Ray (which keeps registration); a failed channel is dropped and found again.
    Use a direct ClusterIndex from one thread (a channel's replies are read by its caller)."""

    def __init__(
        self,
        shards: Mapping[str, Any],
        *,
        page_size: int,
        timeout_s: float = 10.0,
        branch_depth: int = 1,
        direct: bool = False,
    ) -> None:
        if not shards:
            raise InvalidParameter("a cluster index needs at least one shard")
        if branch_depth < 1:
            raise InvalidParameter(f"branch_depth must be >= 1, got {branch_depth}")
        self.branch_depth = branch_depth
        self.shards = dict(shards)
        self.names = sorted(self.shards)
        self.page_size = page_size
        self.timeout_s = timeout_s
        self._local = all(isinstance(h, IndexShard) for h in self.shards.values())
        if direct and self._local:
            raise InvalidParameter("direct channels need Ray shard actors")
        self.direct = direct
        self._channels = ChannelPool(
            lambda n: self._ray_get(n, self.shards[n].channel_address.remote()),
            ray.util.get_node_ip_address,
            timeout_s=timeout_s,
        )
        self._owners: dict[bytes, str] = {}

    def owner(self, first_key: bytes) -> str:
        """The shard owning the branch named by `first_key` (rendezvous hashing, cached: a
        branch key is asked for by every lookup and every event of its branch)."""
        got = self._owners.get(first_key)
        if got is None:
            if len(self._owners) >= _OWNER_CACHE:
                self._owners.clear()
            got = self._owners[first_key] = owner(self.names, first_key)
        return got

    def call_many(self, calls: Mapping[str, tuple[str, tuple[Any, ...]]]) -> dict[str, Any]:
        """`method(*args)` on each named shard, all in flight together; results by shard."""
        pending = {n: self.submit(n, m, args) for n, (m, args) in calls.items()}
        # Every answer is waited for before the first failure is raised: a reply left unread
        # would wait in its channel for the life of the connection.
        results: dict[str, Any] = {}
        failure: PrefixIndexError | None = None
        for name, p in pending.items():
            try:
                results[name] = p.get()
            except PrefixIndexError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        return results

    def submit(self, name: str, method: str, args: tuple[Any, ...]) -> Pending:
        """Start `method(*args)` on shard `name`; `get()` on the result waits (bounded by
        `timeout_s`; ShardUnavailable when the shard does not answer). Calls submitted to one
        shard run there in submission order."""
        if self._local:
            value = getattr(self.shards[name], method)(*args)
            return Pending(lambda: value)
        if self.direct and method in METHODS and (channel := self.channel(name)) is not None:
            # On failure drop this channel (not a newer one): the next call asks Ray again.
            return channel.submit(method, args, lambda: self._channels.drop(name, channel))
        ref = getattr(self.shards[name], method).remote(*args)
        return Pending(lambda: self._ray_get(name, ref))

    def _ray_get(self, name: str, ref: Any) -> Any:
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except (RayError, TimeoutError) as exc:
            raise ShardUnavailable(f"shard {name} did not answer: {exc}") from exc

    def channel(self, name: str) -> ShardChannel | None:
        """Shard `name`'s direct channel (`ChannelPool.get`: None when this caller cannot
        reach it, its calls then go through Ray)."""
        return self._channels.get(name)

    def close(self) -> None:
        """Close the direct channels (a later call opens them again)."""
        self._channels.close()

    def match_batch(self, queries: Sequence[Sequence[bytes]]) -> list[ClusterMatch]:
        """Each query (page keys) answered by the shard owning its first key; one call per
        shard, all in flight together."""
        by_shard: dict[str, list[int]] = {}
        depth = self.branch_depth
        for i, q in enumerate(queries):
            if q:
                by_shard.setdefault(self.owner(q[min(depth, len(q)) - 1]), []).append(i)
        answers = self.call_many(
            {n: ("match_batch", ([queries[i] for i in idx],)) for n, idx in by_shard.items()}
        )
        out = [ClusterMatch(lengths={}, shard="", partial=False) for _ in queries]
        for name, (lengths, partial) in answers.items():
            for i, got in zip(by_shard[name], lengths, strict=True):
                out[i] = ClusterMatch(lengths=got, shard=name, partial=partial)
        return out

    def match_lengths(self, page_keys: Sequence[bytes]) -> dict[str, int]:
        """The Router's hook: pages matched per instance (one shard call)."""
        return self.match_batch([page_keys])[0].lengths

    def stats(self) -> dict[str, dict[str, Any]]:
        return self.call_many({n: ("stats", ()) for n in self.names})

    def skew(self) -> float:
        """Entries of the fullest shard over the mean (1.0 = even)."""
        entries = [s["entries"] for s in self.stats().values()]
        mean = sum(entries) / len(entries)
        return max(entries) / mean if mean else 0.0


class ShardedPublisher:
    """Instance side: splits a tree's events by owning shard, numbers them per shard, sends a
    dump of a shard's branches when that shard reports a gap (or restarted)."""

    def __init__(
        self,
        instance: str,
        cluster: ClusterIndex,
        tree: UnifiedRadixCache | None,
        *,
        node_id: str,
        ttl_s: float | None = None,
        actor: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.instance = instance
        self.cluster = cluster
        self.tree = tree
        # Per key below the trunk: its branch key; per trunk key (on every shard): its depth.
        # One dict entry per key (a probe of a large dict is ~1 us of cache misses here).
        self._branch: dict[bytes, bytes] = {}
        self._trunk: dict[bytes, int] = {}
        self._seq = dict.fromkeys(cluster.names, 0)
        self.dumps_sent = 0
        if ttl_s is not None and not ttl_s > 0:
            raise InvalidParameter(f"ttl_s must be > 0 or None, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._registration = (instance, node_id, ttl_s, actor)
        cluster.call_many({n: ("register_instance", self._registration) for n in cluster.names})
        self._contact = dict.fromkeys(cluster.names, clock())

    def heartbeat(self) -> None:
        """Extend this instance's lease on every shard (call more often than `ttl_s` while
        there is nothing to publish)."""
        answers = self.cluster.call_many(
            {n: ("renew", ([self.instance],)) for n in self.cluster.names}
        )
        now = self._clock()
        for name in self.cluster.names:
            self._contact[name] = now
        for name, unknown in answers.items():
            if self.instance in unknown and self.tree is not None:
                self.send_dump(name)

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Send `events` to the shards owning their keys, one numbered batch per shard. With a
        lease, the shards that get no batch and were last told more than half a lease ago get
        a `renew` in the same round (a lease is per shard)."""
        per_shard = self.batches(events)
        calls: dict[str, tuple[str, tuple[Any, ...]]] = {
            name: ("apply_batches", ([item],)) for name, item in per_shard.items()
        }
        now = self._clock()
        if self.ttl_s is not None:
            for name in self.cluster.names:
                if name not in calls and now - self._contact[name] > self.ttl_s / 2:
                    calls[name] = ("renew", ([self.instance],))
        answers = self.cluster.call_many(calls)
        for name in calls:
            self._contact[name] = now
        for name in calls:
            ok = answers[name][0] if name in per_shard else self.instance not in answers[name]
            if not ok:
                self.send_dump(name)

    def batches(self, events: Sequence[KVEvent]) -> dict[str, tuple[str, int, bytes]]:
        """`events` split by owning shard, numbered and encoded: shard -> (instance, seq,
        msgpack payload), for `IndexShard.apply_batches` (or `round`). Advances the sequence
        numbers: every batch returned must be sent, in order per shard."""
        out: dict[str, tuple[str, int, bytes]] = {}
        for name, evs in self._split(events).items():
            seq = self._seq[name]
            self._seq[name] = seq + 1
            out[name] = (self.instance, seq, encode_events(evs))
        return out

    def send_dump(self, name: str) -> None:
        """A dump of this instance's branches owned by shard `name`, resuming its sequence."""
        if self.tree is None:
            raise InvalidParameter(f"{self.instance} publishes without a tree: it cannot dump")
        # Register again: a shard that purged this instance (lease run out) forgot it.
        self.cluster.call_many({name: ("register_instance", self._registration)})
        owned: list[KVEvent] = []
        for event in dump_tree(self.tree):  # parents before children
            assert isinstance(event, BlockStored)
            for branch, keys in self._assign(event):
                if branch is None or self.cluster.owner(branch) == name:
                    owned.append(
                        BlockStored(
                            page_keys=keys,
                            parent_key=None,
                            tokens_per_page=event.tokens_per_page,
                            namespace=event.namespace,
                        )
                    )
        self.cluster.call_many(
            {name: ("load_dump", (self.instance, encode_events(owned), self._seq[name]))}
        )
        self.dumps_sent += 1

    def _assign(self, event: BlockStored) -> list[tuple[bytes | None, tuple[bytes, ...]]]:
        """The event's keys grouped by branch (None: trunk), in order; records each key's
        branch (or trunk depth). A run below the trunk stays on one branch, so at most two
        groups: the trunk part (depths < d - 1) and the rest, recorded with C-level updates.
        A parent never seen counts as the root (depth 0)."""
        parent = event.parent_key
        keys = tuple(event.page_keys)
        inherited = None if parent is None else self._branch.get(parent)
        if inherited is not None:  # below the trunk: the parent's branch
            self._branch.update(zip(keys, repeat(inherited)))
            return [(inherited, keys)]
        depth = 0 if parent is None else self._trunk.get(parent, -1) + 1
        trunk = max(0, min(len(keys), self.cluster.branch_depth - 1 - depth))
        groups: list[tuple[bytes | None, tuple[bytes, ...]]] = []
        if trunk:
            self._trunk.update(zip(keys[:trunk], range(depth, depth + trunk), strict=True))
            groups.append((None, keys[:trunk]))
        if trunk < len(keys):  # keys[trunk] is at depth d - 1: it names the branch
            branch = keys[trunk]
            self._branch.update(zip(keys[trunk:], repeat(branch)))
            groups.append((branch, keys[trunk:]))
        return groups

    def _targets(self, branch: bytes | None) -> list[str]:
        return list(self.cluster.names) if branch is None else [self.cluster.owner(branch)]

    def _split(self, events: Sequence[KVEvent]) -> dict[str, list[KVEvent]]:
        """`events` by owning shard. Per shard, consecutive parts of one kind, tier, namespace
        and page size are merged into one event (the index applies an event's keys in order,
        so [a, b] then [c] is [a, b, c]): a batch carries a few events, not one per part."""
        runs: dict[str, list[_Run]] = {}

        def add(name: str, kind: type, tier: Any, namespace: Any, tpp: int, keys: Any) -> None:
            got = runs.get(name)
            if got is None:
                runs[name] = [(kind, tier, namespace, tpp, list(keys))]
                return
            last = got[-1]
            if last[0] is kind and last[1] == tier and last[2] == namespace and last[3] == tpp:
                last[4].extend(keys)
            else:
                got.append((kind, tier, namespace, tpp, list(keys)))

        for event in events:
            if isinstance(event, BlockStored):
                for branch, keys in self._assign(event):
                    for name in self._targets(branch):
                        add(
                            name,
                            BlockStored,
                            event.tier,
                            event.namespace,
                            event.tokens_per_page,
                            keys,
                        )
            elif isinstance(event, BlockRemoved):
                keys = event.page_keys
                branches: list[bytes | None] = list(map(self._branch.pop, keys, repeat(_UNKNOWN)))
                if _UNKNOWN in branches:  # trunk keys (rare), or keys never seen stored
                    branches = [
                        b if b is not _UNKNOWN else None if self._trunk.pop(k, -1) >= 0 else b
                        for k, b in zip(keys, branches, strict=True)
                    ]
                distinct = set(branches)
                removed: dict[str, list[bytes]] = {}
                if len(distinct) == 1:  # the common case: one branch (or the trunk)
                    (branch,) = distinct
                    if branch is not _UNKNOWN:
                        for name in self._targets(branch):
                            removed[name] = list(keys)
                else:
                    for key, branch in zip(keys, branches, strict=True):
                        if branch is _UNKNOWN:
                            continue
                        for name in self._targets(branch):
                            removed.setdefault(name, []).append(key)
                for name, part in removed.items():
                    add(name, BlockRemoved, event.tier, None, 0, part)
            elif isinstance(event, AllBlocksCleared):
                if event.tier is None or event.tier == "device":
                    self._branch.clear()
                    self._trunk.clear()
                for name in self.cluster.names:
                    add(name, AllBlocksCleared, event.tier, None, 0, ())
        return {name: [_event(run) for run in got] for name, got in runs.items()}


# (kind, tier, namespace, tokens per page, keys): consecutive parts of one shard's batch.
_Run = tuple[type, Any, Any, int, list[bytes]]


def _event(run: _Run) -> KVEvent:
    kind, tier, namespace, tpp, keys = run
    if kind is BlockStored:
        return BlockStored(
            page_keys=tuple(keys),
            parent_key=None,
            tokens_per_page=tpp,
            tier=tier,
            namespace=namespace,
        )
    if kind is BlockRemoved:
        return BlockRemoved(page_keys=tuple(keys), tier=tier)
    return AllBlocksCleared(tier=tier)
