"""SWAKVPool: full-attention and sliding-window layers in two MHA pools.

A hybrid model's sliding-window layers need only the last `sliding_window` tokens, so they live
in a smaller pool. Tokens are addressed by their FULL slot everywhere (the allocator hands out
full slots); the allocator's `full_to_swa` map says where a token's SWA copy lives:

    full slot s  --full_to_swa[s]-->  SWA slot (0 = none: the token slid out of the window,
                                      or never had one; writes to it land on the dummy slot)

The map belongs to the allocator (`SWAAllocator.full_to_swa`), which updates it in place; the
pool holds a reference, handed over once with `set_full_to_swa`. It is page-consistent: a full
page f maps wholly onto one SWA page s (`full_to_swa[f*P + o] = s*P + o`) or not at all, so
translating a full page's first slot translates the page.

Layer ids: `spec.full_layer_ids[i]` is layer i of `full_pool`, `spec.swa_layer_ids[j]` layer j
of `swa_pool`; `layer_pool(layer_id)` says which. Page I/O and host mirrors work on the two
sub-pools (each an MHAKVPool with its own size and slots).
"""

from __future__ import annotations

import torch

from kvstrata.pool.base import LayerRoute, check_index_range, check_index_tensor
from kvstrata.pool.errors import (
    BufferMismatch,
    LayerOutOfRange,
    ReservedIndex,
    SlotMapMissing,
)
from kvstrata.pool.mha import MHAKVPool
from kvstrata.pool.spec import SWASpec


class SWAKVPool:
    """A full pool of `size` token slots and an SWA pool of `swa_size` (both + the dummy page),
    with one page size and device. `check_locations` as for KVPool."""

    def __init__(
        self,
        spec: SWASpec,
        size: int,
        swa_size: int,
        page_size: int = 1,
        device: torch.device | str = "cpu",
        *,
        check_locations: bool | None = None,
    ) -> None:
        self.spec = spec
        self.full_pool = MHAKVPool(
            spec.full, size, page_size, device, check_locations=check_locations
        )
        self.swa_pool = MHAKVPool(
            spec.swa, swa_size, page_size, device, check_locations=check_locations
        )
        self.page_size = page_size
        self.device = self.full_pool.device
        self.check_locations = self.full_pool.check_locations
        self._routes: dict[int, LayerRoute[MHAKVPool]] = {
            **{g: LayerRoute(self.full_pool, i) for i, g in enumerate(spec.full_layer_ids)},
            **{g: LayerRoute(self.swa_pool, j) for j, g in enumerate(spec.swa_layer_ids)},
        }
        self._full_to_swa: torch.Tensor | None = None

    # --- description ---------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Usable full slots."""
        return self.full_pool.size

    @property
    def swa_size(self) -> int:
        """Usable sliding-window slots."""
        return self.swa_pool.size

    @property
    def sliding_window(self) -> int:
        return self.spec.sliding_window

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """Every global layer id held, ascending."""
        return self.spec.layer_ids

    @property
    def size_bytes(self) -> int:
        """Device bytes of both sub-pools (the map belongs to the allocator)."""
        return self.full_pool.size_bytes + self.swa_pool.size_bytes

    @property
    def full_to_swa(self) -> torch.Tensor | None:
        """The allocator's map handed over by set_full_to_swa, or None before that."""
        return self._full_to_swa

    # --- routing -------------------------------------------------------------------------------

    def layer_pool(self, layer_id: int) -> LayerRoute[MHAKVPool]:
        """The sub-pool holding global `layer_id` and its layer id there; LayerOutOfRange."""
        try:
            return self._routes[layer_id]
        except KeyError:
            raise LayerOutOfRange(
                f"layer {layer_id} is neither full {self.spec.full_layer_ids} "
                f"nor sliding-window {self.spec.swa_layer_ids}"
            ) from None

    def is_swa_layer(self, layer_id: int) -> bool:
        return self.layer_pool(layer_id).pool is self.swa_pool

    def set_full_to_swa(self, mapping: torch.Tensor) -> None:
        """Adopt the allocator's full-to-SWA map (int64 `[full num_rows]`, on this device): the
        pool keeps a reference, not a copy, so the allocator's later in-place updates are seen.
        Checked once here (shape, dtype, device, values in the SWA pool, slot 0 -> 0)."""
        want = (self.full_pool.num_rows,)
        if not isinstance(mapping, torch.Tensor) or mapping.dtype != torch.int64:
            raise BufferMismatch("full_to_swa must be an int64 tensor")
        if tuple(mapping.shape) != want or mapping.device != self.device:
            raise BufferMismatch(
                f"full_to_swa must be {list(want)} on {self.device}, got "
                f"{list(mapping.shape)} on {mapping.device}"
            )
        check_index_range(
            mapping, limit=self.swa_pool.num_rows, what="full_to_swa values", allow_zero=True
        )
        if int(mapping[0]) != 0:
            raise ReservedIndex("full_to_swa[0] must be 0: the dummy slot maps to the dummy slot")
        self._full_to_swa = mapping

    def translate(self, full_loc: torch.Tensor) -> torch.Tensor:
        """SWA slots of full slots `full_loc` (any shape), 0 where a token has none. Returns a
        new int64 tensor; reads the map as it is now. SlotMapMissing before set_full_to_swa."""
        mapping = self._full_to_swa
        if mapping is None:
            raise SlotMapMissing("translate before set_full_to_swa handed over the allocator map")
        loc = check_index_tensor(full_loc, what="full_loc", dims=None)
        if self.check_locations:
            check_index_range(loc, limit=self.full_pool.num_rows, what="full_loc", allow_zero=True)
        return mapping[loc.to(self.device)]

    # --- attention -----------------------------------------------------------------------------

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """K buffer of global `layer_id`, indexed by that sub-pool's slots (SWA layers: by
        translated slots). A view."""
        route = self.layer_pool(layer_id)
        return route.pool.get_key_buffer(route.local_layer_id)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        route = self.layer_pool(layer_id)
        return route.pool.get_value_buffer(route.local_layer_id)

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
        """Write K and V of tokens at FULL slots `loc` into global `layer_id`: at `loc` for a
        full layer, at `translate(loc)` for a sliding-window layer (tokens without an SWA slot
        land on the dummy slot 0). Mutates that layer's rows only. Errors as
        MHAKVPool.set_kv, plus SlotMapMissing for an SWA layer before set_full_to_swa."""
        route = self.layer_pool(layer_id)
        if route.pool is self.swa_pool:
            loc = self.translate(loc)
        route.pool.set_kv(route.local_layer_id, loc, k, v, k_scale=k_scale, v_scale=v_scale)

    # --- integrity -----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Both sub-pools' geometry, and the map (when handed over): values in the SWA pool,
        slot 0 -> 0, no SWA slot shared by two full slots, each full page mapped wholly onto one
        SWA page or not at all. Reads the map (a sync on CUDA); mutates nothing."""
        self.full_pool.check_integrity()
        self.swa_pool.check_integrity()
        mapping = self._full_to_swa
        if mapping is None:
            return
        assert mapping.shape == (self.full_pool.num_rows,), "full_to_swa changed shape"
        m = mapping.cpu()
        lo, hi = int(m.min()), int(m.max())
        assert lo >= 0 and hi < self.swa_pool.num_rows, (
            f"full_to_swa holds values in [{lo}, {hi}], outside the SWA pool; the allocator "
            "that owns the map wrote them"
        )
        assert int(m[0]) == 0, "full_to_swa[0] must stay 0"
        used = m[m != 0]
        assert torch.unique(used).numel() == used.numel(), "an SWA slot serves two full slots"
        p = self.page_size
        pages = m.view(-1, p)
        first = pages[:, 0]
        mapped = first != 0
        offsets = torch.arange(p, dtype=torch.int64)
        assert bool((pages[~mapped] == 0).all()), "a full page is partly mapped to SWA"
        assert bool((first[mapped] % p == 0).all()), "a full page maps to an unaligned SWA slot"
        assert bool((pages[mapped] == first[mapped, None] + offsets).all()), (
            "a full page is not mapped onto one SWA page, offsets kept"
        )
