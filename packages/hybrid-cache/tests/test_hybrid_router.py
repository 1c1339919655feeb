"""HybridPool routing for the three model shapes, and PoolGroup's checks of its members."""

from __future__ import annotations

import pytest
import torch

from kvstrata.hybrid_cache import (
    HybridPool,
    InvalidPoolLayout,
    LayerKind,
    LayerKindMismatch,
    PoolGroup,
    RestoreKind,
    UnknownLayer,
)
from kvstrata.pool import MambaPool, MambaSpec, MHAKVPool, MHASpec, SWAKVPool, SWASpec
from kvstrata.pool_host import MambaHostPool, MHAHostPool
from kvstrata.testkit.tiers import make_tiers

HEAD = {"num_kv_heads": 2, "head_dim": 4, "dtype": torch.float32}


def kv(num_layers: int, *, start_layer: int = 0, size: int = 16) -> MHAKVPool:
    spec = MHASpec(num_layers=num_layers, start_layer=start_layer, **HEAD)
    return MHAKVPool(spec, size, 4, "cpu")


def mamba(num_layers: int) -> MambaPool:
    spec = MambaSpec(
        num_layers=num_layers, conv_dim=3, conv_kernel=3, num_heads=2, head_dim=2, state_size=2
    )
    return MambaPool(spec, 4, "cpu")


def swa(
    *,
    full_layer_ids: tuple[int, ...],
    swa_layer_ids: tuple[int, ...],
    sliding_window: int,
    swa_size: int,
) -> SWAKVPool:
    """An SWA pool of 16 full slots and `swa_size` SWA slots (pages of 4), one MHA layer per id."""
    spec = SWASpec(
        full=MHASpec(num_layers=len(full_layer_ids), **HEAD),
        swa=MHASpec(num_layers=len(swa_layer_ids), **HEAD),
        full_layer_ids=full_layer_ids,
        swa_layer_ids=swa_layer_ids,
        sliding_window=sliding_window,
    )
    return SWAKVPool(spec, 16, swa_size, 4, "cpu")


def kv_values(n: int, seed: float) -> torch.Tensor:
    return torch.arange(n * 8, dtype=torch.float32).reshape(n, 2, 4) + seed


def test_full_only_routes_every_layer_to_the_one_pool() -> None:
    pool = kv(3, start_layer=5)  # a pipeline stage holding layers 5..7
    router = HybridPool.full(pool)
    assert router.layer_ids == (5, 6, 7)
    assert router.member_names == ("full",)
    for layer in (5, 6, 7):
        route = router.route(layer)
        assert (route.member, route.pool, route.local_layer_id) == ("full", pool, layer)
        assert route.kind is LayerKind.ATTENTION
        assert router.get_key_buffer(layer) is pool.get_key_buffer(layer)
        assert router.get_value_buffer(layer) is pool.get_value_buffer(layer)
    loc = torch.tensor([4, 9])
    router.set_kv(6, loc, kv_values(2, 0.5), kv_values(2, 1.5))
    assert torch.equal(pool.get_key_buffer(6)[loc], kv_values(2, 0.5))
    assert torch.equal(pool.get_value_buffer(6)[loc], kv_values(2, 1.5))
    assert torch.equal(router.layer_loc(6, loc), loc)
    with pytest.raises(UnknownLayer, match=r"no pool owns layer 4; the model's layers are 5, 6, 7"):
        router.route(4)
    with pytest.raises(LayerKindMismatch):
        router.mamba_state(5)
    assert router.member("full").rule.kind is RestoreKind.PREFIX


def test_swa_routes_window_layers_to_the_swa_pool_at_translated_slots() -> None:
    pool = swa(full_layer_ids=(0, 3), swa_layer_ids=(1, 2), sliding_window=6, swa_size=8)
    mapping = torch.zeros(pool.full_pool.num_rows, dtype=torch.int64)
    mapping[8:12] = torch.arange(4, 8)  # full page 2 lives on SWA page 1
    pool.set_full_to_swa(mapping)
    router = HybridPool.swa(pool)
    assert router.layer_ids == (0, 1, 2, 3)
    assert router.member_names == ("full", "swa")
    assert [router.route(i).member for i in range(4)] == ["full", "swa", "swa", "full"]
    assert router.route(2).pool is pool.swa_pool and router.route(2).local_layer_id == 1
    assert router.route(3).pool is pool.full_pool and router.route(3).local_layer_id == 1
    rule = router.member("swa").rule
    assert rule.kind is RestoreKind.WINDOW and rule.window_pages == 2  # 6 tokens, pages of 4

    loc = torch.tensor([8, 9])
    router.set_kv(2, loc, kv_values(2, 0.25), kv_values(2, 0.75))
    swa_loc = router.layer_loc(2, loc)
    assert swa_loc.tolist() == [4, 5]
    assert torch.equal(router.get_key_buffer(2)[swa_loc], kv_values(2, 0.25))
    assert torch.equal(pool.swa_pool.get_value_buffer(1)[swa_loc], kv_values(2, 0.75))
    router.set_kv(3, loc, kv_values(2, 2.0), kv_values(2, 3.0))
    assert torch.equal(pool.full_pool.get_key_buffer(1)[loc], kv_values(2, 2.0))
    assert torch.equal(router.layer_loc(3, loc), loc)


def test_attention_plus_mamba_routes_by_layer_kind() -> None:
    attention, states = kv(2), mamba(3)
    router = HybridPool.with_mamba(
        attention=attention, attention_layer_ids=(2, 5), mamba=states, mamba_layer_ids=(0, 1, 3)
    )
    assert router.layer_ids == (0, 1, 2, 3, 5)
    assert [router.kind(i) for i in router.layer_ids] == [
        LayerKind.MAMBA,
        LayerKind.MAMBA,
        LayerKind.ATTENTION,
        LayerKind.MAMBA,
        LayerKind.ATTENTION,
    ]
    assert router.route(5).local_layer_id == 1 and router.route(5).pool is attention
    state = router.mamba_state(3)
    assert state.conv.data_ptr() == states.conv_state[2].data_ptr()
    assert state.ssm.data_ptr() == states.ssm_state[2].data_ptr()
    loc = torch.tensor([5])
    router.set_kv(5, loc, kv_values(1, 7.0), kv_values(1, 8.0))
    assert torch.equal(attention.get_key_buffer(1)[loc], kv_values(1, 7.0))
    with pytest.raises(LayerKindMismatch):
        router.get_key_buffer(0)
    with pytest.raises(LayerKindMismatch):
        router.set_kv(1, loc, kv_values(1, 0.0), kv_values(1, 0.0))
    with pytest.raises(UnknownLayer):
        router.get_value_buffer(4)
    assert router.member("mamba").rule.kind is RestoreKind.BOUNDARY


def test_attention_through_swa_plus_mamba() -> None:
    router = HybridPool.with_mamba(
        attention=swa(full_layer_ids=(0,), swa_layer_ids=(1,), sliding_window=4, swa_size=16),
        attention_layer_ids=(1, 3),
        mamba=mamba(2),
        mamba_layer_ids=(0, 2),
    )
    assert router.member_names == ("full", "swa", "mamba")
    assert [router.route(i).member for i in router.layer_ids] == ["mamba", "full", "mamba", "swa"]


@pytest.mark.parametrize(
    ("attention_ids", "mamba_ids", "match"),
    [
        ((0, 1), (1, 2, 3), "both attention and mamba"),
        ((0, 1), (2, 3), "mamba layer ids for a MambaPool of 3"),
        ((0,), (1, 2, 3), "attention layer ids for a KV pool of 2"),
        ((0, 0), (1, 2, 3), "unique"),
    ],
)
def test_layouts_that_do_not_fit_are_refused(
    attention_ids: tuple[int, ...], mamba_ids: tuple[int, ...], match: str
) -> None:
    with pytest.raises(InvalidPoolLayout, match=match):
        HybridPool.with_mamba(
            attention=kv(2),
            attention_layer_ids=attention_ids,
            mamba=mamba(3),
            mamba_layer_ids=mamba_ids,
        )


def test_pool_group_needs_one_mirror_per_member_of_that_pool() -> None:
    tiers = make_tiers("mamba")
    kv_pool = tiers.pools.member("full").pool
    assert isinstance(kv_pool, MHAKVPool)
    with pytest.raises(InvalidPoolLayout, match="host mirrors given"):
        PoolGroup(tiers.pools, {"full": tiers.hosts["full"]})
    other = MambaHostPool(mamba(2), size=4)
    with pytest.raises(InvalidPoolLayout, match="mirrors another device pool"):
        PoolGroup(tiers.pools, {"full": tiers.hosts["full"], "mamba": other})
    group = tiers.group
    assert group.storage_key("full", b"k1") == b"k1"
    assert group.storage_key("mamba", b"k1") == b"k1|mamba"
    assert group.layer_ids == (0, 1, 2, 3)
    assert group.page_bytes("full") == MHAHostPool(kv_pool, size=4).page_size_bytes
