"""Factories for tests of the host tier (kvstrata.pool_host): small device pools of each family
filled with random bytes, token indices of pages, and byte-level comparisons.

Bytes, not values: every comparison views buffers as uint8, so NaN payloads of random fp8 /
bf16 bit patterns compare exactly. `DTYPES` and `fill_random` are the device-pool helpers of
`kvstrata.testkit.pools` under the names the host tests use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import torch

from kvstrata.pool import MambaPool, MHAKVPool, MLAKVPool
from kvstrata.pool_host import HostPool, MambaHostPool, MHAHostPool, MLAHostPool
from kvstrata.testkit.pools import (
    POOL_DTYPES,
    fill_random_bytes,
    make_mamba_pool,
    make_mha_pool,
    make_mla_pool,
)

Family = Literal["mha", "mla", "mamba"]
FAMILIES: tuple[Family, ...] = get_args(Family)
DTYPES: tuple[torch.dtype, ...] = POOL_DTYPES

DevicePool = MHAKVPool | MLAKVPool | MambaPool

#: The host mirror class of each family.
HOST_CLASSES: dict[Family, type[HostPool]] = {
    "mha": MHAHostPool,
    "mla": MLAHostPool,
    "mamba": MambaHostPool,
}


def make_device_pool(
    family: Family,
    *,
    dtype: torch.dtype = torch.bfloat16,
    page_size: int = 4,
    num_pages: int = 12,
    num_layers: int = 3,
    start_layer: int = 0,
    device: str = "cpu",
) -> DevicePool:
    """A small device pool (`kvstrata.testkit.pools` factories) with `num_pages` usable pages
    (Mamba: slots, page size 1). MHA has V narrower than K, so per-buffer offsets are
    exercised; Mamba keeps fp32 SSM state when `dtype` is fp8 for the conv state."""
    size = num_pages * page_size
    if family == "mha":
        return make_mha_pool(
            num_layers=num_layers,
            head_dim=8,
            v_head_dim=4,
            dtype=dtype,
            start_layer=start_layer,
            size=size,
            page_size=page_size,
            device=device,
        )
    if family == "mla":
        return make_mla_pool(
            num_layers=num_layers,
            dtype=dtype,
            start_layer=start_layer,
            size=size,
            page_size=page_size,
            device=device,
        )
    return make_mamba_pool(
        num_layers=num_layers,
        conv_dim=3,
        head_dim=4,
        state_size=3,
        conv_dtype=dtype,
        ssm_dtype=torch.float32 if dtype.itemsize == 1 else dtype,
        size=num_pages,
        device=device,
    )


def fill_random(pool: DevicePool, *, seed: int) -> None:
    """Overwrite every buffer of `pool` (dummy page included, CPU or CUDA) with seeded random
    bytes."""
    fill_random_bytes(pool, seed=seed)


def page_tokens(pages: Sequence[int] | torch.Tensor, page_size: int) -> torch.Tensor:
    """Token indices (int64) of whole pages, in page order."""
    ids = torch.as_tensor(pages, dtype=torch.int64).reshape(-1)
    return (ids[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def buffer_pages(buf: torch.Tensor, page_size: int) -> torch.Tensor:
    """A device buffer as uint8 rows, one per page (a view on CPU)."""
    return buf.view(buf.shape[0], -1).view(torch.uint8).view(buf.shape[0] // page_size, -1)


def snapshot(pool: DevicePool) -> list[torch.Tensor]:
    """A CPU copy of every buffer's bytes, one row per page."""
    return [buffer_pages(b, pool.page_size).cpu().clone() for b in pool.layer_buffers()]


def read_flat(pool: DevicePool, pages: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Flat pages of `pool` as read_pages returns them, on the CPU."""
    ids = torch.as_tensor(pages, dtype=torch.int64).reshape(-1)
    out = torch.empty((ids.numel(), pool.page_size_bytes), dtype=torch.uint8)
    pool.read_pages(ids.to(pool.device), out)
    return out


def zero_pool(pool: DevicePool) -> None:
    """Zero every buffer of `pool`: bytes that appear afterwards were copied in."""
    for buf in pool.layer_buffers():
        buf.view(buf.shape[0], -1).view(torch.uint8).zero_()
