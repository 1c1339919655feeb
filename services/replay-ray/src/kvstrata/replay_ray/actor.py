"""`InstanceActor`: one cluster replay instance as a Ray actor.

It holds an `EngineInstance` (the replay engine over its own device cache and host tier), the
L3 it opens itself (`open_storage("ray://...")`: the node stores of the cluster), and a
`ShardedPublisher` that sends the tree's KV events to the prefix index shard actors after every
request, before `serve` returns, so that the driver's next route sees them.
"""

from __future__ import annotations

from typing import Any

import ray

from kvstrata.prefix_index.cluster import ClusterIndex, ShardedPublisher
from kvstrata.replay.cluster_instance import EngineInstance, InstanceSpec, Served
from kvstrata.replay.request import ReplayRequest
from kvstrata.storage import Storage, open_storage


class InstanceActor:
    """Built inside the actor's process: `name`, how to build the engine (`spec`), the L3's
    `ray://` URL (None: no L3), the shard handles of the prefix index and their timeout."""

    def __init__(
        self,
        name: str,
        spec: InstanceSpec,
        *,
        storage_url: str | None,
        shards: dict[str, Any],
        timeout_s: float,
    ) -> None:
        self.storage: Storage | None = open_storage(storage_url) if storage_url else None
        self.instance = EngineInstance(name, spec, storage=self.storage)
        index = ClusterIndex(shards, page_size=spec.page_size, timeout_s=timeout_s)
        self.publisher = ShardedPublisher(
            name,
            index,
            self.instance.system.tree,
            node_id=ray.get_runtime_context().get_node_id(),
        )

    def serve(self, request: ReplayRequest) -> Served:
        """The engine's step on `request`, then its KV events to the shards."""
        served = self.instance.serve(request)
        self.publisher.publish(self.instance.take_events())
        return served

    def page_bytes(self) -> int:
        return self.instance.page_bytes

    def l3_capacity_bytes(self) -> int:
        return 0 if self.storage is None else self.storage.stats().capacity_bytes

    def check_integrity(self) -> None:
        self.instance.check_integrity()

    def close(self) -> None:
        """Drain the tier transfers, stop the workers, unmap the L3 arena."""
        self.instance.close()
        close = getattr(self.storage, "close", None)  # RayStorage unmaps its arena view
        if close is not None:
            close()
