"""Factories for small device pools (kvstrata.pool), for any package's tests.

Every factory builds a CPU pool by default, small enough for property tests, with keyword
arguments for everything a test may want to vary. `fill_random_bytes` gives every byte of a
pool a seeded random value, so a misplaced copy cannot go unnoticed; `flat_pages` computes the
flat page format from its definition (each buffer cut into pages, buffers side by side), as the
reference that page I/O is checked against.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import pytest
import torch

from kvstrata.pool import (
    MambaPool,
    MambaSpec,
    MHAKVPool,
    MHASpec,
    MLAKVPool,
    MLASpec,
    ReqToTokenPool,
    SWAKVPool,
    SWASpec,
)
from kvstrata.pool.base import DevicePool

#: Devices to parametrise a test over: the CPU, and CUDA marked `cuda` (skipped without a GPU).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as a CPU uint8 tensor: compares NaN payloads of random bit patterns exactly."""
    return t.contiguous().view(torch.uint8).cpu()


#: Every dtype a pool can hold, for parametrised tests.
POOL_DTYPES: tuple[torch.dtype, ...] = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)


#: The small shape of each factory below; its keyword arguments replace any of these fields.
MHA_SPEC = MHASpec(num_layers=3, num_kv_heads=2, head_dim=4)
MLA_SPEC = MLASpec(num_layers=3, kv_lora_rank=8, qk_rope_head_dim=4)
MAMBA_SPEC = MambaSpec(
    num_layers=2, conv_dim=6, conv_kernel=4, num_heads=2, head_dim=3, state_size=4
)


def make_mha_pool(
    *, size: int = 32, page_size: int = 4, device: torch.device | str = "cpu", **fields: Any
) -> MHAKVPool:
    """An MHA pool of `MHA_SPEC` with `fields` (any `MHASpec` field) replaced."""
    return MHAKVPool(replace(MHA_SPEC, **fields), size=size, page_size=page_size, device=device)


def make_mla_pool(
    *, size: int = 32, page_size: int = 4, device: torch.device | str = "cpu", **fields: Any
) -> MLAKVPool:
    """An MLA pool of `MLA_SPEC` with `fields` (any `MLASpec` field) replaced."""
    return MLAKVPool(replace(MLA_SPEC, **fields), size=size, page_size=page_size, device=device)


def make_swa_pool(
    *,
    full_layer_ids: Sequence[int] = (0, 2),
    swa_layer_ids: Sequence[int] = (1, 3),
    num_kv_heads: int = 2,
    head_dim: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    sliding_window: int = 8,
    size: int = 32,
    swa_size: int = 16,
    page_size: int = 4,
    device: torch.device | str = "cpu",
) -> SWAKVPool:
    def sub(n: int) -> MHASpec:
        return MHASpec(num_layers=n, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)

    spec = SWASpec(
        full=sub(len(full_layer_ids)),
        swa=sub(len(swa_layer_ids)),
        full_layer_ids=tuple(full_layer_ids),
        swa_layer_ids=tuple(swa_layer_ids),
        sliding_window=sliding_window,
    )
    return SWAKVPool(spec, size=size, swa_size=swa_size, page_size=page_size, device=device)


def make_mamba_pool(
    *, size: int = 8, device: torch.device | str = "cpu", **fields: Any
) -> MambaPool:
    """A Mamba pool of `MAMBA_SPEC` (bf16 conv, fp32 SSM state) with `fields` (any `MambaSpec`
    field) replaced."""
    return MambaPool(replace(MAMBA_SPEC, **fields), size=size, device=device)


def make_req_to_token_pool(
    *, size: int = 8, max_context_len: int = 16, device: torch.device | str = "cpu"
) -> ReqToTokenPool:
    return ReqToTokenPool(size, max_context_len, device)


def fill_random_bytes(pool: DevicePool, *, seed: int) -> None:
    """Overwrite every byte of every buffer of `pool` (dummy page included) from a seeded
    generator. Values may be NaN bit patterns: compare as bytes, not as floats."""
    gen = torch.Generator().manual_seed(seed)
    for buf in pool.layer_buffers():
        raw = buf.view(torch.uint8)
        noise = torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8)
        raw.copy_(noise.to(raw.device))


def flat_pages(pool: DevicePool, page_ids: Sequence[int]) -> torch.Tensor:
    """The flat page format of `page_ids` straight from its definition (CPU uint8
    `[len(page_ids), page_size_bytes]`): each buffer's bytes cut into pages, the buffers
    concatenated in `layer_buffers()` order. The reference read_pages / write_pages are checked
    against."""
    per_buffer = [
        buf.reshape(pool.num_pages, -1).view(torch.uint8).cpu() for buf in pool.layer_buffers()
    ]
    return torch.cat(per_buffer, dim=1)[list(page_ids)]


def check_page_round_trip(pool: DevicePool, page_ids: torch.Tensor, seed: int) -> None:
    """Read `page_ids` (must equal `flat_pages`), write random pages there, and check that
    exactly those pages changed (against `flat_pages` of the whole pool) and read back
    bit-identical. The one page-I/O round trip of the pool tests (both copy paths)."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty((len(page_ids), pool.page_size_bytes), dtype=torch.uint8)
    pool.read_pages(page_ids, out)
    assert torch.equal(out, flat_pages(pool, page_ids.tolist()))
    before = flat_pages(pool, range(pool.num_pages))
    src = torch.randint(0, 256, out.shape, generator=gen, dtype=torch.uint8)
    pool.write_pages(page_ids, src)
    after = flat_pages(pool, range(pool.num_pages))
    assert torch.equal(after[page_ids], src)
    untouched = torch.ones(pool.num_pages, dtype=torch.bool)
    untouched[page_ids] = False
    assert torch.equal(after[untouched], before[untouched]), "a page outside the ids changed"
    back = torch.zeros_like(src)
    pool.read_pages(page_ids, back)
    assert torch.equal(back, src)


class PageIOLayout(NamedTuple):
    """A pool shape the page-I/O tests run on: how to build it and whether its buffers form one
    stack (the case the one-piece copy path applies to)."""

    make: Callable[[torch.dtype, int, int, str], DevicePool]
    one_stack: bool


#: Pool shapes for the page-I/O tests (pool, compiled copies), each built from
#: `(dtype, page_size, num_pages, device)`; the dtype under test is a Mamba pool's conv dtype.
PAGE_IO_LAYOUTS: dict[str, PageIOLayout] = {
    # 3 layers x K/V x 2 heads x 4 dims: 16-byte pieces at bf16, not whole cache lines.
    "mha": PageIOLayout(
        lambda dtype, p, n, device: make_mha_pool(
            dtype=dtype, size=n * p, page_size=p, device=device
        ),
        one_stack=True,
    ),
    # 2 heads x 32 dims x 2 bytes = 128-byte rows: whole lines, the streamed stores apply.
    "mha-lines": PageIOLayout(
        lambda dtype, p, n, device: make_mha_pool(
            dtype=dtype, head_dim=32, size=n * p, page_size=p, device=device
        ),
        one_stack=True,
    ),
    "mha-two-stacks": PageIOLayout(
        lambda dtype, p, n, device: make_mha_pool(
            dtype=dtype, v_head_dim=3, size=n * p, page_size=p, device=device
        ),
        one_stack=False,
    ),
    "mla": PageIOLayout(
        lambda dtype, p, n, device: make_mla_pool(
            dtype=dtype, size=n * p, page_size=p, device=device
        ),
        one_stack=True,
    ),
    # A Mamba page is one slot; SSM state stays fp32.
    "mamba": PageIOLayout(
        lambda dtype, _p, n, device: make_mamba_pool(conv_dtype=dtype, size=n, device=device),
        one_stack=False,
    ),
}


def make_page_io_pool(
    layout: str, dtype: torch.dtype, page_size: int, *, num_pages: int = 16, device: str = "cpu"
) -> DevicePool:
    """A zeroed pool of `PAGE_IO_LAYOUTS[layout]` with `num_pages` usable pages."""
    return PAGE_IO_LAYOUTS[layout].make(dtype, page_size, num_pages, device)


def page_io_cases(layouts: Sequence[str]) -> list[tuple[str, int]]:
    """`(layout, page_size)` pairs to parametrise over: page sizes 1 and 4 (Mamba: 1)."""
    return [(name, p) for name in layouts for p in ((1,) if name == "mamba" else (1, 4))]
