"""Full-attention (MHA / GQA) models: one paged KV pool, a Full-only tree."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.allocator import PagedAllocator
from kvstrata.build.errors import InvalidModel
from kvstrata.build.system import BuildParams, MemorySystem, assemble_system
from kvstrata.hybrid_cache import HybridPool
from kvstrata.pool import MHAKVPool, MHASpec, MLAKVPool, PoolError
from kvstrata.unified_radix_cache import FullComponent


@dataclass(frozen=True, kw_only=True)
class AttentionHeads:
    """The attention part every toy model config shares (`MHAModel`, `SWAModel`, `MambaModel`):
    KV heads, head size and dtype, by default 1 KV head of 4 float32 values. float32 holds
    integers up to 2**24 exactly, which the replay's `--verify` relies on to read back token
    ids."""

    num_kv_heads: int = 1
    head_dim: int = 4
    dtype: torch.dtype = torch.float32

    def attention_spec(self, num_layers: int) -> MHASpec:
        """The `MHASpec` of `num_layers` attention layers of these heads (validated by the
        spec: PoolError for a bad value)."""
        return MHASpec(
            num_layers=num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
        )


@dataclass(frozen=True, kw_only=True)
class MHAModel(AttentionHeads):
    """A full-attention model: every layer keeps K and V of every token.

    The default is deliberately tiny (2 layers, 1 KV head of 4 float32 values: 64 bytes a
    token) so that a replay of millions of tokens fits in memory and spends its time in the
    cache, not in copying KV.
    """

    num_layers: int = 2

    def kv_spec(self) -> MHASpec:
        return self.attention_spec(self.num_layers)


def build_mha_system(model: object | None, params: BuildParams) -> MemorySystem:
    """Paged allocator + MHA pool + Full-only tree. InvalidModel for a non-`MHAModel`."""
    config = MHAModel() if model is None else model
    if not isinstance(config, MHAModel):
        raise InvalidModel(f"family 'mha' needs an MHAModel, got {type(config).__name__}")
    try:
        spec = config.kv_spec()  # validates the config before anything is allocated
    except PoolError as exc:
        raise InvalidModel(f"MHAModel refused by the pool: {exc}") from exc
    size, page_size, device = params.capacity_tokens, params.page_size, params.device
    allocator = PagedAllocator(size=size, page_size=page_size, device=device)
    pool = MHAKVPool(spec, size, page_size, device)
    return full_only_system("mha", config, allocator, pool, params)


def full_only_system(
    family: str,
    model: object,
    allocator: PagedAllocator,
    pool: MHAKVPool | MLAKVPool,
    params: BuildParams,
) -> MemorySystem:
    """The paged `allocator` and KV `pool` of a model whose every layer is full attention
    (MHA / GQA, or MLA's latent) wired to a Full-only tree."""
    return assemble_system(
        family,
        model,
        params,
        [FullComponent(allocator)],
        kv_allocator=allocator,
        kv_pool=pool,
        layers=HybridPool.full(pool),
    )
