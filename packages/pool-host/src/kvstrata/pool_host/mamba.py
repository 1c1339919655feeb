"""Host mirror of a Mamba state pool.

A Mamba "page" is one request's state slot (page_size 1), and slot 0 is reserved on the device
as for KV pools. layer_buffers() interleaves conv_state[l], ssm_state[l], so layer l is buffers
(2l, 2l + 1). Conv and SSM states may have different dtypes; copies move bytes, so each keeps
its own. Sizing by `size` or `ratio` counts state slots.
"""

from __future__ import annotations

from kvstrata.pool import MambaPool
from kvstrata.pool_host.base import HostPool


class MambaHostPool(HostPool[MambaPool]):
    """Host mirror of a MambaPool. Constructor: see HostPool."""

    family = "mamba"

    @property
    def layer_ids(self) -> range:
        return range(self.device_pool.spec.num_layers)

    def layer_buffer_ids(self, layer_id: int) -> tuple[int, ...]:
        local = self._local_layer(layer_id)
        return (2 * local, 2 * local + 1)
