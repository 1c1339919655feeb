"""MHAKVPool: per layer a K and a V buffer (multi-head and grouped-query attention).

Memory: K `[L, num_rows, heads, head_dim]` and V `[L, num_rows, heads, v_head_dim]` in the
store dtype; one allocation `[2L, ...]` when the two have the same shape, two otherwise.
`layer_buffers()` is K of every layer, then V of every layer, which is also the flat page
format:

    | K(l0) | K(l0+1) | ... | K(l0+L-1) | V(l0) | ... | V(l0+L-1) |      l0 = spec.start_layer
"""

from __future__ import annotations

import torch

from kvstrata.pool.base import KVPool
from kvstrata.pool.dtypes import to_logical, to_store
from kvstrata.pool.page_io import BufferStack, empty_stack
from kvstrata.pool.spec import MHASpec


class MHAKVPool(KVPool[MHASpec]):
    """K and V of `spec.num_layers` attention layers for `size` token slots (+ the dummy page).

    `size` must be a positive multiple of `page_size`. Buffers are zeroed at construction.
    """

    def _allocate(self) -> list[BufferStack]:
        spec = self.spec
        self._key_shape = (spec.num_kv_heads, spec.head_dim)
        self._value_shape = (spec.num_kv_heads, spec.value_head_dim)
        layers, store = spec.num_layers, spec.store_dtype
        k_page = spec.key_bytes_per_token * self.page_size
        v_page = spec.value_bytes_per_token * self.page_size
        if self._key_shape == self._value_shape:
            # One allocation for K and V: the flat page is then a single run of 2L equal
            # buffers, and page I/O makes one gather per page instead of two.
            kv = empty_stack(
                2 * layers, self.num_rows, self._key_shape, dtype=store, device=self.device
            )
            self._k, self._v = kv[:layers], kv[layers:]
            stacks = [BufferStack(tensor=kv, page_offset=0, page_stride=k_page)]
        else:
            self._k = empty_stack(
                layers, self.num_rows, self._key_shape, dtype=store, device=self.device
            )
            self._v = empty_stack(
                layers, self.num_rows, self._value_shape, dtype=store, device=self.device
            )
            stacks = [
                BufferStack(tensor=self._k, page_offset=0, page_stride=k_page),
                BufferStack(tensor=self._v, page_offset=layers * k_page, page_stride=v_page),
            ]
        # Logical views made once: get_key_buffer runs per layer per step.
        self._k_views = [to_logical(self._k[i], spec.dtype) for i in range(layers)]
        self._v_views = [to_logical(self._v[i], spec.dtype) for i in range(layers)]
        return stacks

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """K of global `layer_id`: `[num_rows, num_kv_heads, head_dim]`, logical dtype (a view)."""
        return self._k_views[self.local_layer_id(layer_id)]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """V of global `layer_id`: `[num_rows, num_kv_heads, v_head_dim]` (a view)."""
        return self._v_views[self.local_layer_id(layer_id)]

    def set_kv(
        self,
        layer_id: int,
        loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        k_scale: float | None = None,
        v_scale: float | None = None,
    ) -> None:
        """Write K and V of `len(loc)` tokens of global `layer_id` at slots `loc`.

        `k`: `[n, num_kv_heads, head_dim]` (or any shape with n rows of that many elements),
        `v` likewise with v_head_dim; any float dtype, cast to the pool's (divided by
        `k_scale` / `v_scale` first when given, as fp8 caches need). Mutates rows `loc` of that
        layer's K and V only; `k` and `v` are not modified. Slots may repeat only if their
        values agree (the winner of duplicate slots is unspecified). LayerOutOfRange,
        BufferMismatch, InvalidArgument or IndexOutOfRange (see `check_locations`) before
        anything is written.
        """
        local = self.local_layer_id(layer_id)
        loc = self._locations(loc)
        n = loc.numel()
        k = self._token_values(k, n, self._key_shape, "k")
        v = self._token_values(v, n, self._value_shape, "v")
        # Both casts before either write: a cast that fails must not leave K written alone.
        k_store = to_store(k, self.dtype, k_scale)
        v_store = to_store(v, self.dtype, v_scale)
        self._k[local][loc] = k_store
        self._v[local][loc] = v_store
