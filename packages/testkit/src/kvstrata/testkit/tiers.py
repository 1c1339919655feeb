"""Factories for tests of the tier controller and the tiers above it.

`make_tiers(shape)` builds a small model of one of the three shapes the router knows (full only,
full + SWA, attention + Mamba), on CPU by default: device pools whose every byte is seeded noise
(so every token slot of every layer differs and a misplaced copy shows), one host mirror per
pool, the HybridPool and the PoolGroup. `snapshot` / `assert_pages_equal` compare what a member
holds in given slots, buffer by buffer, so a reload can be checked bit-for-bit against what was
written before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from kvstrata.hybrid_cache import HybridPool, PoolGroup
from kvstrata.hybrid_cache.group import AnyHostPool
from kvstrata.pool import MambaPool, MambaSpec, MHAKVPool, MHASpec, SWAKVPool, SWASpec
from kvstrata.pool_host import HostLayout, MambaHostPool, MHAHostPool
from kvstrata.testkit.host_pools import page_tokens
from kvstrata.testkit.pools import fill_random_bytes

Shape = Literal["full", "swa", "mamba"]
SHAPES: tuple[Shape, ...] = ("full", "swa", "mamba")


@dataclass(frozen=True, kw_only=True, eq=False)
class Tiers:
    """A model's device pools, their host mirrors, the router and the pool group."""

    shape: Shape
    pools: HybridPool
    hosts: dict[str, AnyHostPool]
    group: PoolGroup
    page_size: int

    def member_page_size(self, member: str) -> int:
        return self.hosts[member].page_size


def make_tiers(
    shape: Shape,
    *,
    page_size: int = 4,
    device_pages: int = 16,
    host_pages: int = 32,
    layout: HostLayout = HostLayout.page_first,
    seed: int = 0,
    device: str = "cpu",
) -> Tiers:
    """A small model of `shape` on `device` with distinct bytes in every device slot.

    full:  4 MHA layers.
    swa:   layers 0, 2 full and 1, 3 sliding-window (window 2 pages), SWA pool as large as full.
    mamba: attention layers 1, 3 in an MHA pool; mamba layers 0, 2 in a MambaPool with
           `device_pages` state slots (its host mirror has `host_pages` slots).
    """
    size = device_pages * page_size
    head = {"num_kv_heads": 2, "head_dim": 8, "dtype": torch.bfloat16}
    if shape == "full":
        pool = MHAKVPool(
            MHASpec(num_layers=4, **head), size=size, page_size=page_size, device=device
        )
        pools = HybridPool.full(pool)
        device_pools: dict[str, MHAKVPool | MambaPool] = {"full": pool}
    elif shape == "swa":
        spec = SWASpec(
            full=MHASpec(num_layers=2, **head),
            swa=MHASpec(num_layers=2, **head),
            full_layer_ids=(0, 2),
            swa_layer_ids=(1, 3),
            sliding_window=2 * page_size,
        )
        swa = SWAKVPool(spec, size=size, swa_size=size, page_size=page_size, device=device)
        pools = HybridPool.swa(swa)
        device_pools = {"full": swa.full_pool, "swa": swa.swa_pool}
    else:
        kv = MHAKVPool(MHASpec(num_layers=2, **head), size=size, page_size=page_size, device=device)
        mamba_spec = MambaSpec(
            num_layers=2,
            conv_dim=6,
            conv_kernel=4,
            num_heads=2,
            head_dim=4,
            state_size=3,
            conv_dtype=torch.bfloat16,
            ssm_dtype=torch.float32,
        )
        mamba = MambaPool(mamba_spec, size=device_pages, device=device)
        pools = HybridPool.with_mamba(
            attention=kv, attention_layer_ids=(1, 3), mamba=mamba, mamba_layer_ids=(0, 2)
        )
        device_pools = {"full": kv, "mamba": mamba}
    hosts: dict[str, AnyHostPool] = {}
    for i, (name, pool) in enumerate(device_pools.items()):
        fill_random_bytes(pool, seed=seed * 10 + i)
        if isinstance(pool, MambaPool):
            hosts[name] = MambaHostPool(pool, layout=layout, size=host_pages)
        else:
            hosts[name] = MHAHostPool(pool, layout=layout, size=host_pages * page_size)
    return Tiers(
        shape=shape,
        pools=pools,
        hosts=hosts,
        group=PoolGroup(pools, hosts),
        page_size=page_size,
    )


def page_indices(pages: list[int], page_size: int) -> torch.Tensor:
    """Token indices of whole pages, in order (for a Mamba member page_size is 1: slots)."""
    return page_tokens(pages, page_size)


def snapshot(pool: MHAKVPool | MambaPool, slots: torch.Tensor) -> list[torch.Tensor]:
    """Copies of every buffer's rows at `slots` (token or state slots), for later comparison."""
    return [buf[slots.to(buf.device)].cpu() for buf in pool.layer_buffers()]


def assert_pages_equal(
    pool: MHAKVPool | MambaPool,
    slots: torch.Tensor,
    expected: list[torch.Tensor],
    *,
    what: str = "",
) -> None:
    """Every buffer's rows at `slots` equal `expected` bit for bit."""
    got = snapshot(pool, slots)
    assert len(got) == len(expected), "buffer count changed"
    for b, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(g.view(torch.uint8), e.view(torch.uint8)), (
            f"{what}: buffer {b} differs after reload"
        )


def scramble(pool: MHAKVPool | MambaPool, slots: torch.Tensor, *, seed: int) -> None:
    """Overwrite `slots` of every buffer with other bytes (a slot freed and reused)."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    for buf in pool.layer_buffers():
        rows = buf[slots]
        noise = torch.randint(
            0, 256, rows.view(torch.uint8).shape, generator=gen, dtype=torch.uint8
        )
        buf[slots.to(buf.device)] = noise.to(buf.device).view(rows.dtype).view(rows.shape)


def device_pools(tiers: Tiers) -> Mapping[str, MHAKVPool | MambaPool]:
    """Each member's device pool."""
    return {m.name: m.pool for m in tiers.pools.members}  # pyright: ignore[reportReturnType]
