"""Models interleaving full and sliding-window attention: a full pool and an SWA pool allocated
in step, and a Full + SWA tree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from kvstrata.allocator import SWAAllocator
from kvstrata.build.errors import InvalidCapacity, InvalidModel
from kvstrata.build.mha import AttentionHeads
from kvstrata.build.system import BuildParams, MemorySystem, assemble_system
from kvstrata.hybrid_cache import HybridPool
from kvstrata.pool import PoolError, SWAKVPool, SWASpec
from kvstrata.unified_radix_cache import FullComponent, SWAComponent

if TYPE_CHECKING:
    from kvstrata.unified_radix_cache.components.swa import SWASlotSink


@dataclass(frozen=True, kw_only=True)
class SWAModel(AttentionHeads):
    """Full-attention layers `full_layer_ids` keep every token; sliding-window layers
    `swa_layer_ids` keep only the last `sliding_window` tokens a request still needs.

    Default: 2 layers (0 full, 1 sliding-window, as Gemma-style 1:N interleaving with N = 1), one
    KV head of 4 float32 values, a window of 128 tokens.
    """

    full_layer_ids: tuple[int, ...] = (0,)
    swa_layer_ids: tuple[int, ...] = (1,)
    sliding_window: int = 128

    def kv_spec(self) -> SWASpec:
        return SWASpec(
            full=self.attention_spec(len(self.full_layer_ids)),
            swa=self.attention_spec(len(self.swa_layer_ids)),
            full_layer_ids=self.full_layer_ids,
            swa_layer_ids=self.swa_layer_ids,
            sliding_window=self.sliding_window,
        )


def build_swa_system(model: object | None, params: BuildParams) -> MemorySystem:
    """SWA allocator + SWA pool (full and sliding-window sub-pools) + Full/SWA tree.

    The SWA pool gets `swa_ratio * capacity_tokens` slots, rounded down to whole pages.
    InvalidModel for a non-`SWAModel` or a layout the pool refuses; InvalidCapacity when the
    SWA pool would hold less than one page.
    """
    config = SWAModel() if model is None else model
    if not isinstance(config, SWAModel):
        raise InvalidModel(f"family 'swa' needs an SWAModel, got {type(config).__name__}")
    if not config.full_layer_ids or not config.swa_layer_ids:
        raise InvalidModel("an SWAModel needs at least one full and one sliding-window layer")
    try:
        spec = config.kv_spec()
    except PoolError as exc:
        raise InvalidModel(f"SWAModel refused by the pool: {exc}") from exc
    size, page_size, device = params.capacity_tokens, params.page_size, params.device
    swa_size = int(size * params.swa_ratio)
    swa_size -= swa_size % page_size
    if swa_size < page_size:
        raise InvalidCapacity(
            f"swa_ratio {params.swa_ratio} of {size} tokens leaves the SWA pool less than a page"
        )
    allocator = SWAAllocator(size=size, swa_size=swa_size, page_size=page_size, device=device)
    pool = SWAKVPool(spec, size, swa_size, page_size, device)
    # The pool reads the allocator's live map: translate() sees every alloc and free at once.
    pool.set_full_to_swa(allocator.full_to_swa)
    # cast: SWASlotSink.free_swa names its parameter `full_indices`, SWAAllocator.free_swa
    # `indices`; the tree calls it positionally, so the allocator fits (reported upstream).
    swa_sink = cast("SWASlotSink", allocator)
    return assemble_system(
        "swa",
        config,
        params,
        [FullComponent(allocator), SWAComponent(swa_sink, sliding_window=config.sliding_window)],
        kv_allocator=allocator,
        kv_pool=pool,
        layers=HybridPool.swa(pool),
    )
