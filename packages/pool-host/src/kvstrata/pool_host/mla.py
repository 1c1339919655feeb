"""Host mirror of an MLA device pool: one buffer per layer (latent + rope), so layer l is
buffer l - start_layer."""

from __future__ import annotations

from kvstrata.pool import MLAKVPool
from kvstrata.pool_host.base import KVHostPool


class MLAHostPool(KVHostPool[MLAKVPool]):
    """Host mirror of an MLAKVPool. Constructor: see HostPool."""

    family = "mla"

    def layer_buffer_ids(self, layer_id: int) -> tuple[int, ...]:
        return (self._local_layer(layer_id),)
