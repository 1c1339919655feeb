"""Hybrid models mixing attention layers with Mamba (SSM) layers: a paged KV pool for the
attention layers, a state pool with one slot per request or cached prefix, and a Full + Mamba
tree."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.allocator import MambaSlotAllocator, PagedAllocator
from kvstrata.build.errors import InvalidModel
from kvstrata.build.mha import AttentionHeads
from kvstrata.build.system import BuildParams, MemorySystem, assemble_system
from kvstrata.hybrid_cache import HybridCacheError, HybridPool
from kvstrata.pool import MambaPool, MambaSpec, MHAKVPool, MHASpec, PoolError
from kvstrata.unified_radix_cache import FullComponent, MambaComponent

#: Default state slots: one per 64 KV tokens of capacity (a cached prefix is hundreds of tokens
#: long, so the KV pool, not the state pool, usually runs out first), at least 4.
TOKENS_PER_STATE_SLOT = 64


@dataclass(frozen=True, kw_only=True)
class MambaModel(AttentionHeads):
    """Attention layers `attention_layer_ids` keep K and V of every token; Mamba layers
    `mamba_layer_ids` keep one conv state `[conv_dim, conv_kernel - 1]` and one SSM state
    `[num_heads, state_head_dim, state_size]` per sequence.

    Default: 4 layers, Mamba at 0..2 and attention at 3 (the 3:1 pattern of hybrid models such
    as Jamba or Qwen3-Next), one KV head of 4 float32 values, small float32 states.
    """

    attention_layer_ids: tuple[int, ...] = (3,)
    mamba_layer_ids: tuple[int, ...] = (0, 1, 2)
    conv_dim: int = 8
    conv_kernel: int = 4
    num_heads: int = 2
    state_head_dim: int = 4
    state_size: int = 8
    conv_dtype: torch.dtype = torch.float32
    ssm_dtype: torch.dtype = torch.float32

    def kv_spec(self) -> MHASpec:
        return self.attention_spec(len(self.attention_layer_ids))

    def state_spec(self) -> MambaSpec:
        return MambaSpec(
            num_layers=len(self.mamba_layer_ids),
            conv_dim=self.conv_dim,
            conv_kernel=self.conv_kernel,
            num_heads=self.num_heads,
            head_dim=self.state_head_dim,
            state_size=self.state_size,
            conv_dtype=self.conv_dtype,
            ssm_dtype=self.ssm_dtype,
        )


def build_mamba_system(model: object | None, params: BuildParams) -> MemorySystem:
    """Paged KV allocator + MHA pool, Mamba slot allocator + state pool, Full/Mamba tree.

    State slots: `params.mamba_slots`, or `capacity_tokens // 64` (at least 4). InvalidModel for
    a non-`MambaModel` or a layout the pools or the router refuse.
    """
    config = MambaModel() if model is None else model
    if not isinstance(config, MambaModel):
        raise InvalidModel(f"family 'mamba' needs a MambaModel, got {type(config).__name__}")
    if not config.attention_layer_ids or not config.mamba_layer_ids:
        raise InvalidModel("a MambaModel needs at least one attention and one Mamba layer")
    layer_ids = (*config.attention_layer_ids, *config.mamba_layer_ids)
    if len(set(layer_ids)) != len(layer_ids):
        raise InvalidModel(f"layer ids must be distinct across attention and Mamba: {layer_ids}")
    try:
        kv_spec, state_spec = config.kv_spec(), config.state_spec()
    except PoolError as exc:
        raise InvalidModel(f"MambaModel refused by the pool: {exc}") from exc
    size, page_size, device = params.capacity_tokens, params.page_size, params.device
    slots = params.mamba_slots
    if slots is None:
        slots = max(4, size // TOKENS_PER_STATE_SLOT)
    kv_allocator = PagedAllocator(size=size, page_size=page_size, device=device)
    kv_pool = MHAKVPool(kv_spec, size, page_size, device)
    state_allocator = MambaSlotAllocator(size=slots, device=device)
    state_pool = MambaPool(state_spec, slots, device)
    try:
        layers = HybridPool.with_mamba(
            attention=kv_pool,
            attention_layer_ids=config.attention_layer_ids,
            mamba=state_pool,
            mamba_layer_ids=config.mamba_layer_ids,
        )
    except HybridCacheError as exc:
        raise InvalidModel(f"MambaModel layer layout refused by the router: {exc}") from exc
    return assemble_system(
        "mamba",
        config,
        params,
        [FullComponent(kv_allocator), MambaComponent(state_allocator, state_pool)],
        kv_allocator=kv_allocator,
        kv_pool=kv_pool,
        layers=layers,
        mamba_allocator=state_allocator,
        mamba_pool=state_pool,
    )
