"""Host mirror of an MHA device pool (also each sub-pool of an SWA pool).

The device pool's layer_buffers() are K of every layer, then V of every layer, so layer l
(local index l = layer_id - start_layer) is buffers (l, L + l). K and V may differ in width
(v_head_dim); the mirror copies bytes, so that needs no special case.

SWA: build one MHAHostPool per sub-pool (`swa_pool.full_pool` and `swa_pool.swa_pool`), each
with its own HostSlotAllocator; the full-to-SWA index map stays with the caller.
"""

from __future__ import annotations

from kvstrata.pool import MHAKVPool
from kvstrata.pool_host.base import KVHostPool


class MHAHostPool(KVHostPool[MHAKVPool]):
    """Host mirror of an MHAKVPool. Constructor: see HostPool."""

    family = "mha"

    def layer_buffer_ids(self, layer_id: int) -> tuple[int, ...]:
        local = self._local_layer(layer_id)
        return (local, len(self.layer_ids) + local)
