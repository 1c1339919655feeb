"""MLAKVPool: per layer one latent buffer (multi-head latent attention, DeepSeek style).

Memory: one stack `[L, num_rows, 1, kv_lora_rank + qk_rope_head_dim]`. Each token row is the
compressed latent followed by the rope part of the key; V is the latent alone, so the value
buffer is a view of the first `kv_lora_rank` columns:

    row:  | k_nope (kv_lora_rank) | k_rope (qk_rope_head_dim) |
          |<-------- V ---------->|

`layer_buffers()` and the flat page are the layers in order: | L(l0) | L(l0+1) | ... |.
"""

from __future__ import annotations

import torch

from kvstrata.pool.base import KVPool
from kvstrata.pool.dtypes import to_logical, to_store
from kvstrata.pool.page_io import BufferStack, empty_stack
from kvstrata.pool.spec import MLASpec


class MLAKVPool(KVPool[MLASpec]):
    """Latent KV of `spec.num_layers` MLA layers for `size` token slots (+ the dummy page).

    `size` must be a positive multiple of `page_size`. Buffers are zeroed at construction.
    """

    def _allocate(self) -> list[BufferStack]:
        spec = self.spec
        layers = spec.num_layers
        self._kv = empty_stack(
            layers, self.num_rows, (1, spec.kv_dim), dtype=spec.store_dtype, device=self.device
        )
        page = spec.bytes_per_token // layers * self.page_size
        self._kv_views = [to_logical(self._kv[i], spec.dtype) for i in range(layers)]
        self._v_views = [view[..., : spec.kv_lora_rank] for view in self._kv_views]
        return [BufferStack(tensor=self._kv, page_offset=0, page_stride=page)]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """The latent buffer of global `layer_id`: `[num_rows, 1, kv_lora_rank + rope]`,
        logical dtype (a view)."""
        return self._kv_views[self.local_layer_id(layer_id)]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """`[num_rows, 1, kv_lora_rank]`: the first columns of the latent buffer (a strided
        view, not contiguous)."""
        return self._v_views[self.local_layer_id(layer_id)]

    def set_kv(
        self,
        layer_id: int,
        loc: torch.Tensor,
        k_nope: torch.Tensor,
        k_rope: torch.Tensor,
    ) -> None:
        """Write the latent (`k_nope`, `[n, 1, kv_lora_rank]`) and rope key (`k_rope`,
        `[n, 1, qk_rope_head_dim]`) of `len(loc)` tokens of global `layer_id` at slots `loc`,
        cast to the pool's dtype. Mutates rows `loc` of that layer only. Errors as
        MHAKVPool.set_kv, raised before anything is written.
        """
        local = self.local_layer_id(layer_id)
        loc = self._locations(loc)
        n = loc.numel()
        spec = self._spec
        nope = self._token_values(k_nope, n, (1, spec.kv_lora_rank), "k_nope")
        rope = self._token_values(k_rope, n, (1, spec.qk_rope_head_dim), "k_rope")
        row = torch.cat([to_store(nope, self.dtype), to_store(rope, self.dtype)], dim=-1)
        self._kv[local][loc] = row
