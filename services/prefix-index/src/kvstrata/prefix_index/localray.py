"""A local Ray cluster on loopback for the shard tests and `kvstrata bench index --ray`
(RAY_NOTES.md: loopback and quiet settings in the environment before Ray starts, small object
stores, no dashboard, health checks fast enough to notice a killed node in ~1.5 s).

RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps every socket on 127.0.0.1. Ray reads it at import, and
the package imports Ray before this module runs, so `loopback_cluster` sets the variable for
the node processes and Ray's flag in this process for the cluster's lifetime. It does the same
with RAY_ENABLE_UV_RUN_RUNTIME_ENV=0: a driver started by `uv run` otherwise gets a runtime env
that uploads the working tree and starts every worker with `uv run` in a fresh copy of it (a
new venv, no bytecode), so an actor took over 60 s to start here and the cluster looked like it
had not come up.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import ray
from ray._private import ray_constants
from ray.actor import ActorHandle
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvstrata.prefix_index.channel import Pending
from kvstrata.prefix_index.cluster import ClusterIndex, ShardedPublisher, deploy_shards
from kvstrata.prefix_index.errors import InvalidParameter, ShardUnavailable
from kvstrata.prefix_index.opstream import OpStream, OpTiming
from kvstrata.unified_radix_cache import KVEvent

_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    # A loaded 2-core machine can take longer than the default 30 s to register a raylet.
    "RAY_raylet_start_wait_time_s": "120",
    "RAY_agent_register_timeout_ms": "120000",
}
_STORE = 128 * 1024 * 1024


class RayDidNotStart(RuntimeError):
    """The loopback cluster did not come up (an overloaded machine: Ray waits 30 s at most
    for a raylet to register, a constant in Ray 2.60)."""


def _start(num_workers: int) -> Cluster:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "object_store_memory": _STORE,
            "include_dashboard": False,
            "_system_config": {
                "health_check_period_ms": 500,
                "health_check_timeout_ms": 500,
                "health_check_failure_threshold": 3,
            },
        },
    )
    try:
        for i in range(num_workers):
            cluster.add_node(num_cpus=1, object_store_memory=_STORE, resources={f"w{i}": 1})
        cluster.wait_for_nodes()
    except Exception:
        cluster.shutdown()
        raise
    return cluster


@contextmanager
def loopback_cluster(num_workers: int, attempts: int = 2) -> Iterator[Cluster]:
    saved = {k: os.environ.get(k) for k in [*_ENV, "RAY_TMPDIR"]}
    tmp = tempfile.mkdtemp(prefix="kvstrata-prefix-index-ray-")
    os.environ.update(_ENV, RAY_TMPDIR=tmp)
    # Ray read RAY_ENABLE_UV_RUN_RUNTIME_ENV when it was imported (perhaps before this call, by
    # another module): switch the hook off where `ray.init` reads it, for this cluster only.
    saved_uv_hook = ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV
    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
    # Likewise the loopback switch: this process picks each new node's address from the flag
    # Ray set at import; left True, the nodes listened on `*` at the interface address.
    saved_loopback = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    cluster: Cluster | None = None
    try:
        errors: list[str] = []
        for _ in range(attempts):
            try:
                cluster = _start(num_workers)
                break
            except Exception as exc:  # noqa: BLE001 (Ray raises a bare Exception on a timeout)
                errors.append(str(exc))
        if cluster is None:
            raise RayDidNotStart("; ".join(errors))
        ray.init(address=cluster.address, log_to_driver=False, namespace="kvstrata-test")
        yield cluster
    finally:  # each step runs even when the one before raised
        try:
            ray.shutdown()
        finally:
            ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = saved_uv_hook
            ray_constants.ENABLE_RAY_CLUSTER = saved_loopback
            try:
                if cluster is not None:
                    cluster.shutdown()
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
                # The session folder (logs, sockets): 0.3-0.7 MB a run, GBs after long ones.
                shutil.rmtree(tmp, ignore_errors=True)


@dataclass(frozen=True, kw_only=True)
class RoundTrips:
    """Sequential `echo` calls to one shard: wall p50/p99 and the caller's CPU per call."""

    calls: int
    p50_us: float
    p99_us: float
    cpu_us_per_call: float


@dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    """One Ray replay: `direct` (TCP channel) or Ray calls, requests per round, rounds out."""

    direct: bool
    batch_requests: int
    in_flight: int


class AsyncEcho:
    """An async Ray actor (`async def`, `max_concurrency`): the bench times its bare round
    trip beside the shard's sync actor calls (an async shard would pay at least this)."""

    async def echo(self, value: object) -> object:
        return value


def round_trips(cluster: ClusterIndex, name: str, calls: int) -> RoundTrips:
    """`calls` sequential `echo(0)` round trips to shard `name` on `cluster`'s transport."""
    return _timed(lambda: cluster.submit(name, "echo", (0,)).get(), calls)


def async_actor_round_trips(node_id: str, calls: int, timeout_s: float = 120) -> RoundTrips:
    """The same against an `AsyncEcho` actor (max_concurrency 16) placed on `node_id`."""
    actor: Any = (
        ray.remote(AsyncEcho)
        .options(
            num_cpus=0,
            max_concurrency=16,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote()
    )
    try:
        return _timed(lambda: ray.get(actor.echo.remote(0), timeout=timeout_s), calls)
    finally:
        ray.kill(actor)


def _timed(call: Callable[[], object], calls: int) -> RoundTrips:
    call()  # connect / warm
    walls: list[float] = []
    cpu0 = time.process_time()
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        walls.append(time.perf_counter() - t0)
    cpu = time.process_time() - cpu0
    walls.sort()
    return RoundTrips(
        calls=calls,
        p50_us=walls[len(walls) // 2] * 1e6,
        p99_us=walls[min(len(walls) - 1, int(0.99 * len(walls)))] * 1e6,
        cpu_us_per_call=cpu / calls * 1e6,
    )


@dataclass(frozen=True, kw_only=True)
class ClusterReplay:
    """One replay through the shards: the op timing (the driver's CPU in `cpu_seconds`), the
    part of that CPU spent publishing (splitting events by shard and encoding them: in a
    deployment each engine instance pays it, not the router), and the shards' CPU (all shard
    processes, all their threads, during the replay)."""

    timing: OpTiming
    publish_cpu_s: float
    shard_cpu_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class LocalClusterRun:
    """`replay_on_local_cluster`'s results: one `ClusterReplay` per config (in order), the bare
    round trips ("ray", "direct", "ray_async_actor"), the shards and the last replay's skew."""

    replays: list[ClusterReplay]
    trips: dict[str, RoundTrips]
    num_shards: int
    skew: float


def replay_on_local_cluster(
    stream: OpStream,
    configs: Sequence[ReplayConfig],
    *,
    num_workers: int = 1,
    branch_depth: int = 2,
    ping_calls: int = 300,
) -> LocalClusterRun:
    """Start a loopback cluster of 1 + `num_workers` nodes, deploy one shard per node, and in
    that one session: time `ping_calls` bare round trips on Ray and on the direct channel,
    then replay `stream` once per config (`replay_ops_on_cluster`; the instances are dropped
    from every shard between replays), with the CPU the shard processes spent in each.
    Everything is shut down on return."""
    with loopback_cluster(num_workers=num_workers):
        shards = deploy_shards(stream.page_size)
        ray.get([h.stats.remote() for h in shards.values()], timeout=120)
        node = ray.get_runtime_context().get_node_id()
        clusters = {
            direct: ClusterIndex(
                shards,
                page_size=stream.page_size,
                timeout_s=120,
                branch_depth=branch_depth,
                direct=direct,
            )
            for direct in (False, True)
        }
        try:
            first = clusters[False].names[0]
            trips = {
                "ray": round_trips(clusters[False], first, ping_calls),
                "direct": round_trips(clusters[True], first, ping_calls),
                "ray_async_actor": async_actor_round_trips(
                    clusters[False].stats()[first]["node_id"], ping_calls
                ),
            }
            instances = sorted({r.instance for r in stream.requests})
            replays: list[ClusterReplay] = []
            for config in configs:
                clusters[False].call_many(
                    {n: ("purge_instances", (instances,)) for n in clusters[False].names}
                )
                before = clusters[False].stats()
                got = replay_ops_on_cluster(
                    clusters[config.direct],
                    stream,
                    batch_requests=config.batch_requests,
                    node_id=node,
                    in_flight=config.in_flight,
                )
                after = clusters[False].stats()
                shard_cpu = sum(after[n]["cpu_s"] - before[n]["cpu_s"] for n in after)
                replays.append(
                    ClusterReplay(
                        timing=got.timing, publish_cpu_s=got.publish_cpu_s, shard_cpu_s=shard_cpu
                    )
                )
            return LocalClusterRun(
                replays=replays, trips=trips, num_shards=len(shards), skew=clusters[False].skew()
            )
        finally:
            clusters[True].close()


def replay_ops_on_cluster(
    cluster: ClusterIndex,
    stream: OpStream,
    *,
    batch_requests: int,
    node_id: str,
    in_flight: int = 1,
) -> ClusterReplay:
    """The INDEXER_BENCH stream through the shards, `batch_requests` requests a round: one
    `round` call per shard carrying the round's lookups owned by that shard and the round's
    event batches for it; up to `in_flight` rounds outstanding (Ray runs one caller's calls to
    an actor in order, and a direct channel serves them in order, so every shard still sees
    the stream in order). Each op's latency is its round's time from submission to answer.
    Shard-side gaps cannot happen here (no batch is lost): one is an error. The shards' CPU is
    not measured here (`shard_cpu_s` 0: see `replay_on_local_cluster`)."""
    if batch_requests < 1 or in_flight < 1:
        raise InvalidParameter(
            f"batch_requests and in_flight must be >= 1, got {batch_requests}, {in_flight}"
        )
    if not all(isinstance(h, ActorHandle) for h in cluster.shards.values()):
        raise InvalidParameter("replay_ops_on_cluster needs Ray shard actors")
    publishers: dict[str, ShardedPublisher] = {}
    for req in stream.requests:
        if req.instance not in publishers:
            publishers[req.instance] = ShardedPublisher(
                req.instance, cluster, None, node_id=node_id
            )
    depth = cluster.branch_depth
    requests = stream.requests
    # Counted before the clock starts: the replay's own bookkeeping is not the index's cost.
    chunks = [requests[lo : lo + batch_requests] for lo in range(0, len(requests), batch_requests)]
    chunk_ops = [sum(1 + len(r.events) for r in chunk) for chunk in chunks]
    pages = sum(
        len(r.page_keys) + sum(len(getattr(e, "page_keys", ())) for e in r.events) for r in requests
    )
    latencies: list[float] = []
    pending: deque[tuple[float, int, list[Pending]]] = deque()

    def settle() -> None:
        t0, ops, answers = pending.popleft()
        for answer in answers:
            if not all(answer.get()[2]):
                raise ShardUnavailable("a shard reported a gap in a lossless replay")
        latencies.extend(repeat(time.perf_counter() - t0, ops))

    # Publishing runs in this thread: its thread CPU clock (process_time sums every thread of
    # the process, Ray's included, at a cost that grows with their number).
    thread_cpu = time.thread_time
    publish_cpu = 0.0
    start = time.perf_counter()
    cpu_start = time.process_time()
    for chunk, ops in zip(chunks, chunk_ops, strict=True):
        t0 = time.perf_counter()
        queries: dict[str, list[Sequence[bytes]]] = {}
        items: dict[str, list[tuple[str, int, bytes]]] = {}
        by_instance: dict[str, list[KVEvent]] = {}
        for r in chunk:
            q = r.page_keys
            if q:
                queries.setdefault(cluster.owner(q[min(depth, len(q)) - 1]), []).append(q)
            by_instance.setdefault(r.instance, []).extend(r.events)
        c0 = thread_cpu()
        for name, events in by_instance.items():
            for shard, item in publishers[name].batches(events).items():
                items.setdefault(shard, []).append(item)
        publish_cpu += thread_cpu() - c0
        answers = [
            cluster.submit(n, "round", (queries.get(n, []), items.get(n, [])))
            for n in cluster.names
            if n in queries or n in items
        ]
        pending.append((t0, ops, answers))
        while len(pending) >= in_flight:
            settle()
    while pending:
        settle()
    seconds = time.perf_counter() - start
    ordered = sorted(latencies)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6

    timing = OpTiming(
        ops=len(latencies),
        pages=pages,
        seconds=seconds,
        cpu_seconds=time.process_time() - cpu_start,
        p50_us=pct(0.50),
        p99_us=pct(0.99),
        max_us=ordered[-1] * 1e6 if ordered else 0.0,
        lookup_p99_us=pct(0.99),
        event_p99_us=pct(0.99),
    )
    return ClusterReplay(timing=timing, publish_cpu_s=publish_cpu)
